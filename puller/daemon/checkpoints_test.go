package daemon

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/puller/checkpoint"
	"github.com/cryo-oci/cryo/puller/gofer"
	"github.com/cryo-oci/cryo/transfer"
)

// upload streams data as the file path of checkpoint id, as cryo's gofer
// does (a plain upload), and returns the server's answer.
func (td *testDaemon) upload(id, path string, data []byte) error {
	c := gofer.NewClient(td.sock, id, "", 0)
	defer c.Close()
	u := c.Upload(context.Background(), path)
	for len(data) > 0 {
		n := min(len(data), 1<<20)
		if _, err := u.Write(data[:n]); err != nil {
			// A server that refuses the file answers before it reads it.
			if _, ferr := u.Finish(); ferr != nil {
				return ferr
			}
			return err
		}
		data = data[n:]
	}
	_, err := u.Finish()
	return err
}

func (td *testDaemon) prepareCheckpoint(t *testing.T, ref string) Checkpoint {
	t.Helper()
	var cp Checkpoint
	json.Unmarshal(td.call(t, "POST", "/v1/checkpoints", `{"ref": "`+ref+`", "filesystem": true}`, http.StatusCreated), &cp)
	return cp
}

// startCheckpoint prepares a filesystem checkpoint to ref and uploads
// every file of it but pages.img.
func (td *testDaemon) startCheckpoint(t *testing.T, ref string, files map[string][]byte) Checkpoint {
	t.Helper()
	cp := td.prepareCheckpoint(t, ref)
	for _, name := range []string{"fscheckpoint.pb", "multitar.img", "pages_meta.img"} {
		if err := td.upload(cp.ID, name, files[name]); err != nil {
			t.Fatalf("upload %s: %v", name, err)
		}
	}
	return cp
}

func (td *testDaemon) checkpointState(t *testing.T, id string) Checkpoint {
	t.Helper()
	var cp Checkpoint
	json.Unmarshal(td.call(t, "GET", "/v1/checkpoints/"+id, "", http.StatusOK), &cp)
	return cp
}

// tagged reports whether ref resolves in the registry.
func tagged(t *testing.T, ref string) bool {
	t.Helper()
	repo, tag, err := transfer.Repository(ref, transfer.ClientOptions{})
	if err != nil {
		t.Fatal(err)
	}
	_, err = repo.Resolve(context.Background(), tag)
	return err == nil
}

