// Package restore restores a gVisor sandbox straight from a snapshot: it
// checks that the local runsc can restore the snapshot (runsc restores only
// its own version's checkpoints), makes the snapshot's image dir (the
// node's materialized copy of it, or a puller mount), runs
//
//	runsc [RunscFlags] restore --detach --background --image-path=DIR [RestoreFlags] ID
//
// and keeps the mount until `runsc wait --restore` says every page is
// loaded and the snapshot is materialized in the node cache for later
// restores, then unmounts. It is what `cryo restore` runs; a sandbox
// manager that embeds cryo, or a test, calls it the same way.
package restore

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/puller"
	"github.com/cryo-oci/cryo/puller/gofer"
	"github.com/cryo-oci/cryo/puller/profile"
	"github.com/opencontainers/go-digest"
)

// Options configure a Restore.
type Options struct {
	// Runsc is the runsc binary (default "runsc", looked up in $PATH).
	Runsc string
	// RunscFlags are global runsc flags, given to every runsc command
	// before its subcommand, e.g. --root=/run/runsc.
	RunscFlags []string
	// RunscVersion is the local runsc's version, as RunscVersion returns
	// it. Empty: Restore asks Runsc while it reads the snapshot's index.
	// Asking ahead (while the snapshot resolves, or once for many
	// restores) saves the tens of milliseconds `runsc --version` takes.
	RunscVersion string
	// ContainerID is the container to restore (required).
	ContainerID string
	// RestoreFlags are runsc restore flags (e.g. --bundle=DIR), given
	// after Restore's own and before ContainerID.
	RestoreFlags []string
	// MountDir is where a snapshot that is not materialized on the node
	// is mounted (default: <cache dir>/mounts/<ContainerID>). Restore
	// removes it when it unmounts.
	MountDir string
	// Name names the snapshot in errors, e.g. the reference it was
	// resolved from (default: its index digest).
	Name string
	// Start is when the restore began, for the durations reported
	// (default: when Restore is called). A caller that resolves the
	// snapshot first sets it to count that in.
	Start time.Time
	// Stdin, Stdout and Stderr are runsc restore's, which the restored
	// container inherits and keeps (nil: /dev/null). runsc wait's stderr
	// goes to Stderr too. An *os.File is handed over as it is; anything
	// else is connected through a pipe, copied by a goroutine for as long
	// as the container holds the pipe's other end, after Restore returns.
	Stdin          io.Reader
	Stdout, Stderr io.Writer
	// Progress, if set, is called at each step of the restore, in order,
	// on Restore's goroutine.
	Progress func(Event)
	// Backend is how runsc reads a snapshot the node has not materialized:
	// BackendFUSE (a lazy FUSE mount), BackendGofer (cryo's checkpoint
	// gofer reads it into the sandbox's memory: no FUSE, no image dir on
	// disk) or BackendAuto (the default: the gofer when GoferDir holds one
	// of the local runsc's gVisor release, else FUSE).
	Backend Backend
	// GoferDir holds cryo's checkpointgofer binary; runsc finds it there
	// through GVISOR_SIDECAR_BINARIES_DIR. Never gVisor's own gvisor-bin
	// dir beside runsc: there it would replace gVisor's gofer for every
	// sandbox.
	GoferDir string
	// GoferCheck, if set, must be gofer.StartCheck's answer for GoferDir,
	// started by the caller as early as it could (the check runs the
	// gofer binary, tens of ms that can overlap resolving the snapshot).
	// Nil: Restore starts the check itself. Unused with BackendFUSE.
	GoferCheck func(runsc string) error
	// GoferLog, if set, is a file cryo's gofer appends its log to.
	GoferLog string
}

// Backend is how runsc reads a snapshot (Options.Backend).
type Backend string

// Backends.
const (
	BackendAuto  Backend = "auto"
	BackendFUSE  Backend = "fuse"
	BackendGofer Backend = "gofer"
)

