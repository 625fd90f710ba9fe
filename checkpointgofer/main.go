// Command checkpointgofer is cryo's gVisor checkpoint gofer: the sidecar
// runsc starts when the image dir of a restore or a checkpoint holds
// gcs_opts.json, and through which the sentry reads checkpoint.img,
// pages_meta.img and pages.img straight into the sandbox's memory (or
// writes them, to the cryo checkpoint that started runsc), or a
// filesystem checkpoint's fscheckpoint.pb, multitar.img, pages_meta.img
// and pages.img (runsc fscheckpoint, runsc create
// --fs-restore-image-path). For a restore it serves the snapshot
// its gcs_opts.json names (cryo's gofer.Config) from a cryo process on
// the node (the puller daemon, or the `cryo restore` that started runsc)
// over that process's file API; or, with no socket in the config, from a
// puller of its own.
//
// It is a module of its own, built from the same gVisor version as runsc
// (the wire protocol is gVisor's and internal), so that gVisor stays out
// of cryo's go.mod. Install it in a dir of its own and point runsc at it
// with GVISOR_SIDECAR_BINARIES_DIR; never as gvisor-bin/checkpointgofer
// beside runsc, where it would replace gVisor's own gofer for every
// sandbox.
//
// runsc runs it as
//
//	runsc-checkpointgofer [runsc global flags] checkpointgofer -sock-fd=3 -gcs-opts-fd=4 -allow-checkpoint-reads
//
// (or one of -allow-checkpoint-writes, -allow-fscheckpoint-reads and
// -allow-fscheckpoint-writes instead) with /dev/null for stdio and GVISOR_ENFORCE_RELEASE set. It refuses to
// serve a runsc of another gVisor release, whatever that variable's
// policy says. `checkpointgofer --version` prints the release it was
// built from.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/puller/gofer"
	"golang.org/x/sys/unix"
	"gvisor.dev/gvisor/pkg/sentry/state/stateipc"
	"gvisor.dev/gvisor/pkg/unet"
	"gvisor.dev/gvisor/pkg/urpc"
	"gvisor.dev/gvisor/runsc/version"
)

func main() {
	if len(os.Args) == 2 && (os.Args[1] == "--version" || os.Args[1] == "-version") {
		fmt.Printf("cryo checkpointgofer, gVisor release %s\n", version.Version())
		return
	}
	if err := run(context.Background(), os.Args[1:]); err != nil {
		// stderr is /dev/null under runsc: run has logged it where it can.
		fmt.Fprintln(os.Stderr, "checkpointgofer:", err)
		os.Exit(1)
	}
}

// flags are the gofer's own flags, after the "checkpointgofer" argument.
type flags struct {
	sockFD, optsFD                        int
	checkpointReads, checkpointWrites     bool
	fsCheckpointReads, fsCheckpointWrites bool
	// logFD is runsc's --log-fd, if it passed one.
	logFD int
}