// TestTriggeredCheckpoint drives a checkpoint the workload triggers
// (SPEC.md 14.4) through the daemon's API and its upload API, as cryo's
// gofer sends a filesystem checkpoint's files: the image dir holds only
// a checkpoint gcs_opts.json for the daemon's socket; the snapshot is
// tagged only once all four files are in, and holds their bytes; a file
// of the other kind of image, or one that comes twice, is refused; a file
// cut short fails the checkpoint, and a checkpoint deleted halfway is
// gone, both without a tag.
func TestTriggeredCheckpoint(t *testing.T) {
	td := newTestDaemon(t, Options{})
	files := map[string][]byte{"fscheckpoint.pb": []byte("manifest"), "multitar.img": make([]byte, 3<<20), "pages_meta.img": make([]byte, 4096), "pages.img": make([]byte, 9<<20)}
	rand.Read(files["multitar.img"])
	rand.Read(files["pages.img"][:5<<20]) // the rest zero pages

	ref := td.host + "/app-fs:v1"
	cp := td.prepareCheckpoint(t, ref)
	if cp.State != checkpoint.StateWaiting || cp.Ref != ref || !cp.Filesystem {
		t.Fatalf("prepared: %+v", cp)
	}
	ents, _ := os.ReadDir(cp.Dir)
	if len(ents) != 1 || ents[0].Name() != gofer.ConfigFile {
		t.Fatalf("checkpoint dir holds %v, want %s alone", ents, gofer.ConfigFile)
	}
	if fi, _ := os.Stat(cp.Dir); fi.Mode().Perm() != 0o700 {
		t.Errorf("checkpoint dir is %v, want 0700", fi.Mode())
	}
	f, err := os.Open(filepath.Join(cp.Dir, gofer.ConfigFile))
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := gofer.ReadConfig(f)
	f.Close()
	if err != nil || !cfg.Checkpoint || cfg.Socket != td.sock || cfg.Mount != cp.ID || cfg.Reference != ref || cfg.Index != "" {
		t.Fatalf("config %+v (%v) for checkpoint %+v", cfg, err, cp)
	}

	for _, name := range []string{"fscheckpoint.pb", "multitar.img", "pages_meta.img"} {
		if err := td.upload(cp.ID, name, files[name]); err != nil {
			t.Fatalf("upload %s: %v", name, err)
		}
	}
	if st := td.checkpointState(t, cp.ID); st.State != checkpoint.StateWriting || len(st.Files) != 3 {
		t.Errorf("three files in: %+v", st)
	}
	if tagged(t, ref) {
		t.Fatal("tagged before the last file came")
	}
	if err := td.upload(cp.ID, "checkpoint.img", []byte("state")); err == nil || !strings.Contains(err.Error(), "409") || !strings.Contains(err.Error(), "not a file of this kind") {
		t.Errorf("checkpoint.img into a filesystem checkpoint: %v, want 409", err)
	}
	if err := td.upload(cp.ID, "multitar.img", files["multitar.img"]); err == nil || !strings.Contains(err.Error(), "409") || !strings.Contains(err.Error(), "came twice") {
		t.Errorf("multitar.img again: %v, want 409", err)
	}
	if err := td.upload(cp.ID, "pages.img", files["pages.img"]); err != nil {
		t.Fatalf("upload pages.img: %v", err)
	}
	var done Checkpoint
	json.Unmarshal(td.call(t, "POST", "/v1/checkpoints/"+cp.ID+"/wait", "", http.StatusOK), &done)
	if done.State != checkpoint.StatePushed || done.Index == "" || done.Files["pages.img"] != int64(len(files["pages.img"])) {
		t.Fatalf("after the last file: %+v", done)
	}
	repo, tag, _ := transfer.Repository(ref, transfer.ClientOptions{})
	desc, err := repo.Resolve(context.Background(), tag)
	if err != nil || desc.Digest.String() != done.Index {
		t.Fatalf("%s resolves to %v (%v), the checkpoint says %s", ref, desc.Digest, err, done.Index)
	}
	dir := filepath.Join(t.TempDir(), "pulled")
	if _, err := transfer.Pull(context.Background(), repo, tag, dir, transfer.PullOptions{}); err != nil {
		t.Fatal(err)
	}
	for name, want := range files {
		if got, err := os.ReadFile(filepath.Join(dir, name)); err != nil || !bytes.Equal(got, want) {
			t.Errorf("%s pulled: %d bytes (%v), %d written", name, len(got), err, len(want))
		}
	}
	if err := td.upload(cp.ID, "pages.img", files["pages.img"]); err == nil || !strings.Contains(err.Error(), "after the checkpoint ended") {
		t.Errorf("a file after the push: %v", err)
	}

	t.Run("cut", func(t *testing.T) {
		ref := td.host + "/app-fs:cut"
		cp := td.startCheckpoint(t, ref, files)
		c := gofer.NewClient(td.sock, cp.ID, "", 0)
		defer c.Close()
		u := c.Upload(context.Background(), "pages.img")
		u.Write(files["pages.img"][:1<<20])
		u.Abort(errors.New("the sentry went away"))
		var st Checkpoint
		json.Unmarshal(td.call(t, "POST", "/v1/checkpoints/"+cp.ID+"/wait", "", http.StatusOK), &st)
		if st.State != checkpoint.StateFailed || st.Error == "" {
			t.Errorf("after a cut pages.img: %+v", st)
		}
		if tagged(t, ref) {
			t.Error("a checkpoint with a file cut short was tagged")
		}
	})

	t.Run("deleted", func(t *testing.T) {
		ref := td.host + "/app-fs:deleted"
		cp := td.startCheckpoint(t, ref, files)
		// DELETE while the last file is being written: the rest of it
		// is refused and nothing is tagged.
		c := gofer.NewClient(td.sock, cp.ID, "", 0)
		defer c.Close()
		u := c.Upload(context.Background(), "pages.img")
		if _, err := u.Write(files["pages.img"][:1<<20]); err != nil {
			t.Fatal(err)
		}
		td.call(t, "DELETE", "/v1/checkpoints/"+cp.ID, "", http.StatusNoContent)
		if _, err := os.Stat(cp.Dir); !os.IsNotExist(err) {
			t.Errorf("the checkpoint's dir after DELETE: %v", err)
		}
		td.call(t, "GET", "/v1/checkpoints/"+cp.ID, "", http.StatusNotFound)
		var werr error
		for off := 1 << 20; off < len(files["pages.img"]) && werr == nil; off += 1 << 20 {
			_, werr = u.Write(files["pages.img"][off : off+1<<20])
		}
		if _, err := u.Finish(); err == nil && werr == nil {
			t.Error("pages.img was taken to its end after DELETE")
		}
		if tagged(t, ref) {
			t.Error("a checkpoint deleted while its pages.img was written was tagged")
		}
	})

	t.Run("stalled", func(t *testing.T) {
		// DELETE while a writer that stopped writing holds pages.img
		// open: the upload is cut, and nothing waits for its writer.
		ref := td.host + "/app-fs:stalled"
		cp := td.startCheckpoint(t, ref, files)
		pr, pw := io.Pipe()
		defer pw.Close()
		req, _ := http.NewRequest("PUT", "http://puller/v1/checkpoints/"+cp.ID+"/files/pages.img", pr)
		answered := make(chan int, 1)
		go func() {
			resp, err := td.client.Do(req)
			if err != nil {
				answered <- 0
				return
			}
			resp.Body.Close()
			answered <- resp.StatusCode
		}()
		if _, err := pw.Write(files["pages.img"][:1<<20]); err != nil {
			t.Fatal(err)
		}
		td.call(t, "DELETE", "/v1/checkpoints/"+cp.ID, "", http.StatusNoContent)
		select {
		case code := <-answered:
			if code == http.StatusCreated {
				t.Errorf("a stalled pages.img was taken after DELETE")
			}
		case <-time.After(30 * time.Second):
			t.Fatal("the upload of a deleted checkpoint still waits for its writer 30 s after DELETE")
		}
		if tagged(t, ref) {
			t.Error("a deleted checkpoint was tagged")
		}
	})

	t.Run("tagging", func(t *testing.T) {
		// A DELETE while the tag is being pushed does not end the
		// checkpoint halfway: 409, and it is reported as it ends.
		ref := td.host + "/app-fs:tagging"
		cp := td.startCheckpoint(t, ref, files)
		seen := td.gate.Hold()
		t.Cleanup(td.gate.Release)
		if err := td.upload(cp.ID, "pages.img", files["pages.img"]); err != nil {
			t.Fatal(err)
		}
		select {
		case <-seen:
		case <-time.After(time.Minute):
			t.Fatal("no tag was pushed after the last file")
		}
		td.call(t, "DELETE", "/v1/checkpoints/"+cp.ID, "", http.StatusConflict)
		td.gate.Release()
		var st Checkpoint
		json.Unmarshal(td.call(t, "POST", "/v1/checkpoints/"+cp.ID+"/wait", "", http.StatusOK), &st)
		if st.State != checkpoint.StatePushed || !tagged(t, ref) {
			t.Errorf("after the tag's answer came: %+v, tagged %v", st, tagged(t, ref))
		}
		td.call(t, "DELETE", "/v1/checkpoints/"+cp.ID, "", http.StatusNoContent)
		if !tagged(t, ref) {
			t.Error("deleting a pushed checkpoint removed its tag")
		}
	})

	var list []Checkpoint
	json.Unmarshal(td.call(t, "GET", "/v1/checkpoints", "", http.StatusOK), &list)
	if len(list) != 2 || list[0].ID != cp.ID {
		t.Errorf("listed %+v, want the pushed and the failed checkpoint", list)
	}
	td.call(t, "POST", "/v1/checkpoints", `{"ref": ""}`, http.StatusBadRequest)
	td.call(t, "POST", "/v1/checkpoints", `{"ref": "`+td.host+`/UPPER case"}`, http.StatusBadRequest)
}

