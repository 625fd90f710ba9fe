package daemon

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"time"

	"github.com/cryo-oci/cryo/puller/checkpoint"
	"github.com/cryo-oci/cryo/puller/gofer"
)

// Checkpoints the workload triggers (SPEC.md 14.4):
//
//	POST   /v1/checkpoints       {"ref": "host/repo:tag", "filesystem": true}
//	                             -> 201 Checkpoint: "dir" holds only
//	                             gcs_opts.json, for the sandbox's
//	                             dev.gvisor.internal.fscheckpoint.path
//	                             annotation (or, without "filesystem",
//	                             dev.gvisor.internal.checkpoint.path)
//	GET    /v1/checkpoints       -> [Checkpoint]
//	GET    /v1/checkpoints/{id}  -> Checkpoint
//	POST   /v1/checkpoints/{id}/wait -> Checkpoint, once pushed or failed
//	DELETE /v1/checkpoints/{id}  -> 204; one not pushed yet leaves no tag;
//	                             409 while its tag is being pushed
//	PUT    /v1/checkpoints/{id}/files/{path}, .../refs/{path}
//	                             the gofer's upload API (package gofer)

// CheckpointFunc prepares a checkpoint to ref (tagged there once the
// workload has written it), of a filesystem checkpoint's files if
// filesystem is set. An error of the request itself (a ref it cannot
// parse, or cannot push to) wraps ErrInvalidRequest.
type CheckpointFunc func(ctx context.Context, ref string, filesystem bool) (*checkpoint.Triggered, error)

// ErrInvalidRequest marks a CheckpointFunc's error as the request's fault:
// the API answers 400 (other errors, such as a registry that cannot be
// reached, 502).
var ErrInvalidRequest = errors.New("invalid request")

// closeGrace is how long closing the daemon lets a checkpoint whose tag is
// being pushed finish before it is cancelled.
const closeGrace = 30 * time.Second

// Checkpoint is the API's view of a checkpoint the workload triggers.
type Checkpoint struct {
	ID         string    `json:"id"`
	Ref        string    `json:"ref"`
	Dir        string    `json:"dir"`
	Filesystem bool      `json:"filesystem"`
	Created    time.Time `json:"created"`
	checkpoint.TriggeredStatus
}

type checkpointEntry struct {
	view Checkpoint
	t    *checkpoint.Triggered
}

func (c *checkpointEntry) status() Checkpoint {
	v := c.view
	v.TriggeredStatus = c.t.Status()
	return v
}

func (d *Daemon) createCheckpoint(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Ref        string `json:"ref"`
		Filesystem bool   `json:"filesystem"`
	}
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<16)).Decode(&req); err != nil || req.Ref == "" {
		httpError(w, http.StatusBadRequest, "want a JSON body {\"ref\": \"host/repo:tag\", \"filesystem\": true|false}")
		return
	}
	if d.checkpoint == nil || d.socket == "" {
		httpError(w, http.StatusNotImplemented, "this puller takes no checkpoints (started without its socket path, or with checkpoints off)")
		return
	}
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		httpError(w, http.StatusServiceUnavailable, "the puller is shutting down")
		return
	}
	// Checkpoints that ended stay listed (until DELETE, or until more
	// than the limit of them have ended) but no longer count.
	if n := d.liveCheckpoints() + d.creatingCheckpoints; n >= d.max {
		d.mu.Unlock()
		w.Header().Set("Retry-After", "10")
		httpError(w, http.StatusServiceUnavailable, fmt.Sprintf("the puller holds %d checkpoints not yet pushed or failed, its limit (--max-mounts %d): delete one first", n, d.max))
		return
	}
	d.creatingCheckpoints++
	d.mu.Unlock()
	// admit ends the reservation, adding e (if any) to the checkpoints
	// unless the daemon closed meanwhile; it reports whether e was added.
	var once sync.Once
	admit := func(e *checkpointEntry) (added bool) {
		once.Do(func() {
			d.mu.Lock()
			d.creatingCheckpoints--
			added = e != nil && !d.closed
			if added {
				d.checkpoints[e.view.ID] = e
			}
			ended := d.pruneCheckpoints()
			d.mu.Unlock()
			for _, e := range ended {
				d.endCheckpoint(context.Background(), e)
			}
		})
		return added
	}
	defer admit(nil)
	t, err := d.checkpoint(r.Context(), req.Ref, req.Filesystem)
	if errors.Is(err, ErrInvalidRequest) {
		httpError(w, http.StatusBadRequest, err.Error())
		return
	}
	if err != nil {
		httpError(w, http.StatusBadGateway, err.Error())
		return
	}
	var b [6]byte
	rand.Read(b[:])
	id := hex.EncodeToString(b[:])
	dir := filepath.Join(d.mountsDir, id)
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Close(r.Context())
		httpError(w, http.StatusInternalServerError, fmt.Sprintf("image dir: %v", err))
		return
	}
	if err := gofer.WriteImageDir(dir, gofer.Config{MediaType: gofer.MediaType, Reference: req.Ref, Checkpoint: true, Socket: d.socket, Mount: id}); err != nil {
		t.Close(r.Context())
		os.Remove(dir)
		httpError(w, http.StatusInternalServerError, err.Error())
		return
	}
	e := &checkpointEntry{view: Checkpoint{ID: id, Ref: req.Ref, Dir: dir, Filesystem: req.Filesystem, Created: time.Now()}, t: t}
	if !admit(e) {
		d.endCheckpoint(r.Context(), e)
		httpError(w, http.StatusServiceUnavailable, "the puller is shutting down")
		return
	}
	go func() {
		<-t.Done()
		st := t.Status()
		d.log.Info("checkpoint ended", "id", id, "ref", req.Ref, "state", st.State, "index", st.Index, "err", st.Error)
	}()
	d.log.Info("checkpoint prepared", "id", id, "ref", req.Ref, "filesystem", req.Filesystem, "dir", dir)
	writeJSON(w, http.StatusCreated, e.status())
}

