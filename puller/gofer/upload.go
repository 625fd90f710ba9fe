package gofer

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/url"
	"strings"
	"sync"
)

// The upload API, served on a cryo process's unix socket while it
// checkpoints a sandbox:
//
//	PUT /v1/checkpoints/{id}/files/{path}   the file's bytes -> 201 {"size": N}
//
// The 201 comes once the file is read to its end and packed (every chunk
// hashed and stored); an error status, or a connection cut, means the
// file is not in the snapshot, and the checkpoint fails.

// Sink is where a checkpoint's files go (transfer.Pusher implements it).
type Sink interface {
	AddFile(ctx context.Context, path string, mode fs.FileMode, r io.Reader) (int64, error)
}

// SinkLookup finds a checkpoint session's sink by id.
type SinkLookup func(id string) (Sink, bool)

// FileMode is the mode a checkpoint's files are recorded with: what runsc
// gives the files it writes to a local image dir.
const FileMode fs.FileMode = 0o644

// RegisterUploads adds the upload API to mux.
func RegisterUploads(mux *http.ServeMux, lookup SinkLookup) {
	mux.HandleFunc("PUT /v1/checkpoints/{id}/files/{path...}", func(w http.ResponseWriter, r *http.Request) {
		sink, ok := lookup(r.PathValue("id"))
		if !ok {
			http.Error(w, "no checkpoint "+r.PathValue("id"), http.StatusNotFound)
			return
		}
		n, err := sink.AddFile(r.Context(), r.PathValue("path"), FileMode, r.Body)
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
	pw   *io.PipeWriter
	done chan struct{}
	err  error
	size int64
	once sync.Once
}

// Upload starts streaming the file at path to checkpoint session id.
func (c *Client) Upload(ctx context.Context, path string) *Upload {
	pr, pw := io.Pipe()
	u := &Upload{pw: pw, done: make(chan struct{})}
	go func() {
		defer close(u.done)
		u.err = c.put(ctx, path, pr, &u.size)
		pr.CloseWithError(fmt.Errorf("upload of %s ended: %w", path, u.errOr()))
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

// Write streams p; it returns once p is handed to the connection.
func (u *Upload) Write(p []byte) (int, error) { return u.pw.Write(p) }

// Finish ends the file and waits until the server has packed it; it
// returns the size the server counted.
func (u *Upload) Finish() (int64, error) {
	u.once.Do(func() { u.pw.Close() })
	<-u.done
	return u.size, u.err
}

// Abort ends the upload with err: the server gets a cut stream and drops
// the file.
func (u *Upload) Abort(err error) {
	u.once.Do(func() { u.pw.CloseWithError(err) })
	<-u.done
}