// cut starts a file of checkpoint id and aborts it, as a sentry that went
// away does, and waits for the checkpoint to fail.
func (td *testDaemon) cut(t *testing.T, id string) {
	t.Helper()
	c := gofer.NewClient(td.sock, id, "", 0)
	defer c.Close()
	u := c.Upload(context.Background(), "multitar.img")
	u.Write(make([]byte, 1<<20))
	u.Abort(errors.New("the sentry went away"))
	var st Checkpoint
	json.Unmarshal(td.call(t, "POST", "/v1/checkpoints/"+id+"/wait", "", http.StatusOK), &st)
	if st.State != checkpoint.StateFailed {
		t.Fatalf("after a cut file: %+v", st)
	}
}

// TestCheckpointLimit checks --max-mounts for checkpoints: it bounds those
// not yet ended; ended ones stay listed until more than the limit of them
// have ended, then the oldest goes, with its dir.
func TestCheckpointLimit(t *testing.T) {
	td := newTestDaemon(t, Options{MaxMounts: 1})
	a := td.prepareCheckpoint(t, td.host+"/app-fs:a")
	td.call(t, "POST", "/v1/checkpoints", `{"ref": "`+td.host+`/app-fs:b", "filesystem": true}`, http.StatusServiceUnavailable)
	td.cut(t, a.ID)
	b := td.prepareCheckpoint(t, td.host+"/app-fs:b")
	td.checkpointState(t, a.ID) // still listed
	td.cut(t, b.ID)
	c := td.prepareCheckpoint(t, td.host+"/app-fs:c")
	var list []Checkpoint
	json.Unmarshal(td.call(t, "GET", "/v1/checkpoints", "", http.StatusOK), &list)
	if len(list) != 2 || list[0].ID != b.ID || list[1].ID != c.ID {
		t.Errorf("listed %+v, want b (ended) and c", list)
	}
	if _, err := os.Stat(a.Dir); !os.IsNotExist(err) {
		t.Errorf("the dir of a checkpoint no longer listed: %v", err)
	}
}

