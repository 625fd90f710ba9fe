package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"slices"
	"sync"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/puller/gofer"
	"github.com/cryo-oci/cryo/transfer"
	"oras.land/oras-go/v2/registry/remote"
)

// TriggeredOptions configure a Triggered checkpoint.
type TriggeredOptions struct {
	// Repo and Tag are where the snapshot goes; Push tunes the packing.
	Repo *remote.Repository
	Tag  string
	Push transfer.PushOptions
	// Filesystem waits for a filesystem checkpoint's files (the
	// dev.gvisor.internal.fscheckpoint.path annotation) instead of a
	// checkpoint's (dev.gvisor.internal.checkpoint.path).
	Filesystem bool
	// Deferred asks the registry nothing until the first file comes (the
	// pusher, which resolves the tag's previous snapshot to dedupe
	// against, is made then): for a session taken over from an earlier
	// daemon, whose registry may not answer while this one starts.
	// Without it NewTriggered fails at once if the registry does.
	Deferred bool
}

// Triggered is a checkpoint no runsc command starts: the sandbox's
// workload does, through /proc/gvisor (gVisor's
// dev.gvisor.internal.checkpoint.path and .fscheckpoint.path annotations
// name the image dir; runsc starts cryo's gofer with the sandbox, and the
// gofer uploads to whoever serves this Triggered as its gofer.Sink). It
// is finished, the snapshot index pushed and tagged, once every file of
// its kind (format.ImageFiles) is packed; not before, so that one cut
// short leaves no tag. It takes one checkpoint: a file that comes twice,
// or after the snapshot is finished or failed, is refused (an error that
// wraps gofer.ErrRefused).
type Triggered struct {
	repo *remote.Repository
	push transfer.PushOptions
	// pusher is made by NewTriggered, or (Deferred) by the first AddFile,
	// under pmu; sink wraps it.
	pmu    sync.Mutex
	pusher *transfer.Pusher
	tag    string
	want   []string
	sink   *countingSink
	// ctx bounds the packing and the finish; the checkpoint's end (and
	// Close) cancels it.
	ctx    context.Context
	cancel context.CancelFunc
	done   chan struct{}
	// busy counts the AddFiles and the finish using the pusher, which is
	// released once the checkpoint ended and they returned.
	busy sync.WaitGroup

	mu      sync.Mutex
	started map[string]bool
	// finishing is set once the last file is packed.
	finishing bool
	res       *transfer.PushResult
	err       error
	// at is when the first file came; took how long from then until
	// the snapshot was tagged.
	at   time.Time
	took time.Duration
}

// ErrClosed is the error of a Triggered checkpoint closed before it was
// finished.
var ErrClosed = errors.New("checkpoint closed before its snapshot was finished")

// NewTriggered prepares a checkpoint into opts.Repo, tagged opts.Tag once
// the workload has written it.
func NewTriggered(ctx context.Context, opts TriggeredOptions) (*Triggered, error) {
	if opts.Repo == nil || opts.Tag == "" {
		return nil, errors.New("checkpoint: a repository and a tag are needed")
	}
	fctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	t := &Triggered{
		repo:    opts.Repo,
		push:    opts.Push,
		tag:     opts.Tag,
		want:    format.ImageFiles(opts.Filesystem),
		sink:    &countingSink{files: map[string]int64{}},
		ctx:     fctx,
		cancel:  cancel,
		done:    make(chan struct{}),
		started: map[string]bool{},
	}
	if !opts.Deferred {
		if err := t.makePusher(ctx); err != nil {
			cancel()
			return nil, err
		}
	}
	return t, nil
}

// makePusher makes the pusher, unless made.
func (t *Triggered) makePusher(ctx context.Context) error {
	t.pmu.Lock()
	defer t.pmu.Unlock()
	if t.pusher != nil {
		return nil
	}
	pusher, err := transfer.NewPusher(ctx, t.repo, t.tag, t.push)
	if err != nil {
		return fmt.Errorf("checkpoint to %s: %w", t.tag, err)
	}
	t.pusher, t.sink.sink = pusher, pusher
	return nil
}

// AddFile implements gofer.Sink: it packs one file of the checkpoint and,
// after the last of them, finishes the snapshot in the background.
func (t *Triggered) AddFile(ctx context.Context, path string, mode fs.FileMode, r io.Reader) (int64, error) {
	t.mu.Lock()
	switch {
	case t.isOver():
		t.mu.Unlock()
		return 0, fmt.Errorf("checkpoint to %s: %s came after the checkpoint ended (%s): %w", t.tag, path, t.stateLocked(), gofer.ErrRefused)
	case !slices.Contains(t.want, path):
		t.mu.Unlock()
		return 0, fmt.Errorf("checkpoint to %s: %s is not a file of this kind of image (%v): %w", t.tag, path, t.want, gofer.ErrRefused)
	case t.started[path]:
		t.mu.Unlock()
		return 0, fmt.Errorf("checkpoint to %s: %s came twice: %w", t.tag, path, gofer.ErrRefused)
	}
	if len(t.started) == 0 {
		t.at = time.Now()
	}
	t.started[path] = true
	t.busy.Add(1)
	t.mu.Unlock()
	defer t.busy.Done()
	// The checkpoint's end (Close, a failed file) stops the packing, and
	// the making of a deferred pusher, too.
	ctx, cancel := context.WithCancel(ctx)
	defer context.AfterFunc(t.ctx, cancel)()
	defer cancel()
	if err := t.makePusher(ctx); err != nil {
		t.end(nil, err)
		return 0, err
	}
	n, err := t.sink.AddFile(ctx, path, mode, r)
	if err != nil {
		t.end(nil, err)
		return n, err
	}
	t.mu.Lock()
	last := len(t.sink.sizes()) == len(t.want) && !t.isOver() && !t.finishing
	if last {
		t.finishing = true
		t.busy.Add(1)
	}
	t.mu.Unlock()
	if last {
		go func() {
			defer t.busy.Done()
			t.end(finish(t.ctx, t.pusher, t.tag, t.sink))
		}()
	}
	return n, nil
}

