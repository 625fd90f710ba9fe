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
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/registry/api"
	"github.com/distribution/distribution/v3/configuration"
	"github.com/distribution/distribution/v3/registry/auth/token"
	"github.com/go-jose/go-jose/v4"
	"github.com/go-jose/go-jose/v4/jwt"
	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
)

// tokenIssuer signs registry bearer tokens as a token server would, with a
// key whose certificate the registry trusts.
type tokenIssuer struct {
	key        *ecdsa.PrivateKey
	certBundle string
}

func newTokenIssuer(t *testing.T) *tokenIssuer {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "cryo test token issuer"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	bundle := filepath.Join(t.TempDir(), "issuer.pem")
	if err := os.WriteFile(bundle, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	return &tokenIssuer{key: key, certBundle: bundle}
}

// configure turns token auth on in cfg, trusting the issuer.
func (ti *tokenIssuer) configure(cfg *configuration.Configuration) {
	cfg.Auth = configuration.Auth{"token": configuration.Parameters{
		"realm": "https://auth.example/token", "service": "cryo-test", "issuer": "cryo-test-issuer", "rootcertbundle": ti.certBundle}}
}

// startRegistry serves a registry on root with token auth trusting ti.
func (ti *tokenIssuer) startRegistry(t *testing.T, root string) *testRegistry {
	t.Helper()
	cfg, err := DefaultConfig(root, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ti.configure(cfg)
	return startRegistryWith(t, cfg)
}

// token returns a bearer token granting pull on the repositories named.
func (ti *tokenIssuer) token(t *testing.T, pull ...string) string {
	t.Helper()
	grants := map[string][]string{}
	for _, repo := range pull {
		grants[repo] = []string{"pull"}
	}
	return ti.tokenFor(t, grants)
}

// tokenFor returns a bearer token granting, on each repository named, the
// actions given.
func (ti *tokenIssuer) tokenFor(t *testing.T, grants map[string][]string) string {
	t.Helper()
	jwk := &jose.JSONWebKey{Key: ti.key, KeyID: token.GetJWKThumbprint(&ti.key.PublicKey), Algorithm: string(jose.ES256)}
	signer, err := jose.NewSigner(jose.SigningKey{Algorithm: jose.ES256, Key: jwk}, (&jose.SignerOptions{EmbedJWK: true}).WithType("JWT"))
	if err != nil {
		t.Fatal(err)
	}
	var access []*token.ResourceActions
	for repo, actions := range grants {
		access = append(access, &token.ResourceActions{Type: "repository", Name: repo, Actions: actions})
	}
	now := time.Now()
	claims := token.ClaimSet{Issuer: "cryo-test-issuer", Subject: "tester", Audience: []string{"cryo-test"},
		Expiration: now.Add(time.Hour).Unix(), NotBefore: now.Add(-time.Minute).Unix(), IssuedAt: now.Unix(), JWTID: digest.FromString(now.String()).Encoded()[:16], Access: access}
	s, err := jwt.Signed(signer).Claims(claims).Serialize()
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// bearer is an HTTP client sending a fixed bearer token.
type bearer string

func (b bearer) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	if b != "" {
		r.Header.Set("Authorization", "Bearer "+string(b))
	}
	return http.DefaultTransport.RoundTrip(r)
}

// TestTokenAuthLimitsExtensions checks cryo's extension endpoints against
// distribution's token access controller, built from the same
// configuration: a caller who may pull only "public" gets only public's
// blob from the chunk index, and a challenge naming the scope it lacks
// from private's referrers and blobs.
func TestTokenAuthLimitsExtensions(t *testing.T) {
	root := t.TempDir()
	data := textData("t", 64<<10)
	d := digest.FromBytes(data)
	open := startRegistry(t, root)
	// Two encodings of the chunk: two blobs, one per repository.
	for repo, crc := range map[string]bool{"public": false, "private": true} {
		if code := putFileManifest(t, open, repo, []fileChunk{zstdChunk(t, data, zstd.WithEncoderCRC(crc))}, 0); code != http.StatusCreated {
			t.Fatalf("manifest PUT: %d", code)
		}
	}
	blobs := lookupChunk(t, open, d)
	if len(blobs) != 2 {
		t.Fatalf("the index has %d blobs for the chunk, want 2", len(blobs))
	}
	var private digest.Digest
	for _, b := range blobs {
		if b.Repository == "private" {
			private = b.Digest
		}
	}

	ti := newTokenIssuer(t)
	reg := ti.startRegistry(t, root)
	client := &http.Client{Transport: bearer(ti.token(t, "public"))}

	found, err := api.Lookup(context.Background(), client, reg.http.URL, []digest.Digest{d})
	if err != nil {
		t.Fatal(err)
	}
	if got := found[d]; len(got) != 1 || got[0].Repository != "public" {
		t.Fatalf("lookup with pull on public only: %+v", got)
	}
	get := func(c *http.Client, path string) *http.Response {
		resp, err := c.Get(reg.http.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp
	}
	subject := digest.FromString("subject")
	if resp := get(client, "/v2/public/referrers/"+subject.String()); resp.StatusCode != http.StatusOK {
		t.Fatalf("referrers of public: %s", resp.Status)
	}
	for _, path := range []string{"/v2/private/referrers/" + subject.String(), "/v2/private/blobs/" + private.String()} {
		resp := get(client, path)
		if resp.StatusCode != http.StatusUnauthorized || !strings.Contains(resp.Header.Get("WWW-Authenticate"), `scope="repository:private:pull"`) {
			t.Errorf("GET %s with pull on public only: %s, challenge %q", path, resp.Status, resp.Header.Get("WWW-Authenticate"))
		}
	}
	// Without a token, nothing: the lookup is challenged before its body
	// is read.
	if resp := get(&http.Client{Transport: bearer("")}, "/v2/_cryo/chunks/"+d.String()); resp.StatusCode != http.StatusUnauthorized || !strings.Contains(resp.Header.Get("WWW-Authenticate"), "Bearer") {
		t.Errorf("anonymous lookup: %s", resp.Status)
	}
}
