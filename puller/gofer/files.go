package gofer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cryo-oci/cryo/puller/cache"
	"github.com/cryo-oci/cryo/puller/fetch"
	"github.com/opencontainers/go-digest"
	"golang.org/x/sys/unix"
)

// The file API, served on a cryo process's unix socket:
//
//	GET  /v1/mounts/{id}/files/{path}   Range: bytes=A-B   -> 206, the bytes
//	HEAD /v1/mounts/{id}/files/{path}                      -> 200, Content-Length
//
// Every response carries SnapshotHeader, the mount's index digest. A
// request says in PriorityHeader whether a sandbox waits on it ("fault")
// or it is the background sweep ("read", the default). A GET's bytes are
// written only once all of them are read and verified: a response cut
// short is a connection lost, never a wrong byte.
//
// A GET with "Cryo-Place: accept" (PlaceHeader) may be answered in place
// instead: 204, Content-Range as a 206's, and "Cryo-Place: DEV:INO:PATH",
// when the mount's verified bytes of the whole range lie at the same
// offsets in the node store's file PATH (escaped as a URL path), whose
// device and inode numbers are DEV and INO (Placer). The client then
// reads them from that file itself: one copy of each byte, not three (the
// server's read, its socket write, the client's socket read). Only a
// client that may open the node store's files (root, on the node) asks.
//
// A HEAD answer carries in RoundTripHeader how near the mount's registry
// is (LinkReporter), for the gofer to choose the size of the reads it
// offers the sentry.
const (
	SnapshotHeader  = "Cryo-Snapshot"
	PriorityHeader  = "Cryo-Priority"
	PlaceHeader     = "Cryo-Place"
	RoundTripHeader = "Cryo-Round-Trip"
)

// MaxRange bounds the bytes one GET asks for: what the server holds in
// memory for a request.
const MaxRange = 16 << 20

// MaxRequestsPerMount bounds the GETs of one mount served at once (a
// gofer makes at most 48: 32 of pages.img, 16 of another file); more
// wait for a turn. With MaxRange it bounds the
// memory one mount's readers can make the server hold.
const MaxRequestsPerMount = 48

// Files is a mounted snapshot's files as a presenter reads them
// (puller.Mount implements it).
type Files interface {
	// FileSize returns the size of the file at path, if the snapshot has
	// one.
	FileSize(path string) (int64, bool)
	// ReadAt fills p with the file's verified bytes at off (within the
	// file), fetched at priority prio if not local.
	ReadAt(ctx context.Context, path string, p []byte, off int64, prio fetch.Priority) error
}

// Placer is implemented by Files that can say where a range's verified
// bytes lie in place in the node store (puller.Mount does): the file
// holds them at the same offsets and, once they are there, never changes
// them. A range found counts as read at prio; one not found (ok false)
// counts as nothing.
type Placer interface {
	Place(ctx context.Context, path string, off, n int64, prio fetch.Priority) (in cache.InPlace, ok bool)
}

// LinkReporter is implemented by Files and Sources that know how near
// the snapshot's registry is (puller.Mount does): LinkRoundTrip is the
// shortest time one of the mount's own requests for chunks took, an upper
// bound of the round trip (fetch.Scheduler.RoundTrip); 0 before any was
// measured.
type LinkReporter interface {
	LinkRoundTrip() time.Duration
}

// Lookup finds the files of a mount by id, and the mount's index digest.
type Lookup func(id string) (Files, digest.Digest, bool)

// RegisterFiles adds the file API to mux.
func RegisterFiles(mux *http.ServeMux, lookup Lookup) {
	// Buffers of the usual read's size (the gofer reads 1 MiB at a time)
	// are used again, not allocated per request.
	bufs := &sync.Pool{New: func() any { b := make([]byte, 0, 1<<20); return &b }}
	turns := &turns{byMount: map[string]*mountTurns{}}
	h := func(w http.ResponseWriter, r *http.Request) { serveFile(w, r, lookup, bufs, turns) }
	mux.HandleFunc("GET /v1/mounts/{id}/files/{path...}", h)
	mux.HandleFunc("HEAD /v1/mounts/{id}/files/{path...}", h)
}

