package checkpoint

import (
	"context"
	"crypto/rand"
	"errors"
	"io"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/puller/gofer"
	"github.com/cryo-oci/cryo/registry"
	"github.com/cryo-oci/cryo/transfer"
	"github.com/sirupsen/logrus"
)

// triggeredEnv is a real registry behind a TagGate, and a Triggered
// checkpoint into it.
type triggeredEnv struct {
	gate *testenv.TagGate
	host string
}

func newTriggeredEnv(t *testing.T) *triggeredEnv {
	t.Helper()
	logrus.SetLevel(logrus.ErrorLevel)
	cfg, _ := registry.DefaultConfig(t.TempDir(), "127.0.0.1:0")
	srv, err := registry.New(context.Background(), cfg, registry.Options{})
	if err != nil {
		t.Fatal(err)
	}
	gate := testenv.NewTagGate(srv.Handler())
	hs := httptest.NewServer(gate)
	t.Cleanup(hs.Close)
	t.Cleanup(gate.Release)
	return &triggeredEnv{gate: gate, host: strings.TrimPrefix(hs.URL, "http://")}
}

func (e *triggeredEnv) prepare(t *testing.T, tag string) *Triggered {
	t.Helper()
	repo, _, err := transfer.Repository(e.host+"/app:"+tag, transfer.ClientOptions{})
	if err != nil {
		t.Fatal(err)
	}
	tr, err := NewTriggered(context.Background(), TriggeredOptions{Repo: repo, Tag: tag, Push: transfer.PushOptions{Pack: format.PackOptions{Format: format.V2}}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tr.Close(context.Background()) })
	return tr
}

// tagged reports whether app:tag resolves, and to what.
func (e *triggeredEnv) tagged(t *testing.T, tag string) (string, bool) {
	t.Helper()
	repo, _, _ := transfer.Repository(e.host+"/app:"+tag, transfer.ClientOptions{})
	desc, err := repo.Resolve(context.Background(), tag)
	return desc.Digest.String(), err == nil
}

func addSmallFiles(t *testing.T, tr *Triggered) {
	t.Helper()
	for _, name := range []string{format.CheckpointFile, format.PagesMetaFile} {
		if _, err := tr.AddFile(context.Background(), name, gofer.FileMode, strings.NewReader("state of "+name)); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
	}
}

// TestTriggeredClose closes Triggered checkpoints where the daemon's
// DELETE and shutdown do: one whose pages.img is being written fails
// with ErrClosed, stops packing and leaves no tag; one whose tag is being
// pushed is let finish, and says it was pushed.
func TestTriggeredClose(t *testing.T) {
	env := newTriggeredEnv(t)
	pages := make([]byte, 16<<20)
	rand.Read(pages)

	t.Run("writing", func(t *testing.T) {
		tr := env.prepare(t, "writing")
		addSmallFiles(t, tr)
		pr, pw := io.Pipe()
		added := make(chan error, 1)
		go func() {
			_, err := tr.AddFile(context.Background(), format.PagesFile, gofer.FileMode, pr)
			pr.CloseWithError(errors.New("the packer stopped reading"))
			added <- err
		}()
		if _, err := pw.Write(pages[:1<<20]); err != nil {
			t.Fatal(err)
		}
		if st := tr.Status(); st.State != StateWriting {
			t.Fatalf("while pages.img is written: %+v", st)
		}
		tr.Close(context.Background())
		// The sentry goes on writing: the packing stops anyway, before
		// the file's end.
		go func() {
			for off := 1 << 20; off < len(pages); off += 1 << 20 {
				if _, err := pw.Write(pages[off : off+1<<20]); err != nil {
					return
				}
			}
			pw.Close()
		}()
		if err := <-added; err == nil {
			t.Error("pages.img was packed to its end after Close")
		}
		if _, err := tr.Wait(context.Background()); !errors.Is(err, ErrClosed) {
			t.Errorf("Wait after Close: %v, want ErrClosed", err)
		}
		if st := tr.Status(); st.State != StateFailed {
			t.Errorf("after Close: %+v", st)
		}
		if _, err := tr.AddFile(context.Background(), format.PagesFile, gofer.FileMode, strings.NewReader("late")); !errors.Is(err, gofer.ErrRefused) {
			t.Errorf("a file after Close: %v, want one that wraps gofer.ErrRefused", err)
		}
		if _, ok := env.tagged(t, "writing"); ok {
			t.Error("a checkpoint closed while pages.img was written was tagged")
		}
	})

	t.Run("tagging", func(t *testing.T) {
		tr := env.prepare(t, "tagging")
		addSmallFiles(t, tr)
		seen := env.gate.Hold()
		t.Cleanup(env.gate.Release) // before tr's Close, which waits for the tag
		if _, err := tr.AddFile(context.Background(), format.PagesFile, gofer.FileMode, strings.NewReader(string(pages))); err != nil {
			t.Fatal(err)
		}
		select {
		case <-seen:
		case <-time.After(time.Minute):
			t.Fatal("no tag was pushed after the last file")
		}
		if st := tr.Status(); st.State != StateFinishing {
			t.Fatalf("while its tag is pushed: %+v", st)
		}
		closed := make(chan struct{})
		go func() {
			tr.Close(context.Background())
			close(closed)
		}()
		// The registry stored the tag; its answer is held. Close must
		// not report the checkpoint failed meanwhile.
		if st := tr.Status(); st.State != StateFinishing {
			t.Errorf("Close ended a checkpoint whose tag was being pushed: %+v", st)
		}
		env.gate.Release()
		<-closed
		res, err := tr.Wait(context.Background())
		if err != nil {
			t.Fatalf("a checkpoint closed while tagged: %v", err)
		}
		if got, ok := env.tagged(t, "tagging"); !ok || got != res.Descriptor.Digest.String() {
			t.Errorf("tag resolves to %s (%v), the checkpoint says %s", got, ok, res.Descriptor.Digest)
		}
		if st := tr.Status(); st.State != StatePushed || st.Index != res.Descriptor.Digest.String() {
			t.Errorf("after Close: %+v", st)
		}
	})
}
