// Package distlayout names the paths of distribution v3's storage layout that
// cryo reads directly instead of through distribution's storage API: blob
// data, to serve it with sendfile, and the link files whose modification
// times give content its age for gc's grace period. distribution keeps this
// layout unexported; registry's TestBlobLayoutIsDistributions fails if it
// moves.
package distlayout

import (
	"path"

	"github.com/opencontainers/go-digest"
)

const (
	// Root is distribution's storage root inside the driver.
	Root = "/docker/registry/v2"
	// BlobsRoot holds blob data, one dir per blob:
	// <alg>/<first two hex digits>/<hex>/data.
	BlobsRoot = Root + "/blobs"
	// RepositoriesRoot holds each repository's links to blobs and
	// manifests.
	RepositoriesRoot = Root + "/repositories"
)

// BlobDataPath is where the content of blob d is stored.
func BlobDataPath(d digest.Digest) string {
	hex := d.Encoded()
	return path.Join(BlobsRoot, d.Algorithm().String(), hex[:2], hex, "data")
}
