package daemon

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/cryo-oci/cryo/puller"
	"github.com/cryo-oci/cryo/puller/checkpoint"
	"github.com/cryo-oci/cryo/puller/gofer"
	"github.com/cryo-oci/cryo/transfer"
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

// CheckpointFunc prepares a checkpoint (tagged at its ref once the
// workload has written it). An error of the request itself (a ref it
// cannot parse, or that names no tag) wraps ErrInvalidRequest.
type CheckpointFunc func(ctx context.Context, req CheckpointRequest) (*checkpoint.Triggered, error)

// CheckpointRequest is what a CheckpointFunc prepares.
type CheckpointRequest struct {
	// Ref is where the snapshot goes (host/repo:tag).
	Ref string
	// Filesystem asks for a filesystem checkpoint's files.
	Filesystem bool
	// Adopted is set for a session of an earlier daemon taken over at
	// start: the registry is not asked anything until its first file
	// comes (checkpoint.TriggeredOptions.Deferred).
	Adopted bool
}

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
	if err := d.checkpointAllowed(req.Ref); err != nil {
		code := http.StatusForbidden
		if errors.Is(err, ErrInvalidRequest) {
			code = http.StatusBadRequest
		}
		httpError(w, code, err.Error())
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
	t, err := d.checkpoint(r.Context(), CheckpointRequest{Ref: req.Ref, Filesystem: req.Filesystem})
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
	if err := gofer.WriteImageDir(dir, gofer.Config{MediaType: gofer.MediaType, Reference: req.Ref, Checkpoint: true, Filesystem: req.Filesystem, Socket: d.socket, Mount: id}); err != nil {
		t.Close(r.Context())
		removeImageDir(dir)
		httpError(w, http.StatusInternalServerError, err.Error())
		return
	}
	e := &checkpointEntry{view: Checkpoint{ID: id, Ref: req.Ref, Dir: dir, Filesystem: req.Filesystem, Created: time.Now()}, t: t}
	if !admit(e) {
		d.endCheckpoint(r.Context(), e)
		httpError(w, http.StatusServiceUnavailable, "the puller is shutting down")
		return
	}
	d.watchCheckpoint(e)
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
	// Ended (or found finishing) under d.mu, so that a DELETE never
	// waits for a tag, and of concurrent DELETEs one ends it.
	if !e.t.TryClose() {
		d.mu.Unlock()
		w.Header().Set("Retry-After", "1")
		httpError(w, http.StatusConflict, "checkpoint "+id+" is being tagged: wait for it (POST /v1/checkpoints/"+id+"/wait), then delete it")
		return
	}
	delete(d.checkpoints, id)
	d.mu.Unlock()
	d.endCheckpoint(r.Context(), e)
	w.WriteHeader(http.StatusNoContent)
}

// endCheckpoint ends e (see checkpoint.Triggered.Close: one being tagged
// is let finish until ctx is done) and removes its image dir.
func (d *Daemon) endCheckpoint(ctx context.Context, e *checkpointEntry) {
	e.t.Close(ctx)
	removeImageDir(e.view.Dir)
	d.log.Info("checkpoint deleted", "id", e.view.ID, "ref", e.view.Ref, "state", e.t.Status().State)
}

// removeImageDir removes an image dir cryo made (a mount point, or a dir
// holding only its gcs_opts.json), nothing else.
func removeImageDir(dir string) {
	os.Remove(filepath.Join(dir, gofer.ConfigFile))
	os.Remove(dir)
}

// checkpointAllowed checks that ref names a repository checkpoints may go
// to (Options.CheckpointRepos).
func (d *Daemon) checkpointAllowed(ref string) error {
	if len(d.checkpointRepos) == 0 {
		return nil
	}
	parsed, err := transfer.ParseReference(ref)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidRequest, err)
	}
	repo := parsed.Registry + "/" + parsed.Repository
	for _, allowed := range d.checkpointRepos {
		if repo == allowed || (strings.HasSuffix(allowed, "/") && strings.HasPrefix(repo, allowed)) {
			return nil
		}
	}
	return fmt.Errorf("checkpoint to %s: this puller pushes checkpoints only to %s (--checkpoint-repo)", repo, strings.Join(d.checkpointRepos, ", "))
}

// closeCheckpoints ends the checkpoints of a daemon that closes, giving
// one being tagged closeGrace to finish; the channel is closed once all
// ended. One no file came to yet keeps its dir, for the daemon that
// starts next to take over (its sandbox may still checkpoint).
func (d *Daemon) closeCheckpoints(checkpoints map[string]*checkpointEntry) <-chan struct{} {
	ctx, cancel := context.WithTimeout(context.Background(), closeGrace)
	var wg sync.WaitGroup
	for _, e := range checkpoints {
		if e.t.CloseIfWaiting() {
			d.log.Info("checkpoint left for the next daemon", "id", e.view.ID, "ref", e.view.Ref, "dir", e.view.Dir)
			continue
		}
		wg.Go(func() { d.endCheckpoint(ctx, e) })
	}
	ended := make(chan struct{})
	go func() {
		wg.Wait()
		cancel()
		close(ended)
	}()
	return ended
}

