package chunkindex

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/registry/api"
	"github.com/cryo-oci/cryo/registry/extstore"
	"github.com/distribution/distribution/v3"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sync/errgroup"
)

// Format v2 (SPEC.md 12.2.1). A pack holds many chunks, so it is never
// cross-mounted: a new repository's readers could read every chunk in it.
// Instead the registry composes, in the pusher's repository, a new pack of
// just the chunks the pusher names, copying their frames from packs in
// repositories the pusher may pull from, each frame decoded and checked
// against the chunk's digest as it is copied.
//
// The index of v2 frames is sparse (as in sparse indexing for backup
// dedup, Lillibridge et al., FAST '09): one entry per anchor chunk (1 in
// 16, by digest), naming a pack that holds it, and one frame list
// per pack; the chunk at the start of each pack is an anchor too. Chunks
// of a file lie side by side in its packs, and a pusher asks for the
// chunks of one pack at a time, so the anchors among them, and the first
// of them (which starts a pack, if its packs are cut where the pusher's
// are), find the packs that hold the others: a 1 GiB push writes about a
// thousand entries and a hundred and fifty lists instead of sixteen
// thousand entries. Both are the pusher's word, recorded unverified at
// push (reading back every pushed byte would cost each push what only a
// composition needs), never answered to lookups, and checked frame by
// frame whenever a composition copies one.

// isAnchor reports whether chunk d is an anchor by its digest: 1 in 16
// are, those whose digest's last hex digit is 0.
func isAnchor(d digest.Digest) bool {
	e := d.Encoded()
	return len(e) > 0 && e[len(e)-1] == '0'
}

// PacksRoot is where the frame lists of packs live in the storage driver:
// PacksRoot/sha256/<hh>/<pack hex>.
const PacksRoot = "/cryo/v1/packs"

// PackListPath is where pack d's frame list is stored.
func PackListPath(d digest.Digest) string { return shardPath(PacksRoot, d) }

// packList is a pack's frame list: the frames chunk tables say it holds.
type packList struct {
	// Repositories link the pack (at most maxRepositories are recorded).
	Repositories []string      `json:"repositories"`
	Size         int64         `json:"size"`
	Frames       []listedFrame `json:"frames"`
	// Neighbors are the packs that tables list right before or after
	// this one in a file (at most maxNeighbors): a pusher whose packs are
	// cut elsewhere than the earlier writer's asks for the tail of one
	// pack and the head of the next, and the tail may hold no anchor.
	Neighbors []digest.Digest `json:"neighbors,omitempty"`
}

// maxNeighbors bounds the neighbors a pack list records.
const maxNeighbors = 8

// maxRepositories bounds the repositories an anchor entry or a pack list
// records: enough to find one the caller may pull from.
const maxRepositories = 64

// withRepository returns repos with repo added (unless it is there or
// repos is full), and whether it changed.
func withRepository(repos []string, repo string) ([]string, bool) {
	if slices.Contains(repos, repo) || len(repos) >= maxRepositories {
		return repos, false
	}
	return append(repos, repo), true
}

// listedFrame is one frame of a pack list.
type listedFrame struct {
	Digest   digest.Digest `json:"digest"`
	Size     int64         `json:"size"`
	Encoding string        `json:"encoding"`
	Offset   int64         `json:"offset"`
	Length   int64         `json:"length"`
}

// maxListedFrames bounds a pack list (about 2 MB of JSON): frames past
// it are not listed.
const maxListedFrames = 16384

// composeMemory bounds the bytes all compositions hold at once: at least
// one largest (a pack of api.MaxComposePack, a frame and a chunk of
// format.MaxChunkSize each).
const composeMemory = 64 << 20

// composeSources bounds the packs whose frame lists give a composition
// frames; composeCandidates the frames of one chunk it tries before it
// leaves the chunk out.
const (
	composeSources    = 16
	composeCandidates = 3
	// composeEntries bounds the anchor entries of one chunk, naming a
	// repository the caller may pull from, whose packs a composition
	// reads; composeEntryReads the entries of one chunk it reads to find
	// them, so that entries of repositories the caller cannot see take
	// no place of those it can, and composeEntryBudget those of all
	// chunks.
	composeEntries     = 32
	composeEntryReads  = 256
	composeEntryBudget = 4096
)

