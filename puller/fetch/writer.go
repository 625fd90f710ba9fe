package fetch

import (
	"sync"

	"github.com/opencontainers/go-digest"
)

// writer stores verified chunks in the node cache in the background, so
// that a fetch worker goes on to its next chunk instead of waiting for this
// one's write. A few goroutines write at once (the disk takes parallel
// flushes better than one at a time); the bytes queued or being written are
// bounded, and a submit waits for room: a disk slower than the network
// slows fetching down instead of growing the queue.
type writer struct {
	// put stores a run of chunks, returning each one's outcome, in
	// order (one error per chunk).
	put     func([]digest.Digest, [][]byte) []error
	limit   int64
	metrics *Metrics

	mu sync.Mutex
	// cond is broadcast when a write is queued or finished, and on close.
	cond  *sync.Cond
	queue []*write
	// bytes counts the chunks queued and being written; waiting, the
	// submits waiting for room.
	bytes   int64
	waiting int
	closed  bool
	// Submits are let in in the order they came (tickets), so that a
	// large chunk is not starved by small ones taking the room it waits
	// for.
	nextTicket, turn uint64

	wg sync.WaitGroup
}

// write is one queued chunk; done gets the outcome of storing it.
type write struct {
	d    digest.Digest
	data []byte
	done func(error)
}

// maxRun and maxRunBytes bound the chunks a writer goroutine takes from
// the queue at once, to store with one put: the chunks of a pack range,
// written into a file with one pwritev where they follow each other
// (cache.Store.PutVerifiedRun).
const (
	maxRun      = 64
	maxRunBytes = 4 << 20
)

// newWriter starts n goroutines storing chunks with put, holding at most
// limit bytes (and always one chunk, however large).
func newWriter(put func([]digest.Digest, [][]byte) []error, n int, limit int64, m *Metrics) *writer {
	w := &writer{put: put, limit: limit, metrics: m}
	w.cond = sync.NewCond(&w.mu)
	for range n {
		w.wg.Add(1)
		go w.run()
	}
	return w
}

// submit queues data to be stored as chunk d, waiting while the queue is
// full; done is called, from a writer goroutine, once the chunk is stored
// (nil) or could not be. data must not be modified until then. After
// close, submit queues nothing and returns ErrClosed.
func (w *writer) submit(d digest.Digest, data []byte, done func(error)) error {
	n := int64(len(data))
	w.mu.Lock()
	defer w.mu.Unlock()
	ticket := w.nextTicket
	w.nextTicket++
	// Once in, the next in line may go: whatever happens to this one.
	defer func() {
		w.turn++
		w.cond.Broadcast()
	}()
	for !w.closed && (ticket != w.turn || w.bytes > 0 && w.bytes+n > w.limit) {
		w.waiting++
		w.cond.Wait()
		w.waiting--
	}
	if w.closed {
		return ErrClosed
	}
	w.bytes += n
	w.metrics.queued(n)
	w.queue = append(w.queue, &write{d: d, data: data, done: done})
	w.cond.Broadcast()
	return nil
}

func (w *writer) run() {
	defer w.wg.Done()
	for {
		w.mu.Lock()
		for len(w.queue) == 0 && !w.closed {
			w.cond.Wait()
		}
		if len(w.queue) == 0 {
			w.mu.Unlock()
			return
		}
		var run []*write
		var ds []digest.Digest
		var datas [][]byte
		var n int64
		for len(w.queue) > 0 && len(run) < maxRun && (len(run) == 0 || n+int64(len(w.queue[0].data)) <= maxRunBytes) {
			wr := w.queue[0]
			w.queue[0] = nil
			w.queue = w.queue[1:]
			run, ds, datas = append(run, wr), append(ds, wr.d), append(datas, wr.data)
			n += int64(len(wr.data))
		}
		w.mu.Unlock()

		errs := w.put(ds, datas)

		w.mu.Lock()
		w.bytes -= n
		w.cond.Broadcast()
		w.mu.Unlock()
		w.metrics.queued(-n)
		for i, wr := range run {
			wr.done(errs[i])
		}
	}
}

// close refuses further submits (those waiting for room return ErrClosed)
// and returns once every chunk already queued has been stored, or failed
// to be, and the goroutines have stopped: nothing is written after close
// returns.
func (w *writer) close() {
	w.mu.Lock()
	w.closed = true
	w.cond.Broadcast()
	w.mu.Unlock()
	w.wg.Wait()
}

// state returns the bytes queued or being written and the submits waiting
// for room, for tests.
func (w *writer) state() (bytes int64, waiting int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.bytes, w.waiting
}

// isClosed reports whether close was called, for tests.
func (w *writer) isClosed() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.closed
}
