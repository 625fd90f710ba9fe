package format

import (
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"sync"

	"github.com/cryo-oci/cryo/format/chunker"
	"github.com/cryo-oci/cryo/internal/ordered"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sync/errgroup"
)

// packUploads bounds the packs of one file being uploaded at once while
// the next is filled.
const packUploads = 4

// v2Result is a chunk identified (and, if new, compressed) by a worker.
type v2Result struct {
	buf   *[]byte // the chunk's bytes
	zbuf  *[]byte // holds frame when it is compressed; nil else
	chunk Chunk
	// frame is the chunk's stored bytes if no pack holds it yet; nil for
	// zero and reused chunks.
	frame []byte
}

// packStreamV2 is packStream for format v2: the file's new chunks go, in
// order, into packs of about PackOptions.PackSize; chunks the resolver
// knows are referenced where they lie, and a chunk seen before in the file
// references its first frame. Nothing depends on other files packed at
// the same time, so a snapshot's digest is the same however its files
// are added.
func (p *packer) packStreamV2(ctx context.Context, f fileEntry, r io.Reader) ([]ocispec.Descriptor, int64, error) {
	ck, err := chunker.New(r, p.opts.Chunking)
	if err != nil {
		return nil, 0, err
	}
	fileHash := sha256.New()
	var chunks []Chunk
	var size int64
	uploads, uctx := errgroup.WithContext(ctx)
	uploads.SetLimit(packUploads)
	// pack is the open pack, members the indices in chunks of the chunks
	// whose frames it holds; first finds the first entry of a chunk
	// stored in this file, and dups lists the later entries of one, set
	// from it once every pack is sealed.
	newPack := func() []byte { return (*p.packs.Get().(*[]byte))[:0] }
	pack := newPack()
	var members []int
	first := map[digest.Digest]int{}
	var dups [][2]int // {entry, first entry}
	// moved are entries whose frames a composer put elsewhere, applied
	// once every pack is stored (the sink appends to chunks meanwhile).
	var movedMu sync.Mutex
	var moved []movedFrame
	seal := func() {
		if len(pack) == 0 {
			return
		}
		data := pack
		desc := ocispec.Descriptor{MediaType: MediaTypePack, Digest: digest.FromBytes(data), Size: int64(len(data))}
		sealed := make([]movedFrame, len(members))
		for k, i := range members {
			chunks[i].Blob, chunks[i].PackSize = desc.Digest, desc.Size
			sealed[k] = movedFrame{entry: i, chunk: chunks[i]}
		}
		uploads.Go(func() error {
			m, err := p.storePack(uctx, desc, data, sealed)
			// Nothing holds data once storePack returned: the push
			// read it, and a composed pack's rest is a copy.
			p.packs.Put(&data)
			if err != nil {
				return fmt.Errorf("store pack %s: %w", desc.Digest, err)
			}
			movedMu.Lock()
			moved = append(moved, m...)
			movedMu.Unlock()
			return nil
		})
		pack, members = newPack(), nil
	}
	produce := p.chunkJobs(ck, f.path)
	work := func(ctx context.Context, j packJob) (v2Result, error) {
		res, err := p.identifyV2(ctx, *j.buf)
		res.buf, res.chunk.Offset = j.buf, j.offset
		return res, err
	}
	sink := func(r v2Result) error {
		fileHash.Write(*r.buf)
		size += int64(len(*r.buf))
		c := r.chunk
		if r.frame != nil {
			if j, ok := first[c.Digest]; ok {
				dups = append(dups, [2]int{len(chunks), j})
			} else {
				if len(pack) > 0 && len(pack)+len(r.frame) > p.opts.PackSize {
					seal()
				}
				c.PackOffset = int64(len(pack))
				pack = append(pack, r.frame...)
				members = append(members, len(chunks))
				first[c.Digest] = len(chunks)
			}
		}
		p.bufs.Put(r.buf)
		if r.zbuf != nil {
			p.bufs.Put(r.zbuf)
		}
		chunks = append(chunks, c)
		p.done(c, false)
		return nil
	}
	err = ordered.Map(ctx, p.opts.Concurrency, 2*p.opts.Concurrency+2, produce, work, sink)
	if err == nil {
		seal()
	}
	// The open pack (empty after the last seal) goes back for the next
	// file: a snapshot of many small files would otherwise allocate a
	// pack's buffer for each.
	p.packs.Put(&pack)
	if uerr := uploads.Wait(); err == nil {
		err = uerr
	}
	if err != nil {
		return nil, 0, fmt.Errorf("pack %s: %w", f.path, err)
	}
	for _, m := range moved {
		chunks[m.entry] = m.chunk
	}
	for _, d := range dups {
		off := chunks[d[0]].Offset
		chunks[d[0]] = chunks[d[1]]
		chunks[d[0]].Offset = off
	}
	p.mu.Lock()
	p.stats.LogicalBytes += size
	seen := map[digest.Digest]bool{}
	for _, c := range chunks {
		p.stats.Chunks[c.Encoding]++
		if c.Encoding == EncodingZero || seen[c.Digest] {
			continue
		}
		seen[c.Digest] = true
		if !p.chunkSeen[c.Digest] {
			p.chunkSeen[c.Digest] = true
			p.stats.StoredBytes += c.BlobSize
			if !p.newChunk[c.Digest] {
				p.stats.ReusedBytes += c.BlobSize
			}
		}
	}
	p.mu.Unlock()
	descs, err := p.pushParts(ctx, f, size, digest.NewDigestFromBytes(digest.SHA256, fileHash.Sum(nil)), chunks)
	return descs, size, err
}