// chooseBackend decides between FUSE and the gofer for a snapshot that
// is not materialized.
// With auto, it also returns why the gofer is not used, if it is not.
// check is gofer.StartCheck's (nil with --backend fuse).
func chooseBackend(opts Options, check func(runsc string) error, runsc string) (b Backend, whyNot, err error) {
	switch opts.Backend {
	case BackendFUSE:
		return BackendFUSE, nil, nil
	case "", BackendAuto, BackendGofer:
	default:
		return "", nil, fmt.Errorf("restore: backend %q: want auto, fuse or gofer", opts.Backend)
	}
	if err := check(runsc); err != nil {
		if opts.Backend == BackendGofer {
			return "", nil, fmt.Errorf("%w; or restore with --backend fuse", err)
		}
		return BackendFUSE, err, nil
	}
	return BackendGofer, nil, nil
}

// Step is a point a restore reaches.
type Step int

const (
	// Ready: the image dir is complete; runsc restore starts.
	Ready Step = iota + 1
	// Restored: runsc restore returned; the container runs while its
	// pages load in the background.
	Restored
	// PagesLoaded: runsc wait --restore returned: the sandbox has every
	// page and reads the image dir no more.
	PagesLoaded
	// Materialized: the mount's background load ended, and the snapshot's
	// materialized dir is written (or not: Event.Err says why, and the
	// restore still succeeds). Not reached when the restore used the
	// materialized dir.
	Materialized
	// Unmounted: the mount was released (Event.Err if the unmount
	// failed; the restore goes on). Reached whenever Restore mounted,
	// also when it fails later.
	Unmounted
)

// String returns the step's name.
func (s Step) String() string {
	switch s {
	case Ready:
		return "ready"
	case Restored:
		return "restored"
	case PagesLoaded:
		return "pages loaded"
	case Materialized:
		return "materialized"
	case Unmounted:
		return "unmounted"
	}
	return fmt.Sprintf("step(%d)", int(s))
}

// Event reports a step of a restore to Options.Progress.
type Event struct {
	Step Step
	// Snapshot and Mode are the restore's (see Result).
	Snapshot digest.Digest
	Mode     string
	// Dir is what the step is about: the image dir runsc restores from
	// (Ready, Restored, PagesLoaded), the materialized dir (Materialized)
	// or the mount dir (Unmounted).
	Dir string
	// After is the time since Options.Start.
	After time.Duration
	// Err is set when materializing (Materialized) or unmounting
	// (Unmounted) failed; the restore itself succeeded.
	Err error
	// GoferUnused, at Ready, is Result.GoferUnused.
	GoferUnused error
	// Profile, at Ready, is Result.ProfileUsed.
	Profile *profile.Info
}

// Result describes a restore that succeeded.
type Result struct {
	// Snapshot is the snapshot's index digest.
	Snapshot digest.Digest
	// Mode is how the image dir was made: "fuse" (a lazy mount, loading
	// from the registry), "gofer" (a dir of gcs_opts.json alone: cryo's
	// checkpoint gofer reads the snapshot into the sandbox), "eager" (pulled whole first: no FUSE on the
	// node) or "materialized" (the node's local copy, no FUSE).
	Mode string
	// Dir is the image dir runsc restored from.
	Dir string
	// Ready, Restored and PagesLoaded are when the steps of those names
	// were reached, since Options.Start.
	Ready, Restored, PagesLoaded time.Duration
	// MaterializedDir is where the node cache keeps the snapshot's
	// materialized dir; Materialized, when a mount finished writing it
	// (0 when the restore used it, or when writing it failed:
	// MaterializeErr says why).
	MaterializedDir string
	Materialized    time.Duration
	MaterializeErr  error
	// GoferUnused says why BackendAuto did not take the checkpoint gofer
	// for a snapshot not materialized (nil if it did, or was not asked).
	GoferUnused error
	// ProfileUsed is the working-set profile fetched first (nil: none).
	ProfileUsed *profile.Info
	// Profile is the working set this restore recorded (nil for a
	// materialized snapshot, which is read locally): the reads the
	// sandbox waited on until every page was loaded (or for
	// puller.Options.RecordFor, longer while the app faults), to publish
	// for the next restores.
	Profile *profile.Profile
}

