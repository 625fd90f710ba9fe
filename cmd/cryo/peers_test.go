package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestPeerFlagsRefuseWeakSetups: a pool needs a token file with a strong
// enough token; TLS flags need the peers they are for.
func TestPeerFlagsRefuseWeakSetups(t *testing.T) {
	dir := t.TempDir()
	short := filepath.Join(dir, "short")
	good := filepath.Join(dir, "good")
	os.WriteFile(short, []byte("tiny\n"), 0o600)
	os.WriteFile(good, []byte("  0123456789abcdef0123  \n"), 0o600)
	for _, tc := range []struct {
		f    peerFlags
		want string
	}{
		{peerFlags{peers: []string{"a:1"}}, "--peer-token-file is required"},
		{peerFlags{peers: []string{"a:1"}, tokenFile: filepath.Join(dir, "none")}, "--peer-token-file"},
		{peerFlags{peers: []string{"a:1"}, tokenFile: short}, "at least 16"},
		{peerFlags{peers: []string{"nohost"}, tokenFile: good}, "host:port"},
		{peerFlags{ca: good}, "need --peers"},
		{peerFlags{peers: []string{"a:1"}, tokenFile: good, serverName: "x"}, "needs --peer-ca"},
		{peerFlags{peers: []string{"a:1"}, tokenFile: good, ca: good}, "no PEM certificate"},
	} {
		_, err := tc.f.pool(context.Background(), "", nil, nil)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: error %v, want one saying %q", tc.f, err, tc.want)
		}
	}
	f := peerFlags{peers: []string{"127.0.0.1:7070"}, tokenFile: good}
	p, err := f.pool(context.Background(), "", nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	p.Close()
	if tok, _ := f.token(); tok != "0123456789abcdef0123" {
		t.Errorf("token %q: white space not trimmed", tok)
	}
}
