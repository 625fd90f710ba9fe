package gofer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"
)

// The upload API, served on a cryo process's unix socket while it
// checkpoints a sandbox:
//
//	PUT /v1/checkpoints/{id}/files/{path}   the file's bytes -> 201 {"size": N}
//
// The 201 comes once the file is read to its end and packed (every chunk
// hashed and stored); an error status, or a connection cut, means the
// file is not in the snapshot, and the checkpoint fails. A file the
// session will not take at all (ErrRefused) is answered 409 before its
// body is read; other failures 502. (A reference upload, RefsProtocol,
// gets the same errors as an X frame after its 101.)

// Sink is where a checkpoint's files go (transfer.Pusher implements it).
// A Sink whose session can end while files are still being written
// (checkpoint.Triggered) also has a Done() <-chan struct{}, closed then:
// the upload API cuts the uploads still being read (their reads fail at
// once), so that a writer that stalls does not hold the Sink.
type Sink interface {
	AddFile(ctx context.Context, path string, mode fs.FileMode, r io.Reader) (int64, error)
}

// cutWhenDone calls cut once sink's session ends (if it can), unless stop
// was called first. A session over already refuses the file unread: its
// answer is not cut.
func cutWhenDone(sink Sink, cut func()) (stop func()) {
	e, ok := sink.(interface{ Done() <-chan struct{} })
	if !ok {
		return func() {}
	}
	select {
	case <-e.Done():
		return func() {}
	default:
	}
	finished := make(chan struct{})
	go func() {
		select {
		case <-e.Done():
			cut()
		case <-finished:
		}
	}()
	return func() { close(finished) }
}

// ErrRefused is wrapped by a Sink's error for a file it does not take (one
// that is not of its checkpoint, or came twice, or too late), as opposed
// to one that failed while it was packed.
var ErrRefused = errors.New("file refused")

// SinkLookup finds a checkpoint session's sink by id.
type SinkLookup func(id string) (Sink, bool)

// FileMode is the mode a checkpoint's files are recorded with: what runsc
// gives the files it writes to a local image dir.
const FileMode fs.FileMode = 0o644

