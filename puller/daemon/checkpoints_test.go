package daemon

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

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
	if err := td.upload(cp.ID, "checkpoint.img", []byte("state")); err == nil || !strings.Contains(err.Error(), "not a file of this kind") {
		t.Errorf("checkpoint.img into a filesystem checkpoint: %v", err)
	}
	if err := td.upload(cp.ID, "multitar.img", files["multitar.img"]); err == nil || !strings.Contains(err.Error(), "came twice") {
		t.Errorf("multitar.img again: %v", err)
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
		cp := td.prepareCheckpoint(t, ref)
		for _, name := range []string{"fscheckpoint.pb", "multitar.img", "pages_meta.img"} {
			if err := td.upload(cp.ID, name, files[name]); err != nil {
				t.Fatalf("upload %s: %v", name, err)
			}
		}
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
		cp := td.prepareCheckpoint(t, ref)
		if err := td.upload(cp.ID, "fscheckpoint.pb", files["fscheckpoint.pb"]); err != nil {
			t.Fatal(err)
		}
		td.call(t, "DELETE", "/v1/checkpoints/"+cp.ID, "", http.StatusNoContent)
		if _, err := os.Stat(cp.Dir); !os.IsNotExist(err) {
			t.Errorf("the checkpoint's dir after DELETE: %v", err)
		}
		td.call(t, "GET", "/v1/checkpoints/"+cp.ID, "", http.StatusNotFound)
		for _, name := range []string{"multitar.img", "pages_meta.img", "pages.img"} {
			if err := td.upload(cp.ID, name, files[name]); err == nil {
				t.Errorf("upload %s after DELETE: accepted", name)
			}
		}
		if tagged(t, ref) {
			t.Error("a deleted checkpoint was tagged")
		}
	})

	var list []Checkpoint
	json.Unmarshal(td.call(t, "GET", "/v1/checkpoints", "", http.StatusOK), &list)
	if len(list) != 2 || list[0].ID != cp.ID {
		t.Errorf("listed %+v, want the pushed and the failed checkpoint", list)
	}
	td.call(t, "POST", "/v1/checkpoints", `{"ref": ""}`, http.StatusBadRequest)
}
