package peer

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"strings"
)

// ReadToken reads a pool token from file path (surrounding white space
// dropped) and checks its length: peers serve snapshot memory only to
// callers with it.
func ReadToken(path string) (string, error) {
	if path == "" {
		return "", errors.New("no pool token file: peers serve snapshot memory only to callers with the pool token")
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("pool token: %w", err)
	}
	t := strings.TrimSpace(string(b))
	if len(t) < MinTokenBytes {
		return "", fmt.Errorf("pool token %s: %d bytes, want at least %d (e.g. head -c 32 /dev/urandom | base64)", path, len(t), MinTokenBytes)
	}
	return t, nil
}

// ClientTLS returns the TLS configuration that reaches peers serving TLS:
// their certificates checked against the PEM CA bundle caFile, for
// serverName if set (else each peer's host).
func ClientTLS(caFile, serverName string) (*tls.Config, error) {
	pem, err := os.ReadFile(caFile)
	if err != nil {
		return nil, fmt.Errorf("peer CA: %w", err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("peer CA %s: no PEM certificate in it", caFile)
	}
	return &tls.Config{RootCAs: roots, ServerName: serverName, MinVersion: tls.VersionTLS12}, nil
}