// movedFrame is a table entry of a sealed pack's chunk: where its frame
// lies once the pack is stored.
type movedFrame struct {
	entry int
	chunk Chunk
}

// storePack stores the sealed pack desc (data), whose chunks' entries are
// members, unless the destination has it. With a composer, the destination
// is first asked to compose it; the chunks it composed are moved to its
// pack, and the others into a smaller pack of their frames, uploaded. It
// returns the entries that moved.
func (p *packer) storePack(ctx context.Context, desc ocispec.Descriptor, data []byte, members []movedFrame) ([]movedFrame, error) {
	if p.opts.Composer == nil {
		uploaded, err := p.pushIfMissing(ctx, desc, data)
		p.count(uploaded, desc.Size)
		return nil, err
	}
	if ok, err := p.dst.Exists(ctx, desc); err != nil || ok {
		if ok {
			p.count(false, desc.Size)
		}
		return nil, err
	}
	want := make([]Chunk, len(members))
	for k, m := range members {
		want[k] = m.chunk
	}
	got, err := p.opts.Composer.ComposePack(ctx, want, desc.Size)
	if err != nil {
		return nil, fmt.Errorf("compose: %w", err)
	}
	var moved, rest []movedFrame
	composed := map[digest.Digest]int64{}
	restSize := int64(0)
	for _, m := range members {
		c := m.chunk
		g, ok := got[c.Digest]
		if ok {
			g.Offset, g.Size, g.Digest = c.Offset, c.Size, c.Digest
			if g.Packed() && g.validateEncoding() == nil {
				moved = append(moved, movedFrame{entry: m.entry, chunk: g})
				composed[g.Blob] += g.BlobSize
				continue
			}
		}
		rest = append(rest, m)
		restSize += c.BlobSize
	}
	if len(moved) == 0 {
		// dst lacked the pack a moment ago: no second HEAD. The pack is
		// uploaded as it is, never copied (a second snapshot's packs are
		// mostly of this kind, and on a machine that takes freed memory
		// back, growing a copy cost 13% of a pause's CPU).
		uploaded, err := p.push(ctx, desc, data)
		p.count(uploaded, desc.Size)
		return nil, err
	}
	// The frames not composed go, in the same order, into a pack of their
	// own, allocated once at its final size.
	restData := make([]byte, 0, restSize)
	for k, m := range rest {
		c := m.chunk
		frame := data[c.PackOffset : c.PackOffset+c.BlobSize]
		c.PackOffset = int64(len(restData))
		restData = append(restData, frame...)
		rest[k].chunk = c
	}
	p.mu.Lock()
	for _, n := range composed {
		p.stats.PacksComposed++
		p.stats.ComposedBytes += n
	}
	p.mu.Unlock()
	if len(rest) > 0 {
		rdesc := ocispec.Descriptor{MediaType: MediaTypePack, Digest: digest.FromBytes(restData), Size: int64(len(restData))}
		uploaded, err := p.pushIfMissing(ctx, rdesc, restData)
		if err != nil {
			return nil, err
		}
		p.count(uploaded, rdesc.Size)
		for _, r := range rest {
			r.chunk.Blob, r.chunk.PackSize = rdesc.Digest, rdesc.Size
			moved = append(moved, r)
		}
	}
	return moved, nil
}

