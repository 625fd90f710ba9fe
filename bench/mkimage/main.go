// Command mkimage writes a synthetic checkpoint image dir for the demo and
// benchmarks: checkpoint.img with a gVisor header, pages_meta.img and a
// pages.img of random, text-like or half-zero memory.
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/cryo-oci/cryo/internal/synth"
)

func main() {
	kind := flag.String("kind", "random", "content of pages.img: random, text or halfzero")
	size := flag.Int64("size", 256<<20, "size of pages.img in bytes")
	seed := flag.Uint64("seed", 1, "seed of the content")
	flag.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: mkimage [-kind K] [-size N] [-seed S] DIR")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() != 1 {
		flag.Usage()
		os.Exit(2)
	}
	if err := synth.ImageDir(flag.Arg(0), synth.Kind(*kind), *size, *seed); err != nil {
		fmt.Fprintln(os.Stderr, "mkimage:", err)
		os.Exit(1)
	}
}
