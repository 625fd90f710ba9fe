// Package gofer is the node side of cryo's gVisor checkpoint gofer, the
// sidecar runsc starts when an image dir holds gcs_opts.json, through
// which the sentry reads checkpoint.img, pages_meta.img and pages.img
// straight into the sandbox's memory: no FUSE mount, no image dir on disk.
//
// The gofer binary (module checkpointgofer, built from the same gVisor
// version as runsc) is thin: it asks a cryo process on the node (the
// puller daemon, or the `cryo restore` that started runsc) for verified
// byte ranges over a unix socket, so that the node keeps one cache, one
// fetch scheduler and one set of credentials. This package holds what
// both sides share and none of gVisor:
//
//   - Config, the gcs_opts.json cryo writes (WriteImageDir) and the gofer
//     reads (ReadConfig);
//   - RegisterFiles, the HTTP file API a cryo process serves for its
//     mounts, and Client, which the gofer reads it with.
//
// The gofer tells the sentry's page-fault reads from its background sweep
// with profile.Classifier.
package gofer

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/cryo-oci/cryo/internal/atomicfile"
	"github.com/opencontainers/go-digest"
)

// Binary is the file name of cryo's checkpoint gofer in its dir, the name
// runsc looks for in GVISOR_SIDECAR_BINARIES_DIR.
const Binary = "checkpointgofer"

// Release returns the gVisor release the gofer binary at path was built
// from (`checkpointgofer --version`): it serves only a runsc of that
// release.
func Release(ctx context.Context, path string) (string, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return "", err
	}
	if !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0 {
		return "", fmt.Errorf("%s is not an executable file", path)
	}
	v, err := VersionLine(ctx, path, "cryo checkpointgofer, gVisor release ")
	if err != nil {
		return "", fmt.Errorf("%w: not cryo's checkpoint gofer", err)
	}
	return v, nil
}

// VersionLine runs `bin --version` and returns what follows prefix on the
// first line it prints: runsc prints "runsc version X", cryo's gofer
// "cryo checkpointgofer, gVisor release X".
func VersionLine(ctx context.Context, bin, prefix string) (string, error) {
	out, err := exec.CommandContext(ctx, bin, "--version").Output()
	if err != nil {
		return "", fmt.Errorf("%s --version: %w", bin, err)
	}
	first, _, _ := strings.Cut(string(out), "\n")
	v, ok := strings.CutPrefix(strings.TrimSpace(first), prefix)
	if !ok || strings.TrimSpace(v) == "" {
		return "", fmt.Errorf("%s --version printed %q", bin, first)
	}
	return strings.TrimSpace(v), nil
}

// BinaryError says why the gofer in a dir cannot serve the local runsc.
type BinaryError struct {
	// Path is the gofer binary looked for.
	Path string
	// Release is the gofer's gVisor release (empty if it has none), Runsc
	// the local runsc's.
	Release, Runsc string
	// Err says what is wrong, if not the release.
	Err error
}

func (e *BinaryError) Error() string {
	if e.Err == nil {
		return fmt.Sprintf("checkpoint gofer %s is gVisor release %q, runsc is %q: the gofer protocol is internal to one release (rebuild the gofer with make gofer)", e.Path, e.Release, e.Runsc)
	}
	return fmt.Sprintf("checkpoint gofer %s: %v (build it with make gofer)", e.Path, e.Err)
}

func (e *BinaryError) Unwrap() error { return e.Err }

// Check returns a *BinaryError unless dir holds a gofer of runsc's gVisor
// release (runsc is what `runsc --version` names).
func Check(ctx context.Context, dir, runsc string) error {
	return StartCheck(ctx, dir)(runsc)
}

