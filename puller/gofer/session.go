package gofer

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
)

// Session is what one runsc command run through cryo's gofer needs from
// the cryo process that starts it: a private 0700 dir holding the sidecar
// dir runsc gets (SidecarDir) and the unix socket on which this process
// serves the gofer's API (the file API of a restore, or the upload API of
// a checkpoint). The dir is under the temp dir: a unix socket path must be
// short.
type Session struct {
	// Dir is the session's dir; Sidecars the sidecar dir in it and Socket
	// the API's socket.
	Dir, Sidecars, Socket string
	srv                   *http.Server
	// stop cancels the context of every request, hijacked connections'
	// included (http.Server.Close forgets those).
	stop context.CancelFunc
}

// StartSession makes a session for the runsc at runsc and cryo's gofer in
// goferDir, and serves h on its socket until Close.
func StartSession(goferDir, runsc string, h http.Handler) (*Session, error) {
	dir, err := os.MkdirTemp("", "cryo-gofer-")
	if err != nil {
		return nil, fmt.Errorf("gofer session dir: %w", err)
	}
	s := &Session{Dir: dir, Socket: filepath.Join(dir, "api.sock")}
	if s.Sidecars, err = SidecarDir(filepath.Join(dir, "sidecars"), goferDir, runsc); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	ln, err := net.Listen("unix", s.Socket)
	if err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("gofer socket %s (a unix socket path must be short: set TMPDIR to a short dir): %w", s.Socket, err)
	}
	ctx, stop := context.WithCancel(context.Background())
	s.stop = stop
	s.srv = &http.Server{Handler: h, BaseContext: func(net.Listener) context.Context { return ctx }}
	go s.srv.Serve(ln)
	return s, nil
}

// Env is the variable that points runsc at the session's sidecar dir.
func (s *Session) Env() string { return "GVISOR_SIDECAR_BINARIES_DIR=" + s.Sidecars }

// Close stops serving, ends the requests in flight (reference uploads
// included) and removes the session's dir.
func (s *Session) Close() error {
	s.stop()
	return errors.Join(s.srv.Close(), os.RemoveAll(s.Dir))
}