func (d *Daemon) lookupCheckpoint(w http.ResponseWriter, r *http.Request) *checkpointEntry {
	d.mu.Lock()
	e := d.checkpoints[r.PathValue("id")]
	d.mu.Unlock()
	if e == nil {
		httpError(w, http.StatusNotFound, "no checkpoint "+r.PathValue("id"))
	}
	return e
}

func (d *Daemon) listCheckpoints(w http.ResponseWriter, r *http.Request) {
	d.mu.Lock()
	out := []Checkpoint{}
	for _, e := range d.checkpoints {
		out = append(out, e.status())
	}
	d.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].Created.Before(out[j].Created) })
	writeJSON(w, http.StatusOK, out)
}

func (d *Daemon) getCheckpoint(w http.ResponseWriter, r *http.Request) {
	if e := d.lookupCheckpoint(w, r); e != nil {
		writeJSON(w, http.StatusOK, e.status())
	}
}

func (d *Daemon) waitCheckpoint(w http.ResponseWriter, r *http.Request) {
	e := d.lookupCheckpoint(w, r)
	if e == nil {
		return
	}
	select {
	case <-e.t.Done():
		writeJSON(w, http.StatusOK, e.status())
	case <-r.Context().Done():
	}
}

// liveCheckpoints counts the checkpoints not yet ended. d.mu is held.
func (d *Daemon) liveCheckpoints() int {
	n := 0
	for _, e := range d.checkpoints {
		if !isDone(e.t.Done()) {
			n++
		}
	}
	return n
}

// pruneCheckpoints forgets the oldest of the checkpoints that ended while
// more than d.max of them are held, and returns them to be ended (their
// dirs removed). d.mu is held.
func (d *Daemon) pruneCheckpoints() []*checkpointEntry {
	var ended []*checkpointEntry
	for _, e := range d.checkpoints {
		if isDone(e.t.Done()) {
			ended = append(ended, e)
		}
	}
	if len(ended) <= d.max {
		return nil
	}
	sort.Slice(ended, func(i, j int) bool { return ended[i].view.Created.Before(ended[j].view.Created) })
	ended = ended[:len(ended)-d.max]
	for _, e := range ended {
		delete(d.checkpoints, e.view.ID)
	}
	return ended
}

func isDone(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// deleteCheckpoint ends a checkpoint (one not pushed yet leaves no tag)
// and removes its image dir. One whose tag is being pushed is not ended
// halfway (409): the caller waits for it, then deletes it.
func (d *Daemon) deleteCheckpoint(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	d.mu.Lock()
	e := d.checkpoints[id]
	if e == nil {
		d.mu.Unlock()
		httpError(w, http.StatusNotFound, "no checkpoint "+id)
		return
	}
	if e.t.Status().State == checkpoint.StateFinishing {
		d.mu.Unlock()
		w.Header().Set("Retry-After", "1")
		httpError(w, http.StatusConflict, "checkpoint "+id+" is being tagged: wait for it (POST /v1/checkpoints/"+id+"/wait), then delete it")
		return
	}
	// Removed under the lock: of concurrent DELETEs, one ends it.
	delete(d.checkpoints, id)
	d.mu.Unlock()
	d.endCheckpoint(r.Context(), e)
	w.WriteHeader(http.StatusNoContent)
}

// endCheckpoint ends e (see checkpoint.Triggered.Close: one being tagged
// is let finish until ctx is done) and removes its image dir.
func (d *Daemon) endCheckpoint(ctx context.Context, e *checkpointEntry) {
	e.t.Close(ctx)
	os.Remove(filepath.Join(e.view.Dir, gofer.ConfigFile))
	os.Remove(e.view.Dir)
	d.log.Info("checkpoint deleted", "id", e.view.ID, "ref", e.view.Ref, "state", e.t.Status().State)
}

// sink finds a checkpoint's sink for the upload API.
func (d *Daemon) sink(id string) (gofer.Sink, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	e := d.checkpoints[id]
	if e == nil {
		return nil, false
	}
	return e.t, true
}
