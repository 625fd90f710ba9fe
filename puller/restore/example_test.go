package restore_test

import (
	"context"
	"fmt"
	"log"
	"os"

	"github.com/cryo-oci/cryo/puller"
	"github.com/cryo-oci/cryo/puller/restore"
)

// A sandbox manager restores container app1 from a registry snapshot, as
// `cryo restore --runsc-flag=--root=/run/runsc registry:5000/app:v1
// --bundle=/srv/app app1` does.
func ExampleRestore() {
	ctx := context.Background()
	p, err := puller.New(puller.Options{CacheDir: "/var/lib/cryo"})
	if err != nil {
		log.Fatal(err)
	}
	src, err := puller.Resolve(ctx, "registry:5000/app:v1", puller.ResolveOptions{})
	if err != nil {
		log.Fatal(err)
	}
	res, err := restore.Restore(ctx, p, src, restore.Options{
		Runsc:        "/usr/local/bin/runsc",
		RunscFlags:   []string{"--root=/run/runsc"},
		ContainerID:  "app1",
		RestoreFlags: []string{"--bundle=/srv/app"},
		Stdout:       os.Stdout,
		Stderr:       os.Stderr,
		Progress: func(e restore.Event) {
			fmt.Fprintf(os.Stderr, "%s after %v (mode %s)\n", e.Step, e.After, e.Mode)
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Fprintf(os.Stderr, "restored from %s (%s); every page loaded after %v\n", res.Dir, res.Mode, res.PagesLoaded)
}