// turns bounds the requests served at once per mount id.
type turns struct {
	mu      sync.Mutex
	byMount map[string]*mountTurns
	// lookedUp, if set, is called by take between looking the mount
	// up and waiting for a turn (tests).
	lookedUp func(*mountTurns)
}

// mountTurns are one mount's turns, and how many requests hold or wait
// for one: the mount's entry stays while any does, so that all of them
// share one set of turns.
type mountTurns struct {
	c     chan struct{}
	users int
}

// take waits for a turn of mount id (nil if ctx ends first); give the
// turn back with give.
func (t *turns) take(ctx context.Context, id string) *mountTurns {
	t.mu.Lock()
	m, ok := t.byMount[id]
	if !ok {
		m = &mountTurns{c: make(chan struct{}, MaxRequestsPerMount)}
		t.byMount[id] = m
	}
	m.users++
	t.mu.Unlock()
	if t.lookedUp != nil {
		t.lookedUp(m)
	}
	select {
	case m.c <- struct{}{}:
		return m
	case <-ctx.Done():
		t.leave(id, m)
		return nil
	}
}

// give returns a turn taken from m.
func (t *turns) give(id string, m *mountTurns) {
	<-m.c
	t.leave(id, m)
}

// leave counts a request of m out, dropping the mount's entry with the
// last.
func (t *turns) leave(id string, m *mountTurns) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if m.users--; m.users == 0 {
		delete(t.byMount, id)
	}
}

func serveFile(w http.ResponseWriter, r *http.Request, lookup Lookup, bufs *sync.Pool, turns *turns) {
	files, d, ok := lookup(r.PathValue("id"))
	if !ok {
		http.Error(w, "no mount "+r.PathValue("id"), http.StatusNotFound)
		return
	}
	w.Header().Set(SnapshotHeader, d.String())
	path := r.PathValue("path")
	size, ok := files.FileSize(path)
	if !ok {
		http.Error(w, fmt.Sprintf("snapshot %s has no file %q", d, path), http.StatusNotFound)
		return
	}
	if r.Method == http.MethodHead {
		if lr, ok := files.(LinkReporter); ok {
			if rtt := lr.LinkRoundTrip().Microseconds(); rtt > 0 {
				w.Header().Set(RoundTripHeader, strconv.FormatInt(rtt, 10))
			}
		}
		w.Header().Set("Content-Length", strconv.FormatInt(size, 10))
		w.WriteHeader(http.StatusOK)
		return
	}
	start, end, err := parseRange(r.Header.Get("Range"), size)
	if err != nil {
		w.Header().Set("Content-Range", "bytes */"+strconv.FormatInt(size, 10))
		http.Error(w, err.Error(), http.StatusRequestedRangeNotSatisfiable)
		return
	}
	prio := fetch.Read
	switch p := r.Header.Get(PriorityHeader); p {
	case "", "read":
	case "fault":
		prio = fetch.Fault
	default:
		http.Error(w, fmt.Sprintf("%s %q: want fault or read", PriorityHeader, p), http.StatusBadRequest)
		return
	}
	if pl, ok := files.(Placer); ok && r.Header.Get(PlaceHeader) == "accept" {
		if in, ok := pl.Place(r.Context(), path, start, end-start, prio); ok {
			w.Header().Set(PlaceHeader, fmt.Sprintf("%d:%d:%s", in.Dev, in.Ino, (&url.URL{Path: in.Path}).EscapedPath()))
			w.Header().Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", start, end-1, size))
			w.WriteHeader(http.StatusNoContent)
			return
		}
	}
	id := r.PathValue("id")
	turn := turns.take(r.Context(), id)
	if turn == nil {
		return // the client went away
	}
	defer turns.give(id, turn)
	bp := bufs.Get().(*[]byte)
	defer bufs.Put(bp)
	if int64(cap(*bp)) < end-start {
		*bp = make([]byte, end-start)
	}
	buf := (*bp)[:end-start]
	// A sandbox's read must not fail because its reader went away and came
	// back: the fetch scheduler's deadline bounds the wait, not the request.
	if err := files.ReadAt(context.WithoutCancel(r.Context()), path, buf, start, prio); err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	w.Header().Set("Content-Length", strconv.Itoa(len(buf)))
	w.Header().Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", start, end-1, size))
	w.WriteHeader(http.StatusPartialContent)
	w.Write(buf)
}

