package fetch

import (
	"sync"
	"sync/atomic"
)

// Flights is the set of chunk fetches in flight on a node, shared by the
// schedulers of every mount there (Options.InFlight): a chunk that two
// mounts need at the same moment, stored the same way (a key), is fetched
// once. A fetch has two moments, which is why this is not a
// singleflight.Group: its verified bytes, which the other mounts' readers
// take at once (a page fault does not wait for another mount's disk
// writes), and the end of its write into the node cache, until which no
// mount fetches the chunk again. The zero value is ready to use.
type Flights struct {
	mu sync.Mutex
	m  map[key]*flight
}

// flight is one fetch on the node, led by the scheduler that started it
// and followed by the others.
type flight struct {
	// verified is closed once data is set (the chunk's verified bytes,
	// never modified), or with done if the fetch got none.
	verified chan struct{}
	once     sync.Once
	data     []byte
	// done is closed when the fetch is over: the chunk is in the node
	// cache (err nil), or err says why not.
	done chan struct{}
	err  error
	// viaPeer is set while the leader asks a peer for the chunk (which
	// may in turn be waiting on this node); urgent is that request's
	// urgency, which a follower that a read waits on sets.
	viaPeer atomic.Bool
	urgent  atomic.Pointer[urgency]
	// demanded is set once a read waits on the flight through a follower:
	// a peer request the leader starts later is urgent from the start.
	demanded atomic.Bool
}

// demand tells the flight's leader that a read waits on it: the peer
// request it is waiting on, if any, now or later, is urgent.
func (f *flight) demand() {
	if f == nil {
		return
	}
	f.demanded.Store(true)
	f.urgent.Load().set()
}

// asking marks the flight as waiting on a peer request of urgency u (nil:
// no longer); a read that waited on it before makes u urgent at once.
func (f *flight) asking(u *urgency) {
	f.viaPeer.Store(u != nil)
	f.urgent.Store(u)
	if u != nil && f.demanded.Load() {
		u.set()
	}
}

// join returns the flight of key k and whether the caller leads it: then
// it fetches and stores the chunk and calls verify and end. mayAskPeer
// says the leader may ask a peer for it: until it knows, the flight counts
// as waiting on one (viaPeer), so that no scheduler serving peers follows
// it in the meantime.
func (fs *Flights) join(k key, mayAskPeer bool) (*flight, bool) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if f, ok := fs.m[k]; ok {
		return f, false
	}
	if fs.m == nil {
		fs.m = map[key]*flight{}
	}
	f := &flight{verified: make(chan struct{}), done: make(chan struct{})}
	f.viaPeer.Store(mayAskPeer)
	fs.m[k] = f
	return f, true
}

// verify hands the chunk's verified bytes to the followers, once.
func (f *flight) verify(data []byte) {
	f.once.Do(func() {
		f.data = data
		close(f.verified)
	})
}

// end ends flight f of key k with err (nil: the chunk is in the node
// cache). It leaves the set first: whoever comes next finds the chunk in
// the cache, or leads a fetch of their own.
func (fs *Flights) end(k key, f *flight, data []byte, err error) {
	fs.mu.Lock()
	if fs.m[k] == f {
		delete(fs.m, k)
	}
	fs.mu.Unlock()
	f.verify(data)
	f.err = err
	close(f.done)
}
