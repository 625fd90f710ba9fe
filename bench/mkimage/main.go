// Command mkimage writes a synthetic checkpoint image dir for the demo and
// benchmarks: checkpoint.img with a gVisor header, pages_meta.img and a
// pages.img of random, text-like or half-zero memory; or, with -from, a
// later checkpoint of an image dir, some of its pages rewritten.
package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/cryo-oci/cryo/internal/synth"
)

func main() {
	kind := flag.String("kind", "random", "content of pages.img (and of rewritten pages): random, text or halfzero")
	size := flag.Int64("size", 256<<20, "size of pages.img in bytes")
	seed := flag.Uint64("seed", 1, "seed of the content")
	from := flag.String("from", "", "image dir to copy, with -rewrite of its pages rewritten and -indels pages runs inserted or deleted")
	rewrite := flag.Float64("rewrite", 0.1, "with -from: share of pages.img's pages rewritten, in runs of 16-256 pages")
	indels := flag.Int("indels", 0, "with -from: runs of 1-16 pages inserted or deleted")
	flag.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: mkimage [-kind K] [-size N] [-seed S] DIR\n       mkimage -from SRC [-rewrite F] [-indels N] [-kind K] [-seed S] DIR")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() != 1 {
		flag.Usage()
		os.Exit(2)
	}
	var err error
	if *from != "" {
		err = mutate(*from, flag.Arg(0), synth.Kind(*kind), *rewrite, *indels, *seed)
	} else {
		err = synth.ImageDir(flag.Arg(0), synth.Kind(*kind), *size, *seed)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "mkimage:", err)
		os.Exit(1)
	}
}

// mutate writes to dst the image dir src with rewrite of pages.img's pages
// rewritten and indels runs inserted or deleted, as the dedup benchmark
// does; the other files are copied.
func mutate(src, dst string, kind synth.Kind, rewrite float64, indels int, seed uint64) error {
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return err
	}
	for _, name := range []string{"checkpoint.img", "pages_meta.img"} {
		data, err := os.ReadFile(filepath.Join(src, name))
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(dst, name), data, 0o644); err != nil {
			return err
		}
	}
	in, err := os.Open(filepath.Join(src, "pages.img"))
	if err != nil {
		return err
	}
	defer in.Close()
	st, err := in.Stat()
	if err != nil {
		return err
	}
	pages := st.Size() / synth.PageSize
	return synth.WriteFile(filepath.Join(dst, "pages.img"), func(w io.Writer) error {
		_, err := synth.Mutate(w, in, pages, synth.MutationPlan(pages, indels, rewrite, seed), kind, seed)
		return err
	})
}