// parseRange parses "bytes=A-B" (one range, both ends given) against a
// file of size bytes, clipping B to the file's end, and returns [A, B+1).
func parseRange(h string, size int64) (start, end int64, err error) {
	spec, ok := strings.CutPrefix(h, "bytes=")
	a, b, ok2 := strings.Cut(spec, "-")
	if !ok || !ok2 {
		return 0, 0, fmt.Errorf("range %q: want bytes=START-END", h)
	}
	start, err1 := strconv.ParseInt(a, 10, 64)
	last, err2 := strconv.ParseInt(b, 10, 64)
	if err1 != nil || err2 != nil || start < 0 || last < start {
		return 0, 0, fmt.Errorf("range %q: want bytes=START-END", h)
	}
	if start >= size {
		return 0, 0, fmt.Errorf("range %q starts past the file's %d bytes", h, size)
	}
	end = min(last, size-1) + 1 // last+1 would wrap at the largest int64
	if end-start > MaxRange {
		return 0, 0, fmt.Errorf("range %q is over %d bytes", h, MaxRange)
	}
	return start, end, nil
}

// Client reads a mount's files over the file API. It is safe for
// concurrent use.
type Client struct {
	http     *http.Client
	socket   string
	id       string
	base     string
	index    digest.Digest
	deadline time.Duration
	// Logf, if set, gets a line per retried request.
	Logf func(format string, args ...any)
	// InPlace, if set before the first read, lets ReadAt read a range
	// the server answers in place (PlaceHeader) from the node store's
	// file itself. Only a client that may open those files sets it.
	InPlace bool

	mu    sync.Mutex
	sizes map[string]int64
	// rtt is the RoundTripHeader of the latest HEAD answer that had one.
	rtt time.Duration
	// places are the node store's files opened for in-place answers, by
	// device and inode.
	places map[[2]uint64]*os.File
	// placed counts the bytes read in place; placeFailures the in-place
	// answers in a row that could not be read; noPlace is set once the
	// client stops asking for them. closed (under mu) is set by Close.
	placed        atomic.Int64
	placeFailures atomic.Int64
	noPlace       atomic.Bool
	closed        bool
}

// LinkRoundTrip implements LinkReporter: the round trip the server gave
// in the latest answer to Size that had one, 0 if none did (a server that
// measured nothing yet, or one that does not say).
func (c *Client) LinkRoundTrip() time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.rtt
}

// PlacedBytes returns how many bytes ReadAt read in place (InPlace).
func (c *Client) PlacedBytes() int64 { return c.placed.Load() }

// maxPlaces bounds the files a Client keeps open for in-place answers (a
// mount has one per lazy file while it is assembled, then one in its
// materialized dir); past it, a file is opened for one read. A file kept
// open holds its disk space until Close, also once the node store
// removed it (an assembly given up): a gofer's client lives one restore.
const maxPlaces = 16

// DefaultDeadline is how long Client.ReadAt keeps trying a range before it
// fails it (a failed read kills the sandbox): as long as the puller's own
// fetch deadline.
const DefaultDeadline = 5 * time.Minute

// NewClient returns a Client of mount (or checkpoint session) id on the
// unix socket, that reads snapshot index only. deadline bounds each
// read's retries (0: DefaultDeadline).
func NewClient(socket, id string, index digest.Digest, deadline time.Duration) *Client {
	if deadline <= 0 {
		deadline = DefaultDeadline
	}
	tr := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", socket)
		},
		MaxIdleConnsPerHost: 256,
		DisableCompression:  true,
	}
	return &Client{
		http:     &http.Client{Transport: tr},
		socket:   socket,
		id:       id,
		base:     "http://cryo/v1/mounts/" + url.PathEscape(id) + "/files/",
		index:    index,
		deadline: deadline,
		sizes:    map[string]int64{},
	}
}

