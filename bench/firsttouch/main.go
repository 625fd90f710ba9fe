// Command firsttouch measures what this machine charges for the first
// write to memory, the cost every restore pays to fill a sandbox's memory
// file: it maps a memfd (shared memory, as gVisor's memory file is) of
// -gib GiB, writes one byte of each page, and prints the time of each
// GiB. On a VM whose hypervisor takes freed guest pages back (virtio
// balloon free page reporting), pages it no longer backs cost far more
// than pages it does, and restore times swing with that.
//
//	go run ./bench/firsttouch -gib 16
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
	flag.Parse()
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