// TestCheckpointDuringClose closes the daemon while a checkpoint is being
// prepared: the request is refused (503) and leaves neither a session nor
// a dir behind.
func TestCheckpointDuringClose(t *testing.T) {
	entered, release := make(chan struct{}), make(chan struct{})
	td := newTestDaemon(t, Options{Checkpoint: func(ctx context.Context, req CheckpointRequest) (*checkpoint.Triggered, error) {
		close(entered)
		<-release
		repo, tag, err := transfer.Repository(req.Ref, transfer.ClientOptions{})
		if err != nil {
			return nil, err
		}
		return checkpoint.NewTriggered(ctx, checkpoint.TriggeredOptions{Repo: repo, Tag: tag, Filesystem: req.Filesystem})
	}})
	type answer struct {
		code int
		body []byte
	}
	answered := make(chan answer, 1)
	go func() {
		resp, err := td.client.Post("http://puller/v1/checkpoints", "application/json", strings.NewReader(`{"ref": "`+td.host+`/app-fs:closing", "filesystem": true}`))
		if err != nil {
			answered <- answer{0, []byte(err.Error())}
			return
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		answered <- answer{resp.StatusCode, body}
	}()
	<-entered
	td.d.Close()
	close(release)
	if a := <-answered; a.code != http.StatusServiceUnavailable {
		t.Errorf("a checkpoint prepared while the daemon closed: %d %s, want 503", a.code, a.body)
	}
	if ents, _ := os.ReadDir(td.mounts); len(ents) != 0 {
		t.Errorf("the mounts dir holds %v after the daemon closed", ents)
	}
	td.d.mu.Lock()
	n := len(td.d.checkpoints)
	td.d.mu.Unlock()
	if n != 0 {
		t.Errorf("the closed daemon holds %d checkpoints", n)
	}
}

// TestCheckpointAdoptedAfterRestart: a session no file came to survives
// the daemon's restart (its sandbox, created with the dir in its
// annotations, may checkpoint later): the next daemon on the same socket
// and mounts dir lists it, takes its files and tags the snapshot. A
// session cut by the stop is gone with its dir, and a dir whose config
// cannot be read is removed.
func TestCheckpointAdoptedAfterRestart(t *testing.T) {
	td := newTestDaemon(t, Options{})
	waiting := td.prepareCheckpoint(t, td.host+"/app-fs:adopted")
	started := td.prepareCheckpoint(t, td.host+"/app-fs:started")
	if err := td.upload(started.ID, "fscheckpoint.pb", []byte("manifest")); err != nil {
		t.Fatal(err)
	}
	// Beside them: dirs that are not this daemon's sessions, left alone,
	// and one that is but can no longer be prepared, removed.
	writeConfig := func(name, config string) string {
		dir := filepath.Join(td.mounts, name)
		os.Mkdir(dir, 0o700)
		os.WriteFile(filepath.Join(dir, gofer.ConfigFile), []byte(config), 0o600)
		return dir
	}
	unreadable := writeConfig("unreadable", "{")
	mount := writeConfig("mount", `{"mediaType": "`+gofer.MediaType+`", "reference": "r/a:v1", "index": "sha256:`+strings.Repeat("0", 64)+`", "socket": "`+td.sock+`", "mount": "mount"}`)
	other := writeConfig("other", `{"mediaType": "`+gofer.MediaType+`", "reference": "r/a:v1", "checkpoint": true, "socket": "/run/other.sock", "mount": "other"}`)
	badRef := writeConfig("badref", `{"mediaType": "`+gofer.MediaType+`", "reference": "r/UPPER:v1", "checkpoint": true, "socket": "`+td.sock+`", "mount": "badref"}`)
	os.Symlink(waiting.Dir, filepath.Join(td.mounts, "link"))
	td.d.Close()
	if _, err := os.Stat(filepath.Join(waiting.Dir, gofer.ConfigFile)); err != nil {
		t.Fatalf("a waiting session's dir after the daemon stopped: %v", err)
	}
	if _, err := os.Stat(started.Dir); !os.IsNotExist(err) {
		t.Errorf("a session cut by the stop kept its dir: %v", err)
	}

	var adopted []CheckpointRequest
	next := newTestDaemon(t, Options{MountsDir: td.mounts, Socket: td.sock, Checkpoint: func(ctx context.Context, req CheckpointRequest) (*checkpoint.Triggered, error) {
		adopted = append(adopted, req)
		repo, tag, err := transfer.Repository(req.Ref, transfer.ClientOptions{})
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrInvalidRequest, err)
		}
		return checkpoint.NewTriggered(ctx, checkpoint.TriggeredOptions{Repo: repo, Tag: tag, Filesystem: req.Filesystem, Deferred: req.Adopted})
	}})
	for _, req := range adopted {
		if !req.Adopted {
			t.Errorf("a session taken over was prepared as a new one: %+v", req)
		}
	}
	st := next.checkpointState(t, waiting.ID)
	if st.State != checkpoint.StateWaiting || st.Ref != waiting.Ref || !st.Filesystem || st.Dir != waiting.Dir {
		t.Fatalf("adopted: %+v, was %+v", st, waiting)
	}
	next.call(t, "GET", "/v1/checkpoints/"+started.ID, "", http.StatusNotFound)
	for _, dir := range []string{unreadable, mount, other} {
		if _, err := os.Stat(filepath.Join(dir, gofer.ConfigFile)); err != nil {
			t.Errorf("a dir not of this daemon's sessions was touched: %v", err)
		}
	}
	if _, err := os.Stat(badRef); !os.IsNotExist(err) {
		t.Errorf("a session dir that can no longer be prepared was kept: %v", err)
	}
	var list []Checkpoint
	json.Unmarshal(next.call(t, "GET", "/v1/checkpoints", "", http.StatusOK), &list)
	if len(list) != 1 {
		t.Errorf("adopted %+v, want the waiting session alone", list)
	}
	if fi, err := os.Stat(filepath.Join(waiting.Dir, gofer.ConfigFile)); err != nil {
		t.Error(err)
	} else if !st.Created.Equal(fi.ModTime()) {
		t.Errorf("adopted session created %v, its config written %v", st.Created, fi.ModTime())
	}
	files := map[string][]byte{"fscheckpoint.pb": []byte("manifest"), "multitar.img": make([]byte, 1<<20), "pages_meta.img": make([]byte, 4096), "pages.img": make([]byte, 2<<20)}
	rand.Read(files["pages.img"])
	for name, data := range files {
		if err := next.upload(waiting.ID, name, data); err != nil {
			t.Fatalf("upload %s to the adopted session: %v", name, err)
		}
	}
	json.Unmarshal(next.call(t, "POST", "/v1/checkpoints/"+waiting.ID+"/wait", "", http.StatusOK), &st)
	if st.State != checkpoint.StatePushed || !tagged(t, waiting.Ref) {
		t.Errorf("the adopted session after its files: %+v", st)
	}
}