// Close closes idle connections and the files opened for in-place
// answers.
func (c *Client) Close() {
	c.http.CloseIdleConnections()
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = true
	for k, f := range c.places {
		f.Close()
		delete(c.places, k)
	}
}

// Size returns the size of the snapshot's file path, retrying lost
// connections until the deadline; os.ErrNotExist if the snapshot has no
// such file. It fails at once if the mount serves another snapshot than
// the client's.
func (c *Client) Size(ctx context.Context, path string) (int64, error) {
	c.mu.Lock()
	n, ok := c.sizes[path]
	c.mu.Unlock()
	if ok {
		return n, nil
	}
	var size int64
	err := c.retry(ctx, path, func() (bool, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodHead, c.base+path, nil)
		if err != nil {
			return false, err
		}
		resp, err := c.http.Do(req)
		if err != nil {
			return true, err
		}
		resp.Body.Close()
		if err := c.check(resp, http.StatusOK); err != nil {
			return resp.StatusCode >= 500 && !errors.Is(err, ErrOtherSnapshot), err
		}
		size = resp.ContentLength
		if us, err := strconv.ParseInt(resp.Header.Get(RoundTripHeader), 10, 64); err == nil && us > 0 && us < int64(time.Hour/time.Microsecond) {
			c.mu.Lock()
			c.rtt = time.Duration(us) * time.Microsecond
			c.mu.Unlock()
		}
		return false, nil
	})
	if err != nil {
		return 0, err
	}
	c.mu.Lock()
	c.sizes[path] = size
	c.mu.Unlock()
	return size, nil
}

// ReadAt fills dsts, one after the other, with the file's bytes from off
// on, which must lie within the file, in one request. A lost connection or
// a server error is retried, from the first byte not yet read, until the
// client's deadline: bytes arrive only once the server verified them, so
// what is read is kept.
func (c *Client) ReadAt(ctx context.Context, path string, dsts [][]byte, off int64, prio fetch.Priority) error {
	// Pieces of at most MaxRange bytes, none empty.
	var rest [][]byte
	for _, d := range dsts {
		for len(d) > 0 {
			k := min(len(d), MaxRange)
			rest = append(rest, d[:k])
			d = d[k:]
		}
	}
	return c.retry(ctx, path, func() (bool, error) {
		for len(rest) > 0 {
			var batch [][]byte
			n := 0
			for _, d := range rest {
				if n > 0 && n+len(d) > MaxRange {
					break
				}
				batch = append(batch, d)
				n += len(d)
			}
			got, retry, err := c.get(ctx, path, batch, off, prio)
			off += int64(got)
			// Drop what was read: whole dsts, and the start of the next.
			for got > 0 {
				if got >= len(rest[0]) {
					got -= len(rest[0])
					rest = rest[1:]
					continue
				}
				rest[0] = rest[0][got:] // rest is ReadAt's own slice
				got = 0
			}
			if err != nil {
				return retry, err
			}
		}
		return false, nil
	})
}

// Source is what a gofer reads a snapshot's files from: a cryo process's
// file API (Client), or a mount in the gofer's own process (Local).
type Source interface {
	// Size returns the size of the file at path (os.ErrNotExist if the
	// snapshot has none).
	Size(ctx context.Context, path string) (int64, error)
	// ReadAt fills dsts, one after the other, with the file's verified
	// bytes from off on, within the file.
	ReadAt(ctx context.Context, path string, dsts [][]byte, off int64, prio fetch.Priority) error
}

var (
	_ Source       = (*Client)(nil)
	_ Source       = local{}
	_ LinkReporter = (*Client)(nil)
	_ LinkReporter = local{}
)

// Local returns the Source of files in this process.
func Local(f Files) Source { return local{f} }

type local struct{ f Files }

// LinkRoundTrip implements LinkReporter with the files' own, if they
// know it.
func (l local) LinkRoundTrip() time.Duration {
	if lr, ok := l.f.(LinkReporter); ok {
		return lr.LinkRoundTrip()
	}
	return 0
}