// indexFrames records v2 table t pushed to repo (r): for each pack it
// names, linked in repo with the size the table says, the frames the
// table puts there (merged into the pack's list), and an entry for each
// anchor chunk naming that pack. The frames' bytes are checked only when
// a composition copies them.
func (ci *Index) indexFrames(ctx context.Context, repo string, r distribution.Repository, t *format.Table) error {
	byPack := map[digest.Digest][]listedFrame{}
	// neighbors are the packs before and after each in the file's
	// order of chunks.
	neighbors := map[digest.Digest][]digest.Digest{}
	var last digest.Digest
	for _, c := range t.Chunks {
		if !c.Packed() {
			continue
		}
		byPack[c.Blob] = append(byPack[c.Blob], listedFrame{Digest: c.Digest, Size: c.Size, Encoding: string(c.Encoding), Offset: c.PackOffset, Length: c.BlobSize})
		if last != "" && last != c.Blob {
			neighbors[last], _ = withNeighbor(neighbors[last], c.Blob)
			neighbors[c.Blob], _ = withNeighbor(neighbors[c.Blob], last)
		}
		last = c.Blob
	}
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(indexParallelism)
	linked := map[digest.Digest]bool{}
	var packs []ocispec.Descriptor
	for _, p := range t.Packs {
		desc, err := r.Blobs(ctx).Stat(ctx, p.Digest)
		if err != nil || desc.Size != p.Size {
			continue
		}
		linked[p.Digest] = true
		packs = append(packs, p)
	}
	for _, p := range packs {
		// Only packs the repository links are recorded as neighbors:
		// a table cannot fill a list's slots with packs it does not hold.
		var nbs []digest.Digest
		for _, nb := range neighbors[p.Digest] {
			if linked[nb] {
				nbs = append(nbs, nb)
			}
		}
		g.Go(func() error { return ci.mergePackList(gctx, repo, p, byPack[p.Digest], nbs) })
	}
	type key struct{ chunk, pack digest.Digest }
	seen := map[key]bool{}
	for _, c := range t.Chunks {
		k := key{c.Digest, c.Blob}
		if !c.Packed() || !linked[c.Blob] || !(isAnchor(c.Digest) || c.PackOffset == 0) || seen[k] {
			continue
		}
		seen[k] = true
		g.Go(func() error { return ci.anchors.add(gctx, repo, c) })
	}
	return g.Wait()
}

// withNeighbor returns packs with p added last (unless it is there), and
// whether it changed. A full list drops its oldest: the packs pushed
// beside this one most recently are those a composition of the next
// snapshot in a chain needs, while the oldest may be long deleted.
func withNeighbor(packs []digest.Digest, p digest.Digest) ([]digest.Digest, bool) {
	if slices.Contains(packs, p) {
		return packs, false
	}
	if len(packs) >= maxNeighbors {
		packs = slices.Delete(packs, 0, len(packs)-maxNeighbors+1)
	}
	return append(packs, p), true
}

// mergePackList adds frames and neighbors of pack p, linked in repo, to
// its list. Two pushes merging at once may lose one's frames: a list is a
// hint, checked at use, and the next push naming the pack adds them
// again.
func (ci *Index) mergePackList(ctx context.Context, repo string, p ocispec.Descriptor, frames []listedFrame, neighbors []digest.Digest) error {
	lp := PackListPath(p.Digest)
	var list packList
	var changed bool
	data, err := ci.driver.GetContent(ctx, lp)
	if err != nil && !extstore.IsNotFound(err) {
		// A list other repositories wrote is not overwritten on a failed
		// read: only one that is not there is started anew.
		return fmt.Errorf("read list of pack %s: %w", p.Digest, err)
	}
	fresh := err != nil || json.Unmarshal(data, &list) != nil || list.Size != p.Size
	if fresh {
		list = packList{Size: p.Size}
	}
	list.Repositories, changed = withRepository(list.Repositories, repo)
	changed = changed || fresh
	have := make(map[int64]bool, len(list.Frames))
	for _, f := range list.Frames {
		have[f.Offset] = true
	}
	for _, f := range frames {
		// A chunk the table names twice has one frame: listed once.
		if !have[f.Offset] && len(list.Frames) < maxListedFrames {
			have[f.Offset] = true
			list.Frames = append(list.Frames, f)
			changed = true
		}
	}
	for _, n := range neighbors {
		var added bool
		list.Neighbors, added = withNeighbor(list.Neighbors, n)
		changed = changed || added
	}
	if !changed {
		return nil
	}
	data, _ = json.Marshal(list)
	if err := ci.driver.PutContent(ctx, lp, data); err != nil {
		return fmt.Errorf("index pack %s: %w", p.Digest, err)
	}
	return nil
}

