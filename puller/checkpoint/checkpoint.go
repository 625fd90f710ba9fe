// Package checkpoint checkpoints a running gVisor sandbox straight into a
// registry: it runs
//
//	runsc [RunscFlags] checkpoint --image-path=DIR --compression=none [--leave-running] CONTAINER
//
// on an image dir that holds only cryo's gcs_opts.json, so that runsc
// starts cryo's checkpoint gofer, which streams checkpoint.img,
// pages_meta.img and pages.img, as the sentry writes them, to this
// process; here they are chunked, hashed, deduplicated against the
// registry's chunk index and pushed while the sentry still writes (a
// transfer.Pusher). No copy of pages.img touches the local disk. The
// snapshot is tagged only once runsc checkpoint succeeded and every blob
// and manifest is in the registry: an interrupted checkpoint leaves no
// tag. It is what `cryo checkpoint` runs.
//
// With Options.Filesystem it runs
//
//	runsc [RunscFlags] fscheckpoint --image-path=DIR [--leave-running] [--path=P]... CONTAINER
//
// instead: a filesystem checkpoint (the sandbox's overlay upper layers:
// fscheckpoint.pb, multitar.img, pages_meta.img, pages.img), which
// `runsc create --fs-restore-image-path` restores into a new sandbox.
package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/puller/gofer"
	"github.com/cryo-oci/cryo/puller/restore"
	"github.com/cryo-oci/cryo/transfer"
	"oras.land/oras-go/v2/registry/remote"
)

// Options configure a Checkpoint.
type Options struct {
	// Runsc is the runsc binary (default "runsc"); RunscFlags its global
	// flags, e.g. --root=/run/runsc.
	Runsc      string
	RunscFlags []string
	// ContainerID is the container to checkpoint (required).
	ContainerID string
	// LeaveRunning keeps the sandbox running after the checkpoint
	// (runsc checkpoint --leave-running).
	LeaveRunning bool
	// Filesystem takes a filesystem checkpoint (runsc fscheckpoint)
	// instead of a checkpoint of the whole sandbox.
	Filesystem bool
	// Paths are, for a filesystem checkpoint, the mount points inside the
	// sandbox whose upper layers it saves (runsc fscheckpoint --path;
	// runsc's default, "/", if none).
	Paths []string
	// GoferDir holds cryo's checkpointgofer, of the local runsc's gVisor
	// release (required).
	GoferDir string
	// GoferLog, if set, is a file the gofer appends its log to.
	GoferLog string
	// Repo and Tag are where the snapshot goes; Push tunes the packing.
	Repo *remote.Repository
	Tag  string
	Push transfer.PushOptions
	// Stderr gets runsc's stderr (nil: discarded).
	Stderr io.Writer
}

// Result says what a Checkpoint did.
type Result struct {
	transfer.PushResult
	// Checkpointed is when runsc checkpoint returned (every file written
	// and packed); Pushed when the snapshot was tagged, both since the
	// start.
	Checkpointed, Pushed time.Duration
	// Files are the sizes of the files the sentry wrote.
	Files map[string]int64
	// Command is the runsc command run: checkpoint or fscheckpoint.
	Command string
}

// finishTries is how many times the index and tag are pushed (1 s, 2 s,
// 4 s, ... apart) before the checkpoint fails.
const finishTries = 5

// sessionID is the id the upload API serves the one checkpoint under.
const sessionID = "checkpoint"