// VersionError is Restore's refusal of a snapshot checkpointed by another
// runsc version than the local one: runsc would refuse it after the mount.
type VersionError struct {
	// Snapshot names the snapshot (Options.Name).
	Snapshot string
	// Checkpointed is the version that took the checkpoint; Local, the
	// local runsc's.
	Checkpointed, Local string
}

func (e *VersionError) Error() string {
	return fmt.Sprintf("snapshot %s was checkpointed by runsc %q, local runsc is %q: runsc restores only its own version's checkpoints",
		e.Snapshot, e.Checkpointed, e.Local)
}

// Restore restores container opts.ContainerID from the snapshot src with
// runsc, through p.
//
// It first checks, from the snapshot's index alone, that the local runsc
// took the checkpoint, and returns a *VersionError if not: a refused
// snapshot fetches no chunk and runs no runsc restore. Then it uses the
// node cache's materialized copy of the snapshot if there is one (pinned
// until the sandbox has every page), or mounts it with p.Mount at
// opts.MountDir, and runs runsc restore --detach --background on that
// image dir. It returns once runsc wait --restore says every page is
// loaded and, for a mount, the background load has written the
// materialized dir that later restores use without FUSE; the mount is
// released then (or when Restore fails). The restored container keeps
// running.
func Restore(ctx context.Context, p *puller.Puller, src puller.Source, opts Options) (*Result, error) {
	if opts.ContainerID == "" {
		return nil, errors.New("restore: no container ID")
	}
	if opts.Runsc == "" {
		opts.Runsc = "runsc"
	}
	if opts.Name == "" {
		opts.Name = src.Index.Digest.String()
	}
	if opts.Start.IsZero() {
		opts.Start = time.Now()
	}
	mountDir := opts.MountDir
	if mountDir == "" {
		if id := opts.ContainerID; id == "." || id == ".." || strings.ContainsRune(id, filepath.Separator) {
			return nil, fmt.Errorf("restore: container ID %q cannot name a mount dir: set one", id)
		}
		mountDir = filepath.Join(p.Cache().Root(), "mounts", opts.ContainerID)
	}
	// Check before mounting: a refused snapshot fetches no chunk. The
	// gofer's release is asked for meanwhile.
	checkGofer := opts.GoferCheck
	if opts.Backend != BackendFUSE && checkGofer == nil {
		checkGofer = gofer.StartCheck(ctx, opts.GoferDir)
	}
	local, err := checkVersion(ctx, src, opts)
	if err != nil {
		return nil, err
	}

	d := src.Index.Digest
	r := &run{opts: opts, res: Result{Snapshot: d}}
	// Pin, then look: a materialized dir found stays until the sandbox
	// has every page, whatever else the puller loads meanwhile.
	p.Cache().PinImage(d)
	defer p.Cache().UnpinImage(d)
	dir, materialized := p.Materialized(d)
	var m *puller.Mount
	var g *goferMount
	if materialized {
		r.res.Mode = "materialized"
	} else {
		backend, whyNot, err := chooseBackend(opts, checkGofer, local)
		if err != nil {
			return nil, err
		}
		r.res.GoferUnused = whyNot
		if backend == BackendGofer {
			g, err = startGofer(ctx, p, src, mountDir, opts)
			if err != nil {
				return nil, err
			}
			defer r.releaseGofer(g)
			m = g.m
			r.env = append(os.Environ(), g.session.Env())
		} else {
			if m, err = p.Mount(ctx, src, mountDir); err != nil {
				return nil, err
			}
			defer r.release(m)
		}
		dir = m.Dir()
		pr := m.Progress()
		r.res.Mode, r.res.ProfileUsed = pr.Mode, pr.Profile
	}
	r.res.Dir = dir
	r.res.Ready = r.report(Ready, dir, nil)

	if err := r.runscRestore(ctx, dir); err != nil {
		return nil, fmt.Errorf("runsc restore: %w", err)
	}
	r.res.Restored = r.report(Restored, dir, nil)
	if m != nil {
		m.SandboxStarted()
	}
	wc := exec.CommandContext(ctx, opts.Runsc, r.runscArgs("wait", "--restore", opts.ContainerID)...)
	wc.Stderr = opts.Stderr
	if out, err := wc.Output(); err != nil {
		return nil, fmt.Errorf("runsc wait --restore: %w (%s)", err, strings.TrimSpace(string(out)))
	}
	r.res.PagesLoaded = r.report(PagesLoaded, dir, nil)
	if m != nil {
		// The sandbox has every page: it waits on nothing more.
		r.res.Profile = m.Profile()
	}
	if g != nil {
		g.sandboxLoaded()
	}
	r.res.MaterializedDir = p.MaterializedDir(d)
	if m == nil {
		return &r.res, nil
	}
	// Every chunk runsc read is in the node cache; the background load
	// writes the materialized copy that later restores use without FUSE.
	// Unmounting before it is done would lose it.
	select {
	case <-m.Loaded():
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	if err := m.Err(); err != nil {
		r.res.MaterializeErr = err
		r.report(Materialized, r.res.MaterializedDir, err)
	} else {
		r.res.Materialized = r.report(Materialized, r.res.MaterializedDir, nil)
	}
	return &r.res, nil
}

// run is one Restore's state.
type run struct {
	opts Options
	res  Result
	// env is runsc restore's environment (nil: cryo's).
	env []string
}

// report tells Options.Progress of a step and returns its time.
func (r *run) report(step Step, dir string, err error) time.Duration {
	after := time.Since(r.opts.Start)
	if r.opts.Progress != nil {
		ev := Event{Step: step, Snapshot: r.res.Snapshot, Mode: r.res.Mode, Dir: dir, After: after, Err: err}
		if step == Ready {
			ev.GoferUnused, ev.Profile = r.res.GoferUnused, r.res.ProfileUsed
		}
		r.opts.Progress(ev)
	}
	return after
}

// runscArgs are the global flags followed by args.
func (r *run) runscArgs(args ...string) []string {
	return append(append([]string{}, r.opts.RunscFlags...), args...)
}

// runscRestore runs runsc restore on the image dir, with the container's
// stdio.
func (r *run) runscRestore(ctx context.Context, dir string) error {
	args := append(r.runscArgs("restore", "--detach", "--background", "--image-path="+dir), r.opts.RestoreFlags...)
	rc := exec.CommandContext(ctx, r.opts.Runsc, append(args, r.opts.ContainerID)...)
	rc.Env = r.env
	var s stdio
	var err error
	if rc.Stdin, err = s.in(r.opts.Stdin); err != nil {
		return err
	}
	if rc.Stdout, err = s.out(r.opts.Stdout); err != nil {
		s.started(false)
		return err
	}
	if rc.Stderr, err = s.out(r.opts.Stderr); err != nil {
		s.started(false)
		return err
	}
	err = rc.Start()
	s.started(err == nil)
	if err != nil {
		return err
	}
	return rc.Wait()
}

// release unmounts a restore's mount and removes its mount point.
//
// The restored sandbox's processes live in mount namespaces created while
// the mount existed, and may keep a copy of it for the container's life
// (runsc's gofer does when the container's root is a bind of a tree that
// holds the mount point). Mount.Unmount detaches lazily, so it does not
// wait for them: the sandbox has every page and reads the image dir no
// more; the FUSE connection ends when the last copy goes, or when this
// process exits and /dev/fuse closes.
func (r *run) release(m *puller.Mount) {
	err := m.Unmount()
	os.Remove(m.Dir())
	r.report(Unmounted, m.Dir(), err)
}

// stdio connects runsc restore to the container's standard streams. An
// *os.File goes as it is: runsc, then the container, inherit it. Another
// reader or writer is connected through a pipe whose other end a goroutine
// copies from or to until the container closes its end, long after runsc
// restore exits. (exec.Cmd's own copying would keep runsc restore's Wait
// waiting until the container exits.)
type stdio struct {
	pipes  []pipe
	copies []func()
}

// pipe is a pipe of stdio: the end runsc gets and the end copied here.
type pipe struct{ child, parent *os.File }

// in returns runsc restore's stdin for r.
func (s *stdio) in(r io.Reader) (io.Reader, error) {
	if r == nil {
		return nil, nil
	}
	if f, ok := r.(*os.File); ok {
		if f == nil {
			return nil, nil
		}
		return f, nil
	}
	pr, pw, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("stdin pipe: %w", err)
	}
	s.pipes = append(s.pipes, pipe{child: pr, parent: pw})
	s.copies = append(s.copies, func() { io.Copy(pw, r); pw.Close() })
	return pr, nil
}