// identifyV2 hashes data and, unless it is zero or the resolver knows a
// frame of it, compresses it: the result's frame is then what a new pack
// will hold.
func (p *packer) identifyV2(ctx context.Context, data []byte) (v2Result, error) {
	c := p.codec.Identify(data)
	if c.Encoding == EncodingZero {
		return v2Result{chunk: c}, nil
	}
	if p.opts.Resolver != nil {
		rc, ok, err := p.opts.Resolver.ResolveChunk(ctx, c)
		if err != nil {
			return v2Result{chunk: c}, fmt.Errorf("resolve chunk %s: %w", c.Digest, err)
		}
		// A resolver may only name frames of packs (v1 blobs are not
		// referenced from v2 tables).
		if ok && rc.Packed() {
			rc.Offset, rc.Size, rc.Digest = c.Offset, c.Size, c.Digest
			if err := rc.validateEncoding(); err != nil {
				return v2Result{chunk: c}, fmt.Errorf("resolver's frame for chunk %s: %w", c.Digest, err)
			}
			return v2Result{chunk: rc}, nil
		}
	}
	zbuf := p.bufs.Get().(*[]byte)
	c, frame := p.codec.CompressFrame(c, data, *zbuf)
	p.mu.Lock()
	p.newChunk[c.Digest] = true
	p.mu.Unlock()
	if c.Encoding == EncodingRaw {
		// The frame is the chunk's bytes, which the sink copies into the
		// pack before it recycles them.
		p.bufs.Put(zbuf)
		zbuf = nil
	}
	return v2Result{chunk: c, frame: frame, zbuf: zbuf}, nil
}

// TableResolver resolves chunks to the frames where tables already loaded
// hold them: the tables of an earlier v2 snapshot of the same repository,
// whose packs a new snapshot there may reference at no cost. It is the
// resolver `cryo push --base` and `cryo checkpoint --base` use.
type TableResolver struct {
	frames map[digest.Digest]Chunk
}

// DefaultMinPackLive is the share of a pack's bytes the base's chunks must
// use for a new snapshot to reuse frames from it (SPEC.md 15.5): chunks in
// packs that are mostly other, older snapshots' memory are stored anew, so
// that deleting old snapshots of a chain frees most of their bytes.
const DefaultMinPackLive = 0.5

// NewTableResolver indexes the packed chunks of tables, reusing frames of
// packs the tables use at least DefaultMinPackLive of.
func NewTableResolver(tables []*Table) *TableResolver {
	return NewTableResolverLive(tables, DefaultMinPackLive)
}

// NewTableResolverLive is NewTableResolver reusing frames of packs the
// tables use at least minLive (0..1) of.
func NewTableResolverLive(tables []*Table, minLive float64) *TableResolver {
	r := &TableResolver{frames: map[digest.Digest]Chunk{}}
	used := map[digest.Digest]int64{}
	type frame struct {
		pack digest.Digest
		off  int64
	}
	seen := map[frame]bool{}
	for _, t := range tables {
		for _, c := range t.Chunks {
			if !c.Packed() {
				continue
			}
			if k := (frame{c.Blob, c.PackOffset}); !seen[k] {
				seen[k] = true
				used[c.Blob] += c.BlobSize
			}
		}
	}
	for _, t := range tables {
		for _, c := range t.Chunks {
			if c.Packed() && float64(used[c.Blob]) >= minLive*float64(c.PackSize) {
				r.frames[c.Digest] = c
			}
		}
	}
	return r
}

// Len is the number of distinct chunks the resolver knows.
func (r *TableResolver) Len() int { return len(r.frames) }

// ResolveChunk returns the frame holding c, if a table had one of its size.
func (r *TableResolver) ResolveChunk(_ context.Context, c Chunk) (Chunk, bool, error) {
	f, ok := r.frames[c.Digest]
	if !ok || f.Size != c.Size {
		return c, false, nil
	}
	return f, true, nil
}