func (l local) Size(ctx context.Context, path string) (int64, error) {
	if n, ok := l.f.FileSize(path); ok {
		return n, nil
	}
	return 0, fmt.Errorf("%s: %w", path, os.ErrNotExist)
}

func (l local) ReadAt(ctx context.Context, path string, dsts [][]byte, off int64, prio fetch.Priority) error {
	for _, d := range dsts {
		if err := l.f.ReadAt(ctx, path, d, off, prio); err != nil {
			return err
		}
		off += int64(len(d))
	}
	return nil
}

// get reads the file from off into dsts, one after the other, with one
// GET; it returns how many bytes it read and whether an error is worth
// retrying.
func (c *Client) get(ctx context.Context, path string, dsts [][]byte, off int64, prio fetch.Priority) (int, bool, error) {
	n, retry, err := c.getAt(ctx, path, dsts, off, prio, c.InPlace && !c.noPlace.Load())
	if errors.Is(err, errPlace) {
		// The in-place answer could not be read: the same range through
		// the socket; and every range so, from now on, if this process
		// may not open the node store's files or failed maxPlaceFailures
		// times in a row.
		failed := c.placeFailures.Add(1)
		if errors.Is(err, fs.ErrPermission) || failed >= maxPlaceFailures {
			c.noPlace.Store(true)
		}
		if c.Logf != nil {
			c.Logf("%s: %v; reading through the socket", path, err)
			if c.noPlace.Load() {
				c.Logf("%s: no more in-place reads: %d failed in a row", path, failed)
			}
		}
		return c.getAt(ctx, path, dsts, off, prio, false)
	}
	return n, retry, err
}

// maxPlaceFailures is how many in-place answers in a row a Client may
// fail to read before it stops asking for them (a gofer that cannot see
// the node store's files: another mount namespace).
const maxPlaceFailures = 8

// errPlace is an in-place answer that could not be read from its file.
var errPlace = errors.New("in-place answer unreadable")

// getAt is get, accepting an in-place answer if inPlace is set.
func (c *Client) getAt(ctx context.Context, path string, dsts [][]byte, off int64, prio fetch.Priority, inPlace bool) (int, bool, error) {
	total := 0
	for _, d := range dsts {
		total += len(d)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.base+path, nil)
	if err != nil {
		return 0, false, err
	}
	req.Header.Set("Range", fmt.Sprintf("bytes=%d-%d", off, off+int64(total)-1))
	if prio == fetch.Fault {
		req.Header.Set(PriorityHeader, "fault")
	}
	if inPlace {
		req.Header.Set(PlaceHeader, "accept")
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return 0, true, err
	}
	defer resp.Body.Close()
	if inPlace && resp.StatusCode == http.StatusNoContent {
		if err := c.check(resp, http.StatusNoContent); err != nil {
			if errors.Is(err, ErrOtherSnapshot) {
				return 0, false, err
			}
			return 0, false, fmt.Errorf("%s at %d: %w: %w", path, off, errPlace, err)
		}
		want := fmt.Sprintf("bytes %d-%d/", off, off+int64(total)-1)
		if cr := resp.Header.Get("Content-Range"); !strings.HasPrefix(cr, want) {
			return 0, false, fmt.Errorf("%s: %w: %d bytes at %d asked, %q answered", path, errPlace, total, off, cr)
		}
		if err := c.readPlace(resp.Header.Get(PlaceHeader), dsts, off); err != nil {
			return 0, false, fmt.Errorf("%s at %d: %w: %w", path, off, errPlace, err)
		}
		c.placed.Add(int64(total))
		c.placeFailures.Store(0)
		return total, false, nil
	}
	if err := c.check(resp, http.StatusPartialContent); err != nil {
		return 0, resp.StatusCode >= 500 && !errors.Is(err, ErrOtherSnapshot), err
	}
	if resp.ContentLength != int64(total) {
		return 0, false, fmt.Errorf("%s: %d bytes at %d asked, %d answered", path, total, off, resp.ContentLength)
	}
	n := 0
	for _, d := range dsts {
		m, err := io.ReadFull(resp.Body, d)
		n += m
		if err != nil {
			return n, true, fmt.Errorf("%s at %d: %w", path, off+int64(n), err)
		}
	}
	return n, false, nil
}