// TestCheckpointRepos: with Options.CheckpointRepos a checkpoint may go to
// the repositories named (and under a prefix ending in "/") only; others
// get 403, before anything is prepared.
func TestCheckpointRepos(t *testing.T) {
	h := "127.0.0.1:1" // nothing is pushed: the refs are only checked
	td := newTestDaemon(t, Options{CheckpointRepos: []string{h + "/allowed", h + "/team/"}, Checkpoint: func(ctx context.Context, req CheckpointRequest) (*checkpoint.Triggered, error) {
		repo, tag, err := transfer.Repository(req.Ref, transfer.ClientOptions{})
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrInvalidRequest, err)
		}
		return checkpoint.NewTriggered(ctx, checkpoint.TriggeredOptions{Repo: repo, Tag: tag, Deferred: true})
	}})
	for ref, want := range map[string]int{
		h + "/allowed:v1":     http.StatusCreated,
		h + "/team/app:v1":    http.StatusCreated,
		h + "/team/a/b:v1":    http.StatusCreated,
		h + "/other:v1":       http.StatusForbidden,
		h + "/allowedx:v1":    http.StatusForbidden,
		h + "/team:v1":        http.StatusForbidden,
		"127.0.0.2:1/allowed": http.StatusForbidden,
		h + "/UPPER":          http.StatusBadRequest,
	} {
		if code, body := td.do(t, "POST", "/v1/checkpoints", `{"ref": "`+ref+`"}`); code != want {
			t.Errorf("checkpoint to %s: %d %s, want %d", ref, code, body, want)
		}
	}
	for _, bad := range []string{"no-slash", h + "/App", h + "/app:v1", h + "/app@sha256:" + strings.Repeat("0", 64), "/app"} {
		if _, err := New(td.p, nil, Options{MountsDir: t.TempDir(), CheckpointRepos: []string{bad}}); err == nil {
			t.Errorf("checkpoint repository %q was taken: it can match no reference", bad)
		}
	}
	for _, good := range []string{h + "/", "reg.example.com:5000/a/b", "reg/a/"} {
		if _, err := New(td.p, nil, Options{MountsDir: t.TempDir(), CheckpointRepos: []string{good}}); err != nil {
			t.Errorf("checkpoint repository %q: %v", good, err)
		}
	}
}
