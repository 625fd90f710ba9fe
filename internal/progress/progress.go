// Package progress draws a one-line progress bar (bytes, rate, ETA) on a
// terminal and stays quiet otherwise. It is a few lines written here rather
// than a dependency because cryo needs nothing beyond a single redrawn line.
package progress

import (
	"fmt"
	"io"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/term"
)

// Bar reports progress towards a total number of bytes.
type Bar struct {
	w     io.Writer
	label string
	total int64
	done  atomic.Int64
	start time.Time
	stop  chan struct{}
	wg    sync.WaitGroup
}

// New starts a bar on w if w is a terminal; otherwise the bar only counts.
func New(w io.Writer, label string, total int64) *Bar {
	b := &Bar{w: w, label: label, total: total, start: time.Now(), stop: make(chan struct{})}
	if f, ok := w.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
		b.wg.Add(1)
		go b.loop()
	}
	return b
}

// Add records n more bytes done. It is safe for concurrent use.
func (b *Bar) Add(n int64) { b.done.Add(n) }

// Done returns the bytes done so far.
func (b *Bar) Done() int64 { return b.done.Load() }

// Finish stops redrawing and clears the line.
func (b *Bar) Finish() {
	select {
	case <-b.stop:
		return
	default:
	}
	close(b.stop)
	b.wg.Wait()
}

func (b *Bar) loop() {
	defer b.wg.Done()
	t := time.NewTicker(200 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-b.stop:
			fmt.Fprint(b.w, "\r\033[K")
			return
		case <-t.C:
			fmt.Fprint(b.w, "\r\033[K"+b.line())
		}
	}
}

func (b *Bar) line() string {
	done := b.done.Load()
	elapsed := time.Since(b.start).Seconds()
	rate := float64(done) / max(elapsed, 1e-3)
	pct, eta := 0.0, "-"
	if b.total > 0 {
		pct = 100 * float64(done) / float64(b.total)
		if rate > 0 && done < b.total {
			eta = time.Duration(float64(b.total-done) / rate * float64(time.Second)).Round(time.Second).String()
		}
	}
	return fmt.Sprintf("%s %5.1f%%  %s / %s  %s/s  ETA %s", b.label, pct, Bytes(done), Bytes(b.total), Bytes(int64(rate)), eta)
}

// Bytes formats n bytes with a binary unit.
func Bytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}