// StartCheck starts Check's look at the gofer in dir (its `--version`)
// and returns the rest of Check, which waits for it: a restore runs it
// while runsc reports its own release.
func StartCheck(ctx context.Context, dir string) func(runsc string) error {
	if dir == "" {
		return func(runsc string) error {
			return &BinaryError{Path: Binary, Runsc: runsc, Err: fmt.Errorf("no gofer dir given")}
		}
	}
	path := filepath.Join(dir, Binary)
	type release struct {
		v   string
		err error
	}
	c := make(chan release, 1)
	go func() { v, err := Release(ctx, path); c <- release{v, err} }()
	return func(runsc string) error {
		rel := <-c
		c <- rel // a second call sees the same answer
		if rel.err != nil {
			return &BinaryError{Path: path, Runsc: runsc, Err: rel.err}
		}
		if rel.v != runsc {
			return &BinaryError{Path: path, Release: rel.v, Runsc: runsc}
		}
		return nil
	}
}

// ConfigFile is the file whose presence in an image dir makes runsc start
// the checkpoint gofer (runsc/sandbox/sandbox.go,
// checkpointGCSOptsFileName); runsc hands it to the gofer unread.
const ConfigFile = "gcs_opts.json"

// MediaType marks a ConfigFile as cryo's. gVisor's own gofer reads a file
// of the same name with other fields; cryo's gofer refuses anything not
// marked so.
const MediaType = "application/vnd.cryo.gofer.v1+json"

// MaxConfigSize bounds a ConfigFile.
const MaxConfigSize = 64 << 10

// Config is the content of ConfigFile: which snapshot the gofer serves and
// where it gets its bytes. It carries no credentials: a standalone gofer
// uses the node's.
type Config struct {
	// MediaType is MediaType.
	MediaType string `json:"mediaType"`
	// Reference names the snapshot (host/repo:tag or @digest), for logs and
	// for a standalone gofer to resolve.
	Reference string `json:"reference"`
	// Index is the snapshot's index digest. The gofer serves that snapshot
	// only: a mount or a resolved tag with another digest is refused.
	Index digest.Digest `json:"index,omitempty"`
	// Socket is the cryo process serving the file API (unix socket path),
	// and Mount the mount id there. Both set, or neither (a standalone
	// gofer, which fetches itself).
	Socket string `json:"socket,omitempty"`
	Mount  string `json:"mount,omitempty"`
	// Log, if set, is a file the gofer appends its log lines to (runsc
	// gives the gofer /dev/null for stdio).
	Log string `json:"log,omitempty"`
	// CacheDir is where a standalone gofer makes its private node cache
	// (default: the temp dir).
	CacheDir string `json:"cacheDir,omitempty"`
	// Peers, for a standalone gofer, are node pullers of the node's pool
	// to ask for chunks before the registry (host:port or dns:NAME:PORT,
	// as `cryo restore --peers`); PeerTokenFile is the file holding the
	// pool's token (required with Peers: the config names the file, never
	// the token), PeerCA a PEM CA bundle for peers serving TLS and
	// PeerServerName the name their certificates carry. A gofer served by
	// a cryo process (Socket) uses that process's peers.
	Peers          []string `json:"peers,omitempty"`
	PeerTokenFile  string   `json:"peerTokenFile,omitempty"`
	PeerCA         string   `json:"peerCA,omitempty"`
	PeerServerName string   `json:"peerServerName,omitempty"`
	// Checkpoint makes the image dir a checkpoint's: the gofer streams the
	// files the sentry writes to the upload API of the cryo process at
	// Socket (session Mount), which packs and pushes them as the snapshot
	// Reference names. Index is empty then: the snapshot does not exist
	// yet.
	Checkpoint bool `json:"checkpoint,omitempty"`
	// Filesystem, for a checkpoint, says that the files are a filesystem
	// checkpoint's (runsc fscheckpoint, or the workload's
	// /proc/gvisor/fscheckpoint): the gofer refuses the other kind, and a
	// daemon that takes over the session after a restart knows which
	// files to expect.
	Filesystem bool `json:"filesystem,omitempty"`
}

