package registry

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/transfer"
)

// selfSigned writes a self-signed certificate for 127.0.0.1 and its key.
func selfSigned(t *testing.T, dir string) (certFile, keyFile string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "cryo test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, BasicConstraintsValid: true, IsCA: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kder, _ := x509.MarshalECPrivateKey(key)
	certFile, keyFile = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644)
	os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), 0o600)
	return certFile, keyFile
}

// TestTLS serves the registry with TLS from a distribution config: a client
// that trusts the certificate (--ca-file) pushes and pulls, one that does
// not is refused with a certificate error.
func TestTLS(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	dir := t.TempDir()
	cert, key := selfSigned(t, dir)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cfgPath := filepath.Join(dir, "config.yml")
	os.WriteFile(cfgPath, []byte(`version: 0.1
storage:
  filesystem:
    rootdirectory: `+filepath.Join(dir, "data")+`
http:
  addr: `+ln.Addr().String()+`
  tls:
    certificate: `+cert+`
    key: `+key+`
`), 0o644)
	cfg, err := LoadConfig(cfgPath)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := New(ctx, cfg, Options{})
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(ctx, ln, nil)
	plain := false
	img := filepath.Join(t.TempDir(), "img")
	synth.ImageDir(img, synth.Random, 1<<20, 1)
	ref := ln.Addr().String() + "/app:v1"

	untrusted, tag, _ := transfer.Repository(ref, transfer.ClientOptions{PlainHTTP: &plain})
	if _, err := transfer.Push(ctx, img, untrusted, tag, transfer.PushOptions{}); err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("push without trusting the certificate: %v", err)
	}
	trusted, tag, err := transfer.Repository(ref, transfer.ClientOptions{PlainHTTP: &plain, CAFile: cert})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := transfer.Push(ctx, img, trusted, tag, transfer.PushOptions{}); err != nil {
		t.Fatalf("push over TLS: %v", err)
	}
	out := filepath.Join(t.TempDir(), "out")
	if _, err := transfer.Pull(ctx, trusted, tag, out, transfer.PullOptions{}); err != nil {
		t.Fatalf("pull over TLS: %v", err)
	}
	testenv.SameImage(t, img, out)

	// cryo login honours the same trust options.
	t.Setenv("DOCKER_CONFIG", t.TempDir())
	host := ln.Addr().String()
	if err := transfer.Login(ctx, host, "u", "p", transfer.ClientOptions{PlainHTTP: &plain}); err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("login without trusting the certificate: %v", err)
	}
	if err := transfer.Login(ctx, host, "u", "p", transfer.ClientOptions{PlainHTTP: &plain, CAFile: cert}); err != nil {
		t.Fatalf("login trusting the certificate: %v", err)
	}
}