// out returns runsc restore's stdout or stderr for w.
func (s *stdio) out(w io.Writer) (io.Writer, error) {
	if w == nil {
		return nil, nil
	}
	if f, ok := w.(*os.File); ok {
		if f == nil {
			return nil, nil
		}
		return f, nil
	}
	pr, pw, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("output pipe: %w", err)
	}
	s.pipes = append(s.pipes, pipe{child: pw, parent: pr})
	s.copies = append(s.copies, func() { io.Copy(w, pr); pr.Close() })
	return pw, nil
}

// started closes the children's pipe ends here once runsc restore started
// with them, and starts the copies; or, if it did not start, closes every
// end.
func (s *stdio) started(ok bool) {
	for _, p := range s.pipes {
		p.child.Close()
		if !ok {
			p.parent.Close()
		}
	}
	if ok {
		for _, c := range s.copies {
			go c()
		}
	}
}

// RunscVersion returns the version runsc reports (`runsc --version` prints
// "runsc version X" first): the version its checkpoints record, and the
// only one it restores.
func RunscVersion(ctx context.Context, runsc string) (string, error) {
	return gofer.VersionLine(ctx, runsc, "runsc version ")
}

// checkVersion refuses a snapshot whose checkpoint was taken by another
// runsc version than the local one, asking runsc for it (unless
// opts.RunscVersion says) while it reads the snapshot's index, and only
// that.
func checkVersion(ctx context.Context, src puller.Source, opts Options) (string, error) {
	type version struct {
		v   string
		err error
	}
	local := opts.RunscVersion
	var vc chan version
	if local == "" {
		vc = make(chan version, 1)
		go func() { v, err := RunscVersion(ctx, opts.Runsc); vc <- version{v, err} }()
	}
	snap, err := format.LoadSnapshot(ctx, puller.Failover(src.Endpoints), src.Index)
	if vc != nil {
		lv := <-vc
		if lv.err != nil {
			return "", lv.err
		}
		local = lv.v
	}
	if err != nil {
		return "", fmt.Errorf("snapshot %s: %w", opts.Name, err)
	}
	if snap.File(format.CheckpointFile) == nil && snap.File(format.FSManifestFile) != nil {
		return "", fmt.Errorf("snapshot %s is a filesystem checkpoint (runsc fscheckpoint), which runsc restore cannot restore: mount it (cryo mount REF DIR, --backend gofer for no FUSE) and create the new sandbox with runsc create --fs-restore-image-path=DIR", opts.Name)
	}
	if v := snap.RunscVersion(); v != "" && v != local {
		return "", &VersionError{Snapshot: opts.Name, Checkpointed: v, Local: local}
	}
	return local, nil
}