// readPlace reads dsts, one after the other, from off on in the file an
// in-place answer names ("DEV:INO:PATH"), opened once and kept: the file
// at PATH only if its device and inode numbers are DEV and INO (a file
// renamed or replaced since the answer is refused).
func (c *Client) readPlace(place string, dsts [][]byte, off int64) error {
	devS, rest, ok1 := strings.Cut(place, ":")
	inoS, escaped, ok2 := strings.Cut(rest, ":")
	dev, err1 := strconv.ParseUint(devS, 10, 64)
	ino, err2 := strconv.ParseUint(inoS, 10, 64)
	name, err3 := url.PathUnescape(escaped)
	if !ok1 || !ok2 || err1 != nil || err2 != nil || err3 != nil || !strings.HasPrefix(name, "/") {
		return fmt.Errorf("%s %q: want DEV:INO:/PATH", PlaceHeader, place)
	}
	key := [2]uint64{dev, ino}
	c.mu.Lock()
	f := c.places[key]
	c.mu.Unlock()
	if f == nil {
		var err error
		if f, err = openPlace(name, dev, ino); err != nil {
			return err
		}
		c.mu.Lock()
		switch {
		case c.places[key] != nil: // opened meanwhile by another read
			f.Close()
			f = c.places[key]
		case len(c.places) < maxPlaces && !c.closed:
			if c.places == nil {
				c.places = map[[2]uint64]*os.File{}
			}
			c.places[key] = f
		default:
			defer f.Close()
		}
		c.mu.Unlock()
	}
	for _, d := range dsts {
		if _, err := f.ReadAt(d, off); err != nil {
			return err
		}
		off += int64(len(d))
	}
	return nil
}

// openPlace opens the file name for reading if it is a regular file with
// device and inode numbers dev and ino.
func openPlace(name string, dev, ino uint64) (*os.File, error) {
	f, err := os.OpenFile(name, os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return nil, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		f.Close()
		return nil, err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || uint64(st.Dev) != dev || st.Ino != ino {
		f.Close()
		return nil, fmt.Errorf("%s is not the file answered (device %d, inode %d)", name, dev, ino)
	}
	return f, nil
}

// ErrOtherSnapshot is the error of a mount that serves another snapshot
// than the client's; it is never retried.
var ErrOtherSnapshot = errors.New("the mount serves another snapshot")

// check refuses a response of the wrong status or of another snapshot.
func (c *Client) check(resp *http.Response, want int) error {
	if got := resp.Header.Get(SnapshotHeader); got != "" && got != c.index.String() {
		return fmt.Errorf("%w: %s, the gofer's config names %s", ErrOtherSnapshot, got, c.index)
	}
	if resp.StatusCode == http.StatusNotFound && resp.Header.Get(SnapshotHeader) != "" {
		return os.ErrNotExist
	}
	if resp.StatusCode != want {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return fmt.Errorf("file API: %s: %s", resp.Status, strings.TrimSpace(string(msg)))
	}
	if resp.Header.Get(SnapshotHeader) == "" {
		return fmt.Errorf("file API: response without %s", SnapshotHeader)
	}
	return nil
}

// retry runs op until it succeeds, fails for good (retry false), or the
// deadline passes, backing off between tries.
func (c *Client) retry(ctx context.Context, path string, op func() (retry bool, err error)) error {
	give := time.Now().Add(c.deadline)
	wait := 20 * time.Millisecond
	for try := 1; ; try++ {
		retry, err := op()
		if err == nil {
			return nil
		}
		if !retry || time.Now().Add(wait).After(give) || ctx.Err() != nil {
			return err
		}
		if c.Logf != nil {
			c.Logf("%s: try %d failed, again in %s: %v", path, try, wait, err)
		}
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return errors.Join(err, ctx.Err())
		}
		wait = min(2*wait, 2*time.Second)
	}
}