// linkCache answers whether a repository links a blob (Index.linked),
// asking the store once per (repository, blob): a composition checks a
// pack for each anchor that names it, gc for each list, entry and anchor.
// It is safe for concurrent use (gc walks a redis cluster's masters at
// once). What it remembers is as old as the cache: it lives for one
// composition or one gc pass.
type linkCache struct {
	ci    *Index
	mu    sync.Mutex
	known map[api.ChunkBlob]bool
}

func (ci *Index) newLinkCache() *linkCache {
	return &linkCache{ci: ci, known: map[api.ChunkBlob]bool{}}
}

// linked reports whether repository b.Repository links blob b.Digest.
func (lc *linkCache) linked(ctx context.Context, b api.ChunkBlob) (bool, error) {
	lc.mu.Lock()
	live, ok := lc.known[b]
	lc.mu.Unlock()
	if ok {
		return live, nil
	}
	live, err := lc.ci.linked(ctx, b)
	if err != nil {
		return false, err
	}
	lc.mu.Lock()
	lc.known[b] = live
	lc.mu.Unlock()
	return live, nil
}

// keep returns, of repos, those that still link blob d, and reports
// whether any was dropped.
func (lc *linkCache) keep(ctx context.Context, d digest.Digest, repos []string) ([]string, bool, error) {
	var kept []string
	for _, r := range repos {
		live, err := lc.linked(ctx, api.ChunkBlob{Repository: r, Digest: d})
		if err != nil {
			return repos, false, err
		}
		if live {
			kept = append(kept, r)
		}
	}
	return kept, len(kept) != len(repos), nil
}

// source is a frame a composition may copy: chunk c's frame (c.Blob,
// c.PackOffset, c.BlobSize, c.PackSize, c.Encoding) in repository repo.
type source struct {
	repo string
	c    format.Chunk
}

// frameOf returns the frame f of pack (size bytes) describes for a chunk
// of the size wanted, if it is one a table could hold.
func frameOf(pack digest.Digest, size int64, f listedFrame, want api.ComposeChunk) (format.Chunk, bool) {
	c := format.Chunk{Size: want.Size, Digest: want.Digest, Encoding: format.Encoding(f.Encoding), Blob: pack, PackSize: size, PackOffset: f.Offset, BlobSize: f.Length}
	if f.Digest != want.Digest || f.Size != want.Size || c.Check() != nil {
		return format.Chunk{}, false
	}
	return c, true
}