// end records how the checkpoint ended, once.
func (t *Triggered) end(res *transfer.PushResult, err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.endLocked(res, err)
}

// endLocked is end with t.mu held. The pusher (its open packs and
// encoders) is released once the AddFiles and the finish still using it
// returned.
func (t *Triggered) endLocked(res *transfer.PushResult, err error) {
	if t.isOver() {
		return
	}
	t.res, t.err = res, err
	if !t.at.IsZero() {
		t.took = time.Since(t.at)
	}
	close(t.done)
	// The files still being packed stop at their next read (their
	// uploads are cut by the upload API, which watches Done).
	t.cancel()
	go func() {
		t.busy.Wait()
		t.pmu.Lock()
		defer t.pmu.Unlock()
		if t.pusher != nil {
			t.pusher.Close()
		}
	}()
}

// isOver reports whether the checkpoint ended. t.mu is held.
func (t *Triggered) isOver() bool {
	select {
	case <-t.done:
		return true
	default:
		return false
	}
}

// Done is closed once the checkpoint ended: tagged, failed or closed.
func (t *Triggered) Done() <-chan struct{} { return t.done }

// Wait waits for the checkpoint to end (or ctx) and says how it ended.
func (t *Triggered) Wait(ctx context.Context) (*Result, error) {
	select {
	case <-t.done:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.err != nil {
		return nil, t.err
	}
	return &Result{PushResult: *t.res, Pushed: t.took, Files: t.sink.sizes()}, nil
}

// Triggered checkpoint states, as TriggeredStatus.State reports them.
const (
	StateWaiting = "waiting" // no file has come yet
	StateWriting = "writing" // the workload writes it
	// StateFinishing: every file is in, the index and tag are being pushed.
	StateFinishing = "finishing"
	StatePushed    = "pushed" // the snapshot is tagged
	StateFailed    = "failed"
)

// TriggeredStatus is what a Triggered checkpoint has done so far.
type TriggeredStatus struct {
	State string `json:"state"`
	// Files are the files packed so far, with their sizes.
	Files map[string]int64 `json:"files"`
	// Index is the snapshot index's digest, once pushed; Pushed how long
	// after its first file the snapshot was tagged.
	Index  string  `json:"index,omitempty"`
	Pushed float64 `json:"pushedSeconds,omitempty"`
	Error  string  `json:"error,omitempty"`
}

// Status says where the checkpoint is.
func (t *Triggered) Status() TriggeredStatus {
	t.mu.Lock()
	defer t.mu.Unlock()
	st := TriggeredStatus{State: t.stateLocked(), Files: t.sink.sizes()}
	if t.res != nil {
		st.Index, st.Pushed = t.res.Descriptor.Digest.String(), t.took.Seconds()
	}
	if t.err != nil {
		st.Error = t.err.Error()
	}
	return st
}

func (t *Triggered) stateLocked() string {
	switch {
	case t.isOver() && t.err == nil:
		return StatePushed
	case t.isOver():
		return StateFailed
	case t.finishing:
		return StateFinishing
	case len(t.started) == 0:
		return StateWaiting
	default:
		return StateWriting
	}
}

// Close ends the checkpoint and returns once it ended. One still being
// written fails with ErrClosed and leaves no tag: the files being packed
// stop at their next read. One being finished (every file in, its index
// and tag being pushed) is let finish until ctx is done, and only then
// cancelled, so that its state says what it did: a snapshot tagged is
// reported pushed. (Cancelled while its tag is being pushed, it may be
// tagged and yet reported failed: the registry took the tag but its
// answer was not waited for.)
func (t *Triggered) Close(ctx context.Context) {
	if t.TryClose() {
		return
	}
	select {
	case <-t.done:
	case <-ctx.Done():
	}
	t.cancel()
	<-t.done
}

// CloseIfWaiting ends the checkpoint as Close does if no file has come to
// it yet, and reports whether it did: a daemon that stops keeps such a
// session for the next one.
func (t *Triggered) CloseIfWaiting() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.started) > 0 || t.isOver() {
		return false
	}
	t.endLocked(nil, ErrClosed)
	return true
}

// TryClose ends the checkpoint as Close does unless it is being finished,
// and reports whether it ended it (or it had ended): false means its
// index and tag are being pushed, and it was left alone.
func (t *Triggered) TryClose() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.finishing && !t.isOver() {
		return false
	}
	t.endLocked(nil, ErrClosed)
	return true
}