// Checkpoint checkpoints opts.ContainerID into opts.Repo and tags the
// snapshot opts.Tag.
func Checkpoint(ctx context.Context, opts Options) (*Result, error) {
	start := time.Now()
	if opts.ContainerID == "" || opts.Repo == nil || opts.Tag == "" {
		return nil, errors.New("checkpoint: a container, a repository and a tag are needed")
	}
	if len(opts.Paths) > 0 && !opts.Filesystem {
		return nil, errors.New("checkpoint: paths are for a filesystem checkpoint")
	}
	if opts.Runsc == "" {
		opts.Runsc = "runsc"
	}
	runscRelease, err := restore.RunscVersion(ctx, opts.Runsc)
	if err != nil {
		return nil, err
	}
	if err := gofer.Check(ctx, opts.GoferDir, runscRelease); err != nil {
		return nil, err
	}
	pusher, err := transfer.NewPusher(ctx, opts.Repo, opts.Tag, opts.Push)
	if err != nil {
		return nil, err
	}
	defer pusher.Close()
	sink := &countingSink{sink: pusher, files: map[string]int64{}}

	mux := http.NewServeMux()
	gofer.RegisterUploads(mux, func(id string) (gofer.Sink, bool) { return sink, id == sessionID })
	session, err := gofer.StartSession(opts.GoferDir, opts.Runsc, mux)
	if err != nil {
		return nil, err
	}
	defer session.Close()
	img := filepath.Join(session.Dir, "img")
	ref := opts.Repo.Reference
	ref.Reference = opts.Tag
	if err := gofer.WriteImageDir(img, gofer.Config{MediaType: gofer.MediaType, Reference: ref.String(), Checkpoint: true, Filesystem: opts.Filesystem, Socket: session.Socket, Mount: sessionID, Log: opts.GoferLog}); err != nil {
		return nil, err
	}
	command, first, cmdFlags := "checkpoint", format.CheckpointFile, []string{"--compression=none"}
	if opts.Filesystem {
		// fscheckpoint writes its files uncompressed: it has no
		// --compression.
		command, first, cmdFlags = "fscheckpoint", format.FSManifestFile, nil
		for _, p := range opts.Paths {
			cmdFlags = append(cmdFlags, "--path="+p)
		}
	}
	args := append(append(append([]string{}, opts.RunscFlags...), command, "--image-path="+img), cmdFlags...)
	if opts.LeaveRunning {
		args = append(args, "--leave-running")
	}
	cmd := exec.CommandContext(ctx, opts.Runsc, append(args, opts.ContainerID)...)
	cmd.Env = append(os.Environ(), session.Env())
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if opts.Stderr != nil {
		cmd.Stderr = io.MultiWriter(&stderr, opts.Stderr)
	}
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("runsc %s: %w: %s%s", command, err, strings.TrimSpace(stderr.String()), sink.failures())
	}
	checkpointed := time.Since(start)
	// runsc checkpoint returns once the sentry finalized every file, which
	// the gofer does only after this process packed it.
	files := sink.sizes()
	if _, ok := files[first]; !ok {
		return nil, fmt.Errorf("runsc %s succeeded, but no %s reached cryo (is %s cryo's gofer?)%s", command, first, opts.GoferDir, sink.failures())
	}
	// Without --leave-running the sandbox is gone by now: the snapshot is
	// all that is left of it, so a registry hiccup here is retried.
	res, err := finish(ctx, pusher, opts.Tag, sink)
	if err != nil {
		return nil, err
	}
	return &Result{PushResult: *res, Checkpointed: checkpointed, Pushed: time.Since(start), Files: files, Command: command}, nil
}

// finish pushes the snapshot index and its tag, trying a registry
// hiccup finishTries times: by now the sandbox may be gone, and the
// snapshot all that is left of it.
func finish(ctx context.Context, pusher *transfer.Pusher, tag string, sink *countingSink) (*transfer.PushResult, error) {
	var (
		res *transfer.PushResult
		err error
	)
	try := 1
	for wait := time.Second; ; try, wait = try+1, 2*wait {
		res, err = pusher.Finish(ctx, tag)
		if err == nil || errors.Is(err, format.ErrInvalid) || try == finishTries || ctx.Err() != nil {
			break
		}
		select {
		case <-time.After(wait):
		case <-ctx.Done():
		}
	}
	if errors.Is(err, format.ErrInvalid) {
		return nil, fmt.Errorf("the snapshot cannot be finished: %w%s", err, sink.failures())
	}
	if err != nil {
		return nil, fmt.Errorf("every file is in the registry, but the snapshot index or its tag is not (%d tries): %w", try, err)
	}
	return res, nil
}

// countingSink records the files a sink took, and why others failed.
type countingSink struct {
	sink gofer.Sink

	mu    sync.Mutex
	files map[string]int64
	errs  []error
}

func (s *countingSink) AddFile(ctx context.Context, path string, mode fs.FileMode, r io.Reader) (int64, error) {
	n, err := s.sink.AddFile(ctx, path, mode, r)
	s.mu.Lock()
	defer s.mu.Unlock()
	if err != nil {
		s.errs = append(s.errs, err)
	} else {
		s.files[path] = n
	}
	return n, err
}

func (s *countingSink) sizes() map[string]int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]int64, len(s.files))
	for k, v := range s.files {
		out[k] = v
	}
	return out
}

// failures says why files failed to pack, for an error message.
func (s *countingSink) failures() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.errs) == 0 {
		return ""
	}
	return "; packing failed: " + errors.Join(s.errs...).Error()
}