// adoptCheckpoints takes over the sessions an earlier daemon on the same
// socket left waiting (SPEC.md 14.4): their sandboxes hold the dir in
// their annotations and runsc's gofer will upload to this socket. Each is
// found by its gcs_opts.json, a checkpoint's naming this socket and its
// dir's name as the session; the registry is asked nothing until its
// first file comes. Only dirs right under the mounts dir are looked at,
// never a mount point (another puller's live mount) or a symlink, and the
// config must be a regular file. A session dir whose repository is no
// longer allowed (Options.CheckpointRepos) or whose ref no longer parses
// is removed (its sandbox's checkpoint would fail anyway); every other
// dir, one whose config this version cannot read among them, is left as
// it is.
func (d *Daemon) adoptCheckpoints() {
	points, err := puller.MountPointsUnder(d.mountsDir)
	if err != nil {
		d.log.Error("adopt checkpoints", "err", err)
		return
	}
	root, err := os.OpenRoot(d.mountsDir)
	if err != nil {
		d.log.Error("adopt checkpoints", "err", err)
		return
	}
	defer root.Close()
	ents, err := os.ReadDir(d.mountsDir)
	if err != nil {
		d.log.Error("adopt checkpoints", "err", err)
		return
	}
	for _, ent := range ents {
		name := ent.Name()
		dir := filepath.Join(d.mountsDir, name)
		if !ent.IsDir() || points[dir] {
			continue
		}
		cfgPath := filepath.Join(name, gofer.ConfigFile)
		data, created, err := readSmall(root, cfgPath, gofer.MaxConfigSize)
		if err != nil {
			continue // no image dir of cryo's
		}
		// Leniently first: a config that does not name this daemon's
		// session (a gofer mount's, another daemon's, a newer cryo's)
		// is not this daemon's to judge.
		var names struct {
			MediaType  string `json:"mediaType"`
			Checkpoint bool   `json:"checkpoint"`
			Socket     string `json:"socket"`
			Mount      string `json:"mount"`
		}
		if json.Unmarshal(data, &names) != nil || names.MediaType != gofer.MediaType || !names.Checkpoint || names.Socket != d.socket || names.Mount != name {
			continue
		}
		cfg, err := gofer.ReadConfig(bytes.NewReader(data))
		if err != nil {
			// Perhaps a newer cryo's, with a key this one does not know.
			d.log.Error("adopt checkpoint: left as it is", "dir", dir, "err", err)
			continue
		}
		err = d.checkpointAllowed(cfg.Reference)
		var t *checkpoint.Triggered
		if err == nil {
			t, err = d.checkpoint(context.Background(), CheckpointRequest{Ref: cfg.Reference, Filesystem: cfg.Filesystem, Adopted: true})
			if err != nil && !errors.Is(err, ErrInvalidRequest) {
				d.log.Error("adopt checkpoint: left as it is", "dir", dir, "err", err)
				continue
			}
		}
		if err != nil {
			d.log.Error("adopt checkpoint: removed", "dir", dir, "err", err)
			if rerr := errors.Join(root.Remove(cfgPath), root.Remove(name)); rerr != nil {
				d.log.Error("adopt checkpoint: remove", "dir", dir, "err", rerr)
			}
			continue
		}
		e := &checkpointEntry{view: Checkpoint{ID: name, Ref: cfg.Reference, Dir: dir, Filesystem: cfg.Filesystem, Created: created}, t: t}
		d.checkpoints[e.view.ID] = e
		d.watchCheckpoint(e)
		d.log.Info("checkpoint adopted", "id", e.view.ID, "ref", cfg.Reference, "filesystem", cfg.Filesystem, "dir", dir)
	}
}

// readSmall reads the file at path in root, of at most limit bytes, and
// returns it with its modification time.
func readSmall(root *os.Root, path string, limit int) ([]byte, time.Time, error) {
	// Lstat first: not a symlink, nor a FIFO an open would block on.
	fi, err := root.Lstat(path)
	if err != nil {
		return nil, time.Time{}, err
	}
	if !fi.Mode().IsRegular() || fi.Size() > int64(limit) {
		return nil, time.Time{}, fmt.Errorf("%s: not a regular file of at most %d bytes", path, limit)
	}
	f, err := root.Open(path)
	if err != nil {
		return nil, time.Time{}, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, int64(limit)+1))
	if err == nil && len(data) > limit {
		err = fmt.Errorf("%s: over %d bytes", path, limit)
	}
	return data, fi.ModTime(), err
}

// watchCheckpoint logs e's end.
func (d *Daemon) watchCheckpoint(e *checkpointEntry) {
	go func() {
		<-e.t.Done()
		st := e.t.Status()
		d.log.Info("checkpoint ended", "id", e.view.ID, "ref", e.view.Ref, "state", st.State, "index", st.Index, "err", st.Error)
	}()
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