// RegisterUploads adds the upload API to mux: plain uploads (the file's
// bytes as the body) and reference uploads (RefsProtocol).
func RegisterUploads(mux *http.ServeMux, lookup SinkLookup) {
	mux.HandleFunc("PUT /v1/checkpoints/{id}/refs/{path...}", func(w http.ResponseWriter, r *http.Request) {
		sink, ok := lookup(r.PathValue("id"))
		if !ok {
			http.Error(w, "no checkpoint "+r.PathValue("id"), http.StatusNotFound)
			return
		}
		if r.Header.Get("Upgrade") != RefsProtocol || r.ContentLength != 0 {
			http.Error(w, "a reference upload is an upgrade to "+RefsProtocol+" without a body", http.StatusBadRequest)
			return
		}
		hj, ok := w.(http.Hijacker)
		if !ok {
			http.Error(w, "reference uploads need HTTP/1.1", http.StatusBadRequest)
			return
		}
		conn, rw, err := hj.Hijack()
		if err != nil {
			return
		}
		uc, ok := conn.(*net.UnixConn)
		if !ok || rw.Reader.Buffered() > 0 {
			// Frames only follow the 101; fds only cross a unix socket.
			conn.Close()
			return
		}
		serveRefs(r.Context(), uc, sink, r.PathValue("path"))
	})
	mux.HandleFunc("PUT /v1/checkpoints/{id}/files/{path...}", func(w http.ResponseWriter, r *http.Request) {
		sink, ok := lookup(r.PathValue("id"))
		if !ok {
			http.Error(w, "no checkpoint "+r.PathValue("id"), http.StatusNotFound)
			return
		}
		rc := http.NewResponseController(w)
		stop := cutWhenDone(sink, func() { rc.SetReadDeadline(time.Now()) })
		n, err := sink.AddFile(r.Context(), r.PathValue("path"), FileMode, r.Body)
		stop()
		if errors.Is(err, ErrRefused) {
			http.Error(w, err.Error(), http.StatusConflict)
			return
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		json.NewEncoder(w).Encode(map[string]int64{"size": n})
	})
}

// Upload is one file streamed to the upload API: Write its bytes in
// order, then Finish. An Upload is not safe for concurrent use.
type Upload struct {
	body *handoff
	done chan struct{}
	err  error
	size int64
	once sync.Once
	// cancel ends the request: a body write blocked on a server that
	// stopped reading fails with it.
	cancel context.CancelFunc
}

// Upload starts streaming the file at path to checkpoint session id.
func (c *Client) Upload(ctx context.Context, path string) *Upload {
	ctx, cancel := context.WithCancel(ctx)
	u := &Upload{body: newHandoff(), done: make(chan struct{}), cancel: cancel}
	go func() {
		defer cancel()
		defer close(u.done)
		u.err = c.put(ctx, path, u.body, &u.size)
		u.body.CloseWithError(fmt.Errorf("upload of %s ended: %w", path, u.errOr()))
	}()
	return u
}

func (u *Upload) errOr() error {
	if u.err != nil {
		return u.err
	}
	return io.ErrClosedPipe
}

// put sends the upload's request and reads the answer.
func (c *Client) put(ctx context.Context, path string, body io.Reader, size *int64) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPut, "http://cryo/v1/checkpoints/"+url.PathEscape(c.id)+"/files/"+path, body)
	if err != nil {
		return err
	}
	req.ContentLength = -1
	resp, err := c.http.Do(req)
	if err != nil {
		return fmt.Errorf("upload %s: %w", path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return fmt.Errorf("upload %s: %s: %s", path, resp.Status, strings.TrimSpace(string(msg)))
	}
	var ans struct {
		Size int64 `json:"size"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&ans); err != nil {
		return fmt.Errorf("upload %s: answer: %w", path, err)
	}
	*size = ans.Size
	return nil
}

// Write streams p; it returns once p is written to the connection.
func (u *Upload) Write(p []byte) (int, error) { return u.body.Write(p) }

// Finish ends the file and waits until the server has packed it; it
// returns the size the server counted.
func (u *Upload) Finish() (int64, error) {
	u.once.Do(func() { u.body.CloseWithError(nil) })
	<-u.done
	return u.size, u.err
}

// Abort ends the upload with err: the server gets a cut stream and drops
// the file. It does not wait for a server that stopped reading.
func (u *Upload) Abort(err error) {
	u.once.Do(func() { u.body.CloseWithError(err) })
	u.cancel()
	<-u.done
}

// handoff is an upload's request body: a synchronous pipe, as io.Pipe,
// whose writes reach the connection whole. io.Pipe's reader has no
// WriteTo, so the transport copies it through io.Copy's 32 KiB buffer:
// each sentry write of 1 MiB went out as 32 chunks of the body, and a
// 1 GiB checkpoint cost 65,536 writes to the socket here and as many
// reads in cryo (BenchmarkUpload: 535 MB/s). handoff's WriteTo writes
// each Write's bytes as they are, as one chunk.
type handoff struct {
	writes chan []byte
	// acks answers each slice taken from writes, once it is written out
	// (the writer may then reuse it) or failed.
	acks chan error
	// closed is closed by CloseWithError, the writer's end: err nil is
	// the end of the body.
	closed    chan struct{}
	closeOnce sync.Once
	err       error
	// gone is closed by Close, the reader's end: the transport is done
	// with the body, and answers no more slices.
	gone     chan struct{}
	goneOnce sync.Once

	cur []byte // what Read has left of the slice it took
}

func newHandoff() *handoff {
	return &handoff{writes: make(chan []byte), acks: make(chan error, 1), closed: make(chan struct{}), gone: make(chan struct{})}
}

// Write hands p to the reader and waits until all of it is written out.
func (h *handoff) Write(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	select {
	case h.writes <- p:
	case <-h.closed:
		if h.err == nil {
			return 0, io.ErrClosedPipe
		}
		return 0, h.err
	case <-h.gone:
		return 0, io.ErrClosedPipe
	}
	// The reader answers a slice it took after its last use of it, or
	// gives up the body.
	select {
	case err := <-h.acks:
		if err != nil {
			return 0, err
		}
		return len(p), nil
	case <-h.gone:
		return 0, io.ErrClosedPipe
	}
}

// CloseWithError ends the body: with err nil, the reader gets io.EOF once
// every write is in; else it gets err.
func (h *handoff) CloseWithError(err error) {
	h.closeOnce.Do(func() { h.err = err; close(h.closed) })
}

// Close implements io.Closer for the transport: a write waiting, and
// writes after it, fail.
func (h *handoff) Close() error {
	h.goneOnce.Do(func() { close(h.gone) })
	return nil
}

// next waits for the next slice; io.EOF at the body's end.
func (h *handoff) next() ([]byte, error) {
	select {
	case p := <-h.writes:
		return p, nil
	case <-h.closed:
		// A Write racing the close loses: it sees closed too.
		if h.err == nil {
			return nil, io.EOF
		}
		return nil, h.err
	}
}

// WriteTo writes each Write's bytes to w in one call, until the body
// ends.
func (h *handoff) WriteTo(w io.Writer) (int64, error) {
	var total int64
	if len(h.cur) > 0 {
		n, err := w.Write(h.cur)
		total += int64(n)
		h.cur = nil
		h.ack(err)
		if err != nil {
			return total, err
		}
	}
	for {
		p, err := h.next()
		if err == io.EOF {
			return total, nil
		}
		if err != nil {
			return total, err
		}
		n, err := w.Write(p)
		total += int64(n)
		h.ack(err)
		if err != nil {
			return total, err
		}
	}
}

// Read implements io.Reader, for readers that do not use WriteTo.
func (h *handoff) Read(b []byte) (int, error) {
	if len(h.cur) == 0 {
		p, err := h.next()
		if err != nil {
			return 0, err
		}
		h.cur = p
	}
	n := copy(b, h.cur)
	h.cur = h.cur[n:]
	if len(h.cur) == 0 {
		h.ack(nil)
	}
	return n, nil
}

// ack answers the slice taken last, unless its writer gave up on the body.
func (h *handoff) ack(err error) {
	select {
	case h.acks <- err:
	case <-h.gone:
	}
}
