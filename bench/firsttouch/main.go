// Command firsttouch measures what this machine charges for the first
// write to memory, the cost every restore pays to fill a sandbox's memory
// file: it maps a memfd (shared memory, as gVisor's memory file is) of
// -gib GiB, writes one byte of each page, and prints the time of each
// GiB. On a VM whose hypervisor takes freed guest pages back (virtio
// balloon free page reporting), pages it no longer backs cost far more
// than pages it does, and restore times swing with that.
//
// With -fill MiB it instead fills a fresh memfd of that size from a
// page-cached file, 1 MiB at a time, in the ways a checkpoint gofer can
// write a read into the sandbox's memory file: pread into a mapping of
// it, the same after MADV_POPULATE_WRITE, and pread into a buffer then
// pwrite by fd (what cryo's gofer does).
//
//	go run ./bench/firsttouch -gib 16
//	go run ./bench/firsttouch -fill 256
package main

import (
	"flag"
	"fmt"
	"log"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

func main() {
	gib := flag.Int("gib", 8, "GiB of shared memory to touch")
	rounds := flag.Int("rounds", 2, "times to map and touch it, one right after the other")
	fill := flag.Int("fill", 0, "MiB: compare ways of filling a memfd from a file instead (see the package doc)")
	flag.Parse()
	if *fill > 0 {
		if err := compareFills(*fill, *rounds); err != nil {
			log.Fatal(err)
		}
		return
	}
	for r := range *rounds {
		times, err := touch(*gib)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("round %d, seconds per GiB:", r)
		for _, t := range times {
			fmt.Printf(" %.2f", t.Seconds())
		}
		fmt.Println()
	}
}

// touch maps a fresh memfd of gib GiB, writes a byte of every page, and
// returns the time each GiB took; the memory is freed when it returns.
func touch(gib int) ([]time.Duration, error) {
	size := gib << 30
	fd, err := unix.MemfdCreate("firsttouch", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("memfd_create: %w", err)
	}
	defer unix.Close(fd)
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		return nil, fmt.Errorf("ftruncate to %d GiB: %w", gib, err)
	}
	m, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap %d GiB: %w", gib, err)
	}
	defer unix.Munmap(m)
	page := os.Getpagesize()
	var times []time.Duration
	for g := range gib {
		start := time.Now()
		for i := g << 30; i < (g+1)<<30; i += page {
			m[i] = 1
		}
		times = append(times, time.Since(start))
	}
	return times, nil
}

// compareFills fills a fresh memfd of mib MiB from a page-cached file of
// the same size, each way rounds times, and prints the time of each.
func compareFills(mib, rounds int) error {
	const piece = 1 << 20
	size := mib << 20
	src, err := os.CreateTemp("", "firsttouch-src")
	if err != nil {
		return err
	}
	defer os.Remove(src.Name())
	defer src.Close()
	buf := make([]byte, piece)
	for i := range buf {
		buf[i] = byte(i*131 + 7)
	}
	for range mib {
		if _, err := src.Write(buf); err != nil {
			return fmt.Errorf("write the source file: %w", err)
		}
	}
	fd := int(src.Fd())
	ways := []struct {
		name string
		fill func(dst int, m []byte, off int) error
	}{
		{"pread into the mapping", func(_ int, m []byte, off int) error {
			_, err := unix.Pread(fd, m[off:off+piece], int64(off))
			return err
		}},
		{"MADV_POPULATE_WRITE, pread into the mapping", func(_ int, m []byte, off int) error {
			if err := unix.Madvise(m[off:off+piece], unix.MADV_POPULATE_WRITE); err != nil {
				return fmt.Errorf("madvise: %w", err)
			}
			_, err := unix.Pread(fd, m[off:off+piece], int64(off))
			return err
		}},
		{"pread into a buffer, pwrite by fd", func(dst int, _ []byte, off int) error {
			if _, err := unix.Pread(fd, buf, int64(off)); err != nil {
				return err
			}
			_, err := unix.Pwrite(dst, buf, int64(off))
			return err
		}},
	}
	for r := range rounds {
		for _, w := range ways {
			took, err := fillOnce(size, piece, w.fill)
			if err != nil {
				return fmt.Errorf("%s: %w", w.name, err)
			}
			fmt.Printf("round %d, %s: %.3f s for %d MiB\n", r, w.name, took.Seconds(), mib)
		}
	}
	return nil
}

// fillOnce maps a fresh memfd of size bytes and fills it piece by piece
// with fill, returning the time that took.
func fillOnce(size, piece int, fill func(dst int, m []byte, off int) error) (time.Duration, error) {
	dst, err := unix.MemfdCreate("firsttouch-dst", unix.MFD_CLOEXEC)
	if err != nil {
		return 0, fmt.Errorf("memfd_create: %w", err)
	}
	defer unix.Close(dst)
	if err := unix.Ftruncate(dst, int64(size)); err != nil {
		return 0, err
	}
	m, err := unix.Mmap(dst, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return 0, err
	}
	defer unix.Munmap(m)
	start := time.Now()
	for off := 0; off < size; off += piece {
		if err := fill(dst, m, off); err != nil {
			return 0, err
		}
	}
	return time.Since(start), nil
}