// Compose makes in repository repo a pack of frames of the chunks asked
// for, in their order, copied from packs in repositories visible says the
// caller may pull from (repo included), found through the anchors among
// the chunks asked for, each frame decoded and checked against its chunk
// before it is copied. Chunks it finds no good frame of are left out; so
// is every chunk from the first whose frame would take the pack past
// api.MaxComposePack. If the frames found come to fewer than minLength
// bytes (or none), no pack is made and the answer lists no frames.
func (ci *Index) Compose(ctx context.Context, repo string, chunks []api.ComposeChunk, minLength int64, visible func(repo string) bool) (*api.ComposeResponse, error) {
	var largest int64
	sizes := make(map[digest.Digest]int64, len(chunks))
	for _, c := range chunks {
		if err := c.Digest.Validate(); err != nil || c.Digest.Algorithm() != digest.SHA256 {
			return nil, fmt.Errorf("chunk %q: %w", c.Digest, errBadRequest)
		}
		if c.Size <= 0 || c.Size > format.MaxChunkSize {
			return nil, fmt.Errorf("chunk %s: size %d, want 1..%d: %w", c.Digest, c.Size, format.MaxChunkSize, errBadRequest)
		}
		if s, ok := sizes[c.Digest]; ok && s != c.Size {
			return nil, fmt.Errorf("chunk %s asked for with sizes %d and %d: %w", c.Digest, s, c.Size, errBadRequest)
		}
		sizes[c.Digest] = c.Size
		largest = max(largest, c.Size)
	}
	target, err := ci.repository(ctx, repo)
	if err != nil {
		return nil, err
	}
	src := &frameSource{ci: ci, ctx: ctx, visible: visible, readers: map[string]*blobReader{}, bad: map[digest.Digest]bool{},
		links: ci.newLinkCache(), noList: map[digest.Digest]bool{}}
	defer src.close()
	sources, err := src.find(chunks)
	if err != nil {
		return nil, err
	}
	empty := &api.ComposeResponse{Frames: []api.ComposedFrame{}}
	if len(sources) == 0 {
		return empty, nil
	}
	// The pack being built (at most the chunks' sizes), one frame and its
	// decoded chunk.
	var total int64
	for _, c := range chunks {
		if sources[c.Digest] != nil {
			total += c.Size
		}
	}
	packCap := min(total, api.MaxComposePack)
	weight := packCap + 2*largest
	if err := ci.composeMem.Acquire(ctx, weight); err != nil {
		return nil, err
	}
	defer ci.composeMem.Release(weight)
	pack := make([]byte, 0, packCap)
	var frame, decoded []byte
	resp := &api.ComposeResponse{Frames: []api.ComposedFrame{}}
	done := map[digest.Digest]bool{}
	for _, want := range chunks {
		if done[want.Digest] {
			continue
		}
		done[want.Digest] = true
		c, ok, err := src.copyable(sources[want.Digest], &frame, &decoded)
		if err != nil {
			return nil, err
		}
		if !ok {
			continue
		}
		if len(pack)+len(frame) > api.MaxComposePack {
			break
		}
		resp.Frames = append(resp.Frames, api.ComposedFrame{Digest: want.Digest, Size: want.Size, Encoding: string(c.Encoding),
			PackOffset: int64(len(pack)), PackLength: int64(len(frame))})
		pack = append(pack, frame...)
	}
	if len(pack) == 0 || int64(len(pack)) < minLength {
		return empty, nil
	}
	desc := ocispec.Descriptor{MediaType: format.MediaTypePack, Digest: digest.FromBytes(pack), Size: int64(len(pack))}
	if err := storeBlob(ctx, target, desc, pack); err != nil {
		return nil, fmt.Errorf("store composed pack in %s: %w", repo, err)
	}
	resp.Pack = &api.PackDescriptor{MediaType: desc.MediaType, Digest: desc.Digest, Size: desc.Size}
	return resp, nil
}

// errBadRequest marks a composition asked for with invalid chunks.
var errBadRequest = errors.New("invalid composition request")

// IsBadRequest reports whether err is Compose refusing its request.
func IsBadRequest(err error) bool { return errors.Is(err, errBadRequest) }

// storeBlob stores data as desc in r. It writes it even if r links it
// already, so that the link is renewed and the garbage-collection grace
// period (SPEC.md 12.5) keeps the pack until the pusher's manifest names
// it.
func storeBlob(ctx context.Context, r distribution.Repository, desc ocispec.Descriptor, data []byte) error {
	blobs := r.Blobs(ctx)
	w, err := blobs.Create(ctx)
	if err != nil {
		return err
	}
	if _, err := w.Write(data); err != nil {
		_ = w.Cancel(ctx)
		return err
	}
	if _, err := w.Commit(ctx, desc); err != nil {
		_ = w.Cancel(ctx)
		return err
	}
	return nil
}

// frameSource reads recorded frames for one composition, keeping a reader
// open per source blob (frames of one pack are usually asked for in
// order).
type frameSource struct {
	ci      *Index
	ctx     context.Context
	visible func(repo string) bool
	readers map[string]*blobReader // by repository and blob
	// bad holds the packs whose lists named a frame that does not hold
	// its chunk; firstBad describes the first such frame, for one log
	// line per composition.
	bad      map[digest.Digest]bool
	firstBad []any
	// links caches which (repository, pack) are linked, and noList the
	// packs without a readable list, so that packs many anchors name
	// cost their checks once.
	links  *linkCache
	noList map[digest.Digest]bool
}

