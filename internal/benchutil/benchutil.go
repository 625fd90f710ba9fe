// Package benchutil holds what cryo's benchmark programs share: medians and
// ranges of repeated measurements, a free loopback port, a process's CPU
// time, and dropping the page cache so that a "cold" figure is cold.
package benchutil

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Median returns the median of v (the mean of the middle two for an even
// count), or 0 for none. v is not modified.
func Median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := sorted(v)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// Percentile returns the value at fraction p (0..1) of v, nearest rank
// below, or 0 for none. v is not modified.
func Percentile(v []float64, p float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := sorted(v)
	return s[int(p*float64(len(s)-1))]
}

// MinMax returns the smallest and largest of v (0, 0 for none).
func MinMax(v []float64) (lo, hi float64) {
	if len(v) == 0 {
		return 0, 0
	}
	s := sorted(v)
	return s[0], s[len(s)-1]
}

// Spread formats the median of v with verb (e.g. "%.2f") and, for more
// than one value, its min–max range: "1.20 (1.10–1.35)".
func Spread(v []float64, verb string) string {
	m := fmt.Sprintf(verb, Median(v))
	if len(v) < 2 {
		return m
	}
	lo, hi := MinMax(v)
	return fmt.Sprintf("%s ("+verb+"–"+verb+")", m, lo, hi)
}

// Range formats the min–max range of v with verb: "1.10–1.35".
func Range(v []float64, verb string) string {
	lo, hi := MinMax(v)
	return fmt.Sprintf(verb+"–"+verb, lo, hi)
}

func sorted(v []float64) []float64 {
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	return s
}

// FreeAddr returns a loopback address with a port that was free a moment
// ago (listen, then close: another process may take it in between).
func FreeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", fmt.Errorf("find a free port: %w", err)
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

// DropCaches writes dirty pages out and drops the page cache, dentries and
// inodes (needs root). A benchmark that reports a cold figure must stop on
// its error: with the cache still warm the figure would be a warm one.
func DropCaches() error {
	syscall.Sync()
	if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3"), 0o200); err != nil {
		return fmt.Errorf("drop the page cache (needs root): %w", err)
	}
	return nil
}

// CPUTime is the user and system CPU time process pid has used so far,
// from /proc/PID/stat; 0 if it cannot be read.
func CPUTime(pid int) time.Duration {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// The fields after the command name, which is in parentheses.
	i := bytes.LastIndexByte(data, ')')
	if i < 0 {
		return 0
	}
	f := strings.Fields(string(data[i+1:]))
	if len(f) < 13 {
		return 0
	}
	utime, _ := strconv.ParseInt(f[11], 10, 64)
	stime, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(utime+stime) * time.Second / 100 // USER_HZ
}