// parseArgs splits runsc's global flags (ignored, but for --log-fd) from
// the gofer's own.
func parseArgs(args []string) (flags, error) {
	f := flags{sockFD: -1, optsFD: -1, logFD: -1}
	i := 0
	for ; i < len(args) && args[i] != "checkpointgofer"; i++ {
		if v, ok := strings.CutPrefix(strings.TrimLeft(args[i], "-"), "log-fd="); ok {
			if n, err := strconv.Atoi(v); err == nil {
				f.logFD = n
			}
		}
	}
	if i == len(args) {
		return f, fmt.Errorf("no checkpointgofer subcommand in %q (runsc starts this binary; see --version)", args)
	}
	fs := flag.NewFlagSet("checkpointgofer", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.IntVar(&f.sockFD, "sock-fd", -1, "")
	fs.IntVar(&f.optsFD, "gcs-opts-fd", -1, "")
	fs.BoolVar(&f.checkpointReads, "allow-checkpoint-reads", false, "")
	fs.BoolVar(&f.checkpointWrites, "allow-checkpoint-writes", false, "")
	fs.BoolVar(&f.fsCheckpointReads, "allow-fscheckpoint-reads", false, "")
	fs.BoolVar(&f.fsCheckpointWrites, "allow-fscheckpoint-writes", false, "")
	if err := fs.Parse(args[i+1:]); err != nil {
		return f, fmt.Errorf("checkpointgofer flags: %w", err)
	}
	if f.sockFD < 0 || f.optsFD < 0 {
		return f, fmt.Errorf("checkpointgofer needs -sock-fd and -gcs-opts-fd")
	}
	return f, nil
}

// checkRelease refuses a runsc of another gVisor release. runsc sets
// GVISOR_ENFORCE_RELEASE to its own label, or by default to "SKIP:label",
// under which gVisor's own sidecars only log a mismatch; the wire protocol
// is internal to one release, so this gofer refuses either way.
func checkRelease(env string) error {
	want := env
	for _, p := range []string{"TESTONLY_SKIP", "SKIP"} {
		if env == p {
			want = ""
			break
		}
		if v, ok := strings.CutPrefix(env, p+":"); ok {
			want = v
			break
		}
	}
	if want == "" {
		return fmt.Errorf("GVISOR_ENFORCE_RELEASE=%q names no release: cannot check that runsc is of this gofer's release %q (runsc sets it; was the gofer started by hand?)", env, version.Version())
	}
	if want != version.Version() {
		return fmt.Errorf("runsc is gVisor release %q, this checkpoint gofer was built from %q: the gofer protocol is internal to one release; rebuild the gofer (make gofer) from runsc's release", want, version.Version())
	}
	return nil
}

func run(ctx context.Context, args []string) error {
	// The gofer maps the sandbox's memory: no core dump of it.
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
		return fmt.Errorf("prctl(PR_SET_DUMPABLE): %w", err)
	}
	f, err := parseArgs(args)
	if err != nil {
		return err
	}
	logOut := io.Writer(os.Stderr)
	if f.logFD >= 0 {
		logOut = os.NewFile(uintptr(f.logFD), "runsc-log")
	}
	log := slog.New(slog.NewTextHandler(logOut, nil)).With("component", "cryo-checkpointgofer")
	cfg, err := gofer.ReadConfig(os.NewFile(uintptr(f.optsFD), gofer.ConfigFile))
	if err != nil {
		log.Error("config", "err", err)
		return err
	}
	if cfg.Log != "" {
		lf, err := os.OpenFile(cfg.Log, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
		if err != nil {
			log.Error("log file", "err", err)
			return err
		}
		defer lf.Close()
		log = slog.New(slog.NewTextHandler(io.MultiWriter(logOut, lf), nil)).With("component", "cryo-checkpointgofer", "snapshot", cfg.Index)
	}
	if err := checkRelease(os.Getenv("GVISOR_ENFORCE_RELEASE")); err != nil {
		log.Error("release check", "err", err)
		return err
	}
	image, err := f.image()
	if err != nil {
		log.Error("mode", "err", err)
		return err
	}
	impl := &server{ctx: ctx, log: log, bufs: newBufPool(), image: image}
	modeErr := checkMode(cfg, image)
	switch {
	case modeErr != nil:
		log.Error("mode", "err", modeErr)
		return modeErr
	case image.writes():
		c := gofer.NewClient(cfg.Socket, cfg.Mount, "", 0)
		defer c.Close()
		impl.uploads = c
	default:
		src, closeSrc, err := openSource(ctx, cfg, log)
		if err != nil {
			log.Error("snapshot source", "err", err)
			return err
		}
		defer closeSrc()
		if impl.sizes, err = statFiles(ctx, src, image); err != nil {
			log.Error("snapshot source", "err", err)
			return err
		}
		impl.src, impl.allowReads = src, true
		impl.sizeReads(src)
		maxRead, parallel := pagesReads(impl.rtt)
		log.Info("link", "round trip", impl.rtt, "pages.img max read", maxRead, "parallel", parallel)
	}

	sock, err := unet.NewSocket(f.sockFD)
	if err != nil {
		return fmt.Errorf("gofer socket: %w", err)
	}
	afs, err := stateipc.NewAsyncFileServer(impl)
	if err != nil {
		return err
	}
	srv := urpc.NewServer()
	srv.Register(afs)
	start := time.Now()
	log.Info("serving", "reference", cfg.Reference, "socket", cfg.Socket, "mount", cfg.Mount)
	// Handle returns when runsc's sentry closes its end: the restore is
	// over (every page loaded) or failed.
	err = srv.Handle(sock)
	srv.Stop(0)
	log.Info("done", "after", time.Since(start), "bytes", impl.served.Load(), "reads", impl.reads.Load(), "faults", impl.faults.Load(), "written", impl.written.Load(), "end", err)
	return nil
}

// imageMode is what runsc started the gofer for, from its one -allow flag.
type imageMode int

const (
	restoreMode imageMode = iota
	checkpointMode
	fsRestoreMode
	fsCheckpointMode
)

// image returns what runsc asks for: exactly one of the four -allow
// flags (runsc passes one per gofer it starts).
func (f flags) image() (imageMode, error) {
	var modes []imageMode
	for _, m := range []struct {
		set  bool
		mode imageMode
	}{{f.checkpointReads, restoreMode}, {f.checkpointWrites, checkpointMode}, {f.fsCheckpointReads, fsRestoreMode}, {f.fsCheckpointWrites, fsCheckpointMode}} {
		if m.set {
			modes = append(modes, m.mode)
		}
	}
	if len(modes) != 1 {
		return 0, fmt.Errorf("runsc passed %d of -allow-checkpoint-reads, -allow-checkpoint-writes, -allow-fscheckpoint-reads and -allow-fscheckpoint-writes, want one", len(modes))
	}
	return modes[0], nil
}

// writes reports whether the sentry writes an image (a checkpoint).
func (m imageMode) writes() bool { return m == checkpointMode || m == fsCheckpointMode }

// filesystem reports whether m is for a filesystem checkpoint's image.
func (m imageMode) filesystem() bool { return m == fsRestoreMode || m == fsCheckpointMode }

// files returns the files of m's kind of image, the only ones the gofer
// serves or takes.
func (m imageMode) files() []string { return format.ImageFiles(m.filesystem()) }

// kind names m's kind of image.
func (m imageMode) kind() string {
	if m.filesystem() {
		return "filesystem checkpoint"
	}
	return "checkpoint"
}

// String names m for errors and logs.
func (m imageMode) String() string {
	return [...]string{"restore", "checkpoint", "filesystem restore", "filesystem checkpoint"}[m]
}

// checkMode checks that the image dir's config is for what runsc asks:
// a checkpoint's config for writes (of the kind it names), a snapshot's
// for reads.
func checkMode(cfg gofer.Config, image imageMode) error {
	want := "restore"
	switch {
	case cfg.Checkpoint && cfg.Filesystem:
		want = "filesystem checkpoint"
	case cfg.Checkpoint:
		want = "checkpoint"
	}
	if cfg.Checkpoint != image.writes() || (image.writes() && cfg.Filesystem != image.filesystem()) {
		return fmt.Errorf("runsc asks for a %s, the image dir's %s is for a %s", image, gofer.ConfigFile, want)
	}
	return nil
}

// openSource returns where the snapshot's bytes come from: the file API
// of the cryo process the config names, checked to serve the config's
// snapshot, or a puller of the gofer's own.
func openSource(ctx context.Context, cfg gofer.Config, log *slog.Logger) (gofer.Source, func(), error) {
	if cfg.Socket == "" {
		return openStandalone(ctx, cfg, log)
	}
	c := gofer.NewClient(cfg.Socket, cfg.Mount, cfg.Index, 0)
	c.Logf = func(format string, args ...any) { log.Warn(fmt.Sprintf(format, args...)) }
	// The gofer runs as root on the node, as cryo does: it may read
	// ranges of the node store's files in place.
	c.InPlace = true
	return c, func() {
		log.Info("read in place", "bytes", c.PlacedBytes())
		c.Close()
	}, nil
}

// statFiles asks the source for the sizes of the files of m's image
// before anything is served. The sentry reads an error opening a
// checkpoint's pages_meta.img as "this checkpoint has no pages file": so
// any error but a missing pages file (a mount gone, another snapshot, the
// deadline passed) stops the gofer here, and the restore fails saying so,
// instead of restoring without memory. A filesystem restore opens all
// four of its files: each must be there.
func statFiles(ctx context.Context, src gofer.Source, m imageMode) (map[string]int64, error) {
	sizes := map[string]int64{}
	pagesOptional := m == restoreMode
	for _, path := range m.files() {
		n, err := src.Size(ctx, path)
		if errors.Is(err, os.ErrNotExist) && pagesOptional && path != format.CheckpointFile {
			continue
		}
		if errors.Is(err, os.ErrNotExist) && path == m.files()[0] {
			return nil, fmt.Errorf("the snapshot has no %s: it is no %s, whose image holds %s", path, m.kind(), strings.Join(m.files(), ", "))
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		sizes[path] = n
	}
	_, meta := sizes["pages_meta.img"]
	_, pages := sizes["pages.img"]
	if meta != pages {
		return nil, fmt.Errorf("the snapshot has one of pages_meta.img and pages.img without the other")
	}
	return sizes, nil
}