func (s *frameSource) close() {
	for _, r := range s.readers {
		r.Close()
	}
	if len(s.bad) > 0 {
		s.ci.opts.Logger.Warn("chunk index: pack lists name frames that do not hold their chunks; frames dropped from the lists (the first is named)",
			append([]any{"packs", len(s.bad)}, s.firstBad...)...)
	}
}

// find returns, for the chunks asked for, the frames the lists of the
// packs their anchors name say hold them, and then, while chunks are left
// without one, the lists of those packs' neighbors: at most
// composeCandidates per chunk, from at most composeSources visible packs.
func (s *frameSource) find(chunks []api.ComposeChunk) (map[digest.Digest][]source, error) {
	ctx := s.ctx
	wanted := make(map[digest.Digest]api.ComposeChunk, len(chunks))
	for _, c := range chunks {
		wanted[c.Digest] = c
	}
	out := map[digest.Digest][]source{}
	packs := 0
	seen := map[digest.Digest]bool{}
	// found are the packs that gave frames, in the order found.
	var found []*packList
	budget := composeEntryBudget
	for i, want := range chunks {
		if !(isAnchor(want.Digest) || i == 0) || packs == composeSources || budget == 0 {
			continue
		}
		taken := 0
		err := s.ci.anchors.each(ctx, want.Digest, composeEntryReads, func(a anchor) (bool, error) {
			if taken == composeEntries || budget == 0 {
				return false, nil
			}
			budget--
			if seen[a.pack] || (a.repos != nil && !slices.ContainsFunc(a.repos, s.visible)) {
				return true, nil
			}
			list, n, err := s.addPack(a.pack, a.repos, wanted, out)
			if err != nil {
				return false, err
			}
			if list == nil {
				// Not linked where the caller may pull from (or no
				// list): not read again for another chunk's entry.
				seen[a.pack] = a.repos == nil
				return true, nil
			}
			seen[a.pack] = true
			taken++
			if n > 0 {
				found = append(found, list)
				packs++
			}
			return packs < composeSources, nil
		})
		if err != nil {
			return nil, err
		}
	}
	// One hop to the neighbors of the packs found, while chunks are
	// missing: the tail of the pack before the first anchor's, or the
	// head of the one after the last's. At most composeSources lists are
	// read.
	reads := 0
	for _, list := range found {
		for _, nb := range list.Neighbors {
			if packs == composeSources || reads == composeSources || len(out) == len(wanted) {
				return out, nil
			}
			if seen[nb] || s.noList[nb] || nb.Validate() != nil {
				continue
			}
			seen[nb] = true
			reads++
			_, n, err := s.addPack(nb, nil, wanted, out)
			if err != nil {
				return nil, err
			}
			if n > 0 {
				packs++
			}
		}
	}
	return out, nil
}

// addPack adds to out the frames of chunks wanted that pack's list names,
// from the first of repos (nil: the list's own) the caller may pull from
// that still links the pack, and returns the list and how many frames it
// added.
func (s *frameSource) addPack(pack digest.Digest, repos []string, wanted map[digest.Digest]api.ComposeChunk, out map[digest.Digest][]source) (*packList, int, error) {
	if s.noList[pack] {
		return nil, 0, nil
	}
	// An anchor's repositories are checked before the list is read.
	repo := ""
	if repos != nil {
		var err error
		if repo, err = s.firstLinked(pack, repos); err != nil || repo == "" {
			return nil, 0, err
		}
	}
	data, err := s.ci.driver.GetContent(s.ctx, PackListPath(pack))
	var list packList
	if err != nil || json.Unmarshal(data, &list) != nil {
		s.noList[pack] = true
		return nil, 0, nil
	}
	if repo == "" {
		if repo, err = s.firstLinked(pack, list.Repositories); err != nil || repo == "" {
			return nil, 0, err
		}
	}
	n := 0
	for _, f := range list.Frames {
		want, ok := wanted[f.Digest]
		if !ok || len(out[f.Digest]) == composeCandidates {
			continue
		}
		if c, ok := frameOf(pack, list.Size, f, want); ok {
			out[f.Digest] = append(out[f.Digest], source{repo: repo, c: c})
			n++
		}
	}
	return &list, n, nil
}

