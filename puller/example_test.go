package puller_test

import (
	"context"
	"fmt"
	"log"

	"github.com/cryo-oci/cryo/puller"
)

// A node agent preloads a snapshot before any sandbox needs it: every
// chunk fetched and verified into the node cache, and the materialized
// image dir written, so that a later restore from it needs no FUSE.
func ExamplePuller_Load() {
	ctx := context.Background()
	p, err := puller.New(puller.Options{CacheDir: "/var/lib/cryo"})
	if err != nil {
		log.Fatal(err)
	}
	src, err := puller.Resolve(ctx, "registry:5000/app:v1", puller.ResolveOptions{})
	if err != nil {
		log.Fatal(err)
	}
	snap, err := p.Load(ctx, src)
	if err != nil {
		log.Fatal(err)
	}
	dir, _ := p.Materialized(src.Index.Digest)
	fmt.Printf("%d bytes of snapshot %s local in %s\n", snap.LogicalSize(), src.Index.Digest, dir)
}