// Validate checks a Config.
func (c Config) Validate() error {
	if c.MediaType != MediaType {
		return fmt.Errorf("%s: mediaType %q, want %q (not a cryo gofer config: gVisor's own GCS gofer reads files of that name too)", ConfigFile, c.MediaType, MediaType)
	}
	if c.Checkpoint {
		if c.Index != "" || c.Socket == "" {
			return fmt.Errorf("%s: a checkpoint's config names a socket and no index", ConfigFile)
		}
	} else if err := c.Index.Validate(); err != nil {
		return fmt.Errorf("%s: index %q: %w", ConfigFile, c.Index, err)
	} else if c.Filesystem {
		return fmt.Errorf("%s: filesystem is for a checkpoint's config (a restore reads what its snapshot holds)", ConfigFile)
	}
	if (c.Socket == "") != (c.Mount == "") {
		return fmt.Errorf("%s: socket and mount go together (socket %q, mount %q)", ConfigFile, c.Socket, c.Mount)
	}
	if c.Socket == "" && c.Reference == "" {
		return fmt.Errorf("%s: no socket and no reference: nothing to read the snapshot from", ConfigFile)
	}
	if len(c.Peers) > 0 && c.Socket != "" {
		return fmt.Errorf("%s: peers are for a standalone gofer; one served by the cryo process at %s uses that process's peers", ConfigFile, c.Socket)
	}
	if len(c.Peers) == 0 && (c.PeerTokenFile != "" || c.PeerCA != "" || c.PeerServerName != "") {
		return fmt.Errorf("%s: peerTokenFile, peerCA and peerServerName need peers", ConfigFile)
	}
	if len(c.Peers) > 0 && c.PeerTokenFile == "" {
		return fmt.Errorf("%s: peers need peerTokenFile: peers serve snapshot memory only to callers with the pool token", ConfigFile)
	}
	if c.PeerServerName != "" && c.PeerCA == "" {
		return fmt.Errorf("%s: peerServerName needs peerCA", ConfigFile)
	}
	for name, p := range map[string]string{"socket": c.Socket, "log": c.Log, "cacheDir": c.CacheDir, "peerTokenFile": c.PeerTokenFile, "peerCA": c.PeerCA} {
		if p != "" && !filepath.IsAbs(p) {
			return fmt.Errorf("%s: %s %q is not an absolute path", ConfigFile, name, p)
		}
	}
	return nil
}

// configKeys are Config's JSON keys, exactly.
var configKeys = map[string]bool{"mediaType": true, "reference": true, "index": true, "socket": true, "mount": true, "log": true, "cacheDir": true, "checkpoint": true, "filesystem": true,
	"peers": true, "peerTokenFile": true, "peerCA": true, "peerServerName": true}

// ReadConfig reads and validates a ConfigFile. Keys must be exact and
// known: a misspelt one is an error, not a default.
func ReadConfig(r io.Reader) (Config, error) {
	data, err := io.ReadAll(io.LimitReader(r, MaxConfigSize+1))
	if err != nil {
		return Config{}, fmt.Errorf("read %s: %w", ConfigFile, err)
	}
	if len(data) > MaxConfigSize {
		return Config{}, fmt.Errorf("%s is over %d bytes", ConfigFile, MaxConfigSize)
	}
	// encoding/json matches keys case-insensitively and keeps the last of
	// duplicates: check the keys as written first.
	if err := checkKeys(data); err != nil {
		return Config{}, fmt.Errorf("parse %s: %w", ConfigFile, err)
	}
	var c Config
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&c); err != nil {
		return Config{}, fmt.Errorf("parse %s: %w", ConfigFile, err)
	}
	if dec.More() {
		return Config{}, fmt.Errorf("parse %s: data after the JSON object", ConfigFile)
	}
	return c, c.Validate()
}

// checkKeys checks that data is one JSON object whose keys are Config's,
// exactly as spelt, each at most once.
func checkKeys(data []byte) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return fmt.Errorf("not a JSON object")
	}
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return err
		}
		k, _ := tok.(string)
		if !configKeys[k] {
			return fmt.Errorf("unknown key %q", k)
		}
		if seen[k] {
			return fmt.Errorf("key %q twice", k)
		}
		seen[k] = true
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return err
		}
	}
	return nil
}