// firstLinked returns the first of repos the caller may pull from that
// links pack ("" if none).
func (s *frameSource) firstLinked(pack digest.Digest, repos []string) (string, error) {
	for _, r := range repos {
		if !s.visible(r) {
			continue
		}
		live, err := s.links.linked(s.ctx, api.ChunkBlob{Repository: r, Digest: pack})
		if err != nil {
			return "", err
		}
		if live {
			return r, nil
		}
	}
	return "", nil
}

// copyable returns the first of sources whose frame, read into *frame, is
// a single frame (zstd) that decodes (into *decoded) to its chunk. A frame
// that does not hold its chunk is dropped from its pack's list (a blob's
// content never changes; a push naming the frame lists it again).
func (s *frameSource) copyable(sources []source, frame, decoded *[]byte) (format.Chunk, bool, error) {
	for _, src := range sources {
		err := s.read(src.repo, src.c, frame)
		if err == nil && src.c.Encoding == format.EncodingZstd {
			// Only a frame that holds nothing but the chunk is copied.
			if err = format.SingleZstdFrame(*frame); err != nil {
				err = fmt.Errorf("%v: %w", err, format.ErrDigestMismatch)
			}
		}
		if err == nil {
			*decoded, err = s.ci.codec.Decode(src.c, *frame, *decoded)
		}
		if err == nil {
			s.ci.opts.OnVerify(true)
			return src.c, true, nil
		}
		if s.ctx.Err() != nil {
			return format.Chunk{}, false, s.ctx.Err()
		}
		if errors.Is(err, format.ErrDigestMismatch) || errors.Is(err, format.ErrTooLarge) {
			s.ci.opts.OnVerify(false)
			if len(s.bad) == 0 {
				s.firstBad = []any{"repository", src.repo, "chunk", src.c.Digest, "pack", src.c.Blob, "offset", src.c.PackOffset, "err", err}
			}
			s.bad[src.c.Blob] = true
			s.dropFrame(src.c)
			continue
		}
		if !errors.Is(err, distribution.ErrBlobUnknown) {
			s.ci.opts.Logger.Warn("chunk index: read a listed frame", "repository", src.repo, "chunk", src.c.Digest, "pack", src.c.Blob, "err", err)
		}
	}
	return format.Chunk{}, false, nil
}

// dropFrame takes chunk c's frame out of its pack's list.
func (s *frameSource) dropFrame(c format.Chunk) {
	lp := PackListPath(c.Blob)
	data, err := s.ci.driver.GetContent(s.ctx, lp)
	if err != nil {
		return
	}
	var list packList
	if json.Unmarshal(data, &list) != nil {
		_ = s.ci.driver.Delete(s.ctx, lp)
		return
	}
	list.Frames = slices.DeleteFunc(list.Frames, func(f listedFrame) bool { return f.Offset == c.PackOffset && f.Digest == c.Digest })
	data, _ = json.Marshal(list)
	_ = s.ci.driver.PutContent(s.ctx, lp, data)
}

// read reads chunk c's frame (c.BlobSize bytes at c.PackOffset of blob
// c.Blob, linked in repo with size c.PackSize) into *frame. A blob's
// reader stays open while frames are read in order; a frame elsewhere
// reopens it at its offset.
func (s *frameSource) read(repo string, c format.Chunk, frame *[]byte) error {
	key := repo + "@" + c.Blob.String()
	rd, ok := s.readers[key]
	if ok && rd.pos != c.PackOffset {
		rd.Close()
		delete(s.readers, key)
		ok = false
	}
	if !ok {
		r, err := s.ci.repository(s.ctx, repo)
		if err != nil {
			return err
		}
		rc, err := s.ci.openBlob(s.ctx, r, c.Blob, c.PackSize, c.PackOffset)
		if err != nil {
			return err
		}
		rd = &blobReader{ReadCloser: rc, pos: c.PackOffset}
		s.readers[key] = rd
	}
	if int64(cap(*frame)) < c.BlobSize {
		*frame = make([]byte, c.BlobSize)
	}
	*frame = (*frame)[:c.BlobSize]
	n, err := io.ReadFull(rd, *frame)
	rd.pos += int64(n)
	if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
		return fmt.Errorf("blob %s ends before frame %d+%d: %w", c.Blob, c.PackOffset, c.BlobSize, format.ErrDigestMismatch)
	}
	return err
}

// blobReader reads a blob from pos on.
type blobReader struct {
	io.ReadCloser
	pos int64
}