// WriteImageDir makes dir (created 0700 if missing) an image dir for runsc
// restore --image-path or runsc checkpoint --image-path whose files the
// gofer serves: it writes ConfigFile (0600) and flushes it and the dir, so
// that a runsc started after WriteImageDir returns finds it.
func WriteImageDir(dir string, c Config) error {
	if err := c.Validate(); err != nil {
		return err
	}
	data, err := json.Marshal(c)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("gofer image dir: %w", err)
	}
	p := filepath.Join(dir, ConfigFile)
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("gofer image dir: %w", err)
	}
	_, err = f.Write(data)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = atomicfile.SyncDir(dir)
	}
	if err != nil {
		os.Remove(p)
		return fmt.Errorf("write %s: %w", p, err)
	}
	return nil
}

// Install copies the gofer binary at src to dir/Binary (dir created
// 0755), for runsc on the node to find with
// GVISOR_SIDECAR_BINARIES_DIR=dir: written to a temporary name, flushed,
// and renamed over any older copy, so a runsc starting meanwhile finds the
// old or the new one whole. It refuses a dir named gvisor-bin, where the
// gofer would replace gVisor's own for every sandbox of the runsc beside
// it.
func Install(src, dir string) error {
	if filepath.Base(filepath.Clean(dir)) == "gvisor-bin" {
		return fmt.Errorf("install gofer: %s is a gVisor sidecar dir: cryo's gofer would replace gVisor's own checkpoint gofer for every sandbox there; use a dir of its own", dir)
	}
	data, err := os.ReadFile(src)
	if err != nil {
		return fmt.Errorf("install gofer: %w", err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("install gofer: %w", err)
	}
	if err := atomicfile.Replace(filepath.Join(dir, Binary), data, 0o755); err != nil {
		return fmt.Errorf("install gofer into %s: %w", dir, err)
	}
	return nil
}

// SidecarDir makes dir (0700) a complete gVisor sidecar dir for the runsc
// at runsc: GVISOR_SIDECAR_BINARIES_DIR replaces runsc's own gvisor-bin/
// for every sidecar it starts (the sentry, its prewarmer, the metric
// server), not only for the checkpoint gofer. So dir gets a link to cryo's
// gofer in goferDir and a link to each of runsc's other sidecars, from
// the gvisor-bin/ beside the file runsc is (links resolved), if there is
// one. It returns dir, which must stay while runsc may start sidecars.
func SidecarDir(dir, goferDir, runsc string) (string, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("sidecar dir: %w", err)
	}
	gofer, err := filepath.Abs(filepath.Join(goferDir, Binary))
	if err != nil {
		return "", err
	}
	if err := os.Symlink(gofer, filepath.Join(dir, Binary)); err != nil {
		return "", fmt.Errorf("sidecar dir: %w", err)
	}
	for _, bin := range runscSidecars(runsc) {
		if filepath.Base(bin) == Binary {
			continue
		}
		if err := os.Symlink(bin, filepath.Join(dir, filepath.Base(bin))); err != nil {
			return "", fmt.Errorf("sidecar dir: %w", err)
		}
	}
	return dir, nil
}

// runscSidecars lists the files of the gvisor-bin/ dir runsc itself
// would use without the variable: beside the file runsc is, links
// resolved (gVisor's gvisorbinaries.resolveDir sees /proc/self/exe).
func runscSidecars(runsc string) []string {
	if p, err := exec.LookPath(runsc); err == nil {
		runsc = p
	}
	real, err := filepath.EvalSymlinks(runsc)
	if err != nil {
		return nil
	}
	d := filepath.Join(filepath.Dir(real), "gvisor-bin")
	ents, err := os.ReadDir(d)
	if err != nil {
		return nil
	}
	var out []string
	for _, e := range ents {
		if !e.IsDir() {
			out = append(out, filepath.Join(d, e.Name()))
		}
	}
	return out
}
