package gofer

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// The reference upload: the upload API's PUT, upgraded (Upgrade:
// RefsProtocol) to a framed stream on the unix socket in which the gofer
// names the bytes of a checkpoint file by where they lie in the sentry's
// own files (its memory file, passed once with SCM_RIGHTS) instead of
// copying them through the socket. cryo reads them with pread, straight
// into its chunker's buffer: a 1 GiB checkpoint no longer crosses the
// socket, which cost about 0.8 s of kernel time per GiB on the gofer's
// side (BenchmarkUpload). Frames, integers little-endian:
//
//	gofer -> cryo
//	  'F' handle u32, size u64        with the file's fd (SCM_RIGHTS)
//	  'R' handle u32, n u32, n x (offset u64, length u64)
//	  'D' length u32, the bytes       (a source no fd was passed for)
//	  'E'                             the file's end
//	cryo -> gofer
//	  'K'                             an R or D frame read whole, in order
//	  'S' size u64                    the file packed (after E)
//	  'X' length u32, message         the file failed; the stream ends
//
// A gofer completes a sentry write at its 'K': the sentry may then reuse
// the bytes. A stream that ends without 'E' is a file cut short, dropped.
const RefsProtocol = "cryo-refs/1"

// Bounds of a reference upload's frames.
const (
	// maxRefRanges bounds an R frame's ranges (gVisor offers 256 per
	// write of 1 MiB).
	maxRefRanges = 4096
	// maxRefFrame bounds the bytes one R or D frame names.
	maxRefFrame = MaxRange
	// maxRefFiles bounds the fds one stream may pass.
	maxRefFiles = 64
)

// RefUpload is one checkpoint file streamed as a reference upload.
// Register, Send and SendBytes may be called from one goroutine at a
// time; done callbacks run in order on the upload's own goroutine (those
// of sends after the upload failed, on goroutines of their own).
type RefUpload struct {
	conn *net.UnixConn

	// wmu orders writes to the connection; mu guards pending and broken
	// and is never held across a write, so that acknowledgements are
	// taken while a send waits on a cryo that is still reading.
	wmu     sync.Mutex
	mu      sync.Mutex
	pending []func(error)
	broken  error

	finished chan struct{} // closed when the answer is read
	size     int64
	err      error
	next     uint32
}

// UploadRefs starts a reference upload of the file at path to the
// client's checkpoint session. A cryo that does not serve the protocol
// answers without upgrading: the error then wraps errNoRefs, and Upload
// is the way.
func (c *Client) UploadRefs(ctx context.Context, path string) (*RefUpload, error) {
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unix", c.socket)
	if err != nil {
		return nil, fmt.Errorf("upload %s: %w", path, err)
	}
	conn := nc.(*net.UnixConn)
	req, err := http.NewRequestWithContext(ctx, http.MethodPut, "http://cryo/v1/checkpoints/"+url.PathEscape(c.id)+"/refs/"+path, nil)
	if err != nil {
		conn.Close()
		return nil, err
	}
	req.Header.Set("Connection", "Upgrade")
	req.Header.Set("Upgrade", RefsProtocol)
	if err := req.Write(conn); err != nil {
		conn.Close()
		return nil, fmt.Errorf("upload %s: %w", path, err)
	}
	// The answer's head only: nothing follows a 101 until frames are
	// sent, and other answers are read whole here.
	br := bufio.NewReaderSize(conn, 512)
	resp, err := http.ReadResponse(br, req)
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("upload %s: %w", path, err)
	}
	if resp.StatusCode != http.StatusSwitchingProtocols {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		conn.Close()
		err := fmt.Errorf("upload %s: %s: %s", path, resp.Status, msg)
		switch resp.StatusCode {
		case http.StatusNotFound, http.StatusMethodNotAllowed, http.StatusNotImplemented:
			// A cryo without the route (or without the session: its
			// plain upload says so again).
			err = fmt.Errorf("%w: %w", err, errNoRefs)
		}
		return nil, err
	}
	if br.Buffered() > 0 {
		conn.Close()
		return nil, fmt.Errorf("upload %s: cryo sent %d bytes before any frame", path, br.Buffered())
	}
	u := &RefUpload{conn: conn, finished: make(chan struct{})}
	// A cancelled upload ends its connection, which unblocks a send
	// stuck on a cryo that stopped reading.
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	go func() {
		u.readAnswers()
		stop()
	}()
	return u, nil
}

// errNoRefs is an UploadRefs refused by a cryo that only takes bytes.
var errNoRefs = errors.New("no reference uploads")

// IsNoRefs reports whether err is UploadRefs's refusal by a cryo that
// takes only plain uploads.
func IsNoRefs(err error) bool { return errors.Is(err, errNoRefs) }

// Register passes the fd of a file of size bytes that R frames may name;
// it returns the file's handle. The fd is the caller's still: the
// kernel passes cryo a copy.
func (u *RefUpload) Register(fd int, size uint64) (uint32, error) {
	u.wmu.Lock()
	defer u.wmu.Unlock()
	if err := u.brokenErr(); err != nil {
		return 0, err
	}
	h := u.next
	u.next++
	frame := binary.LittleEndian.AppendUint64(binary.LittleEndian.AppendUint32([]byte{'F'}, h), size)
	if _, _, err := u.conn.WriteMsgUnix(frame, unix.UnixRights(fd), nil); err != nil {
		return 0, u.breakWith(err)
	}
	return h, nil
}

// brokenErr is the error that ended the upload, or nil.
func (u *RefUpload) brokenErr() error {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.broken
}

// breakWith ends the upload with err and returns the upload's error.
func (u *RefUpload) breakWith(err error) error {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.breakLocked(err)
	return u.broken
}

// Send names the bytes at ranges ({offset, length}) of registered file
// handle, in order, as the file's next bytes; done runs once cryo read
// them (or the upload failed).
func (u *RefUpload) Send(handle uint32, ranges [][2]uint64, done func(error)) {
	frame := binary.LittleEndian.AppendUint32(binary.LittleEndian.AppendUint32([]byte{'R'}, handle), uint32(len(ranges)))
	for _, r := range ranges {
		frame = binary.LittleEndian.AppendUint64(binary.LittleEndian.AppendUint64(frame, r[0]), r[1])
	}
	u.send(frame, nil, done)
}

// SendBytes sends p as the file's next bytes; done runs once cryo read
// them. p must stay unchanged until then.
func (u *RefUpload) SendBytes(p []byte, done func(error)) {
	u.send(binary.LittleEndian.AppendUint32([]byte{'D'}, uint32(len(p))), p, done)
}

func (u *RefUpload) send(head, body []byte, done func(error)) {
	// Frames are queued in pending in the order they are written: wmu
	// is held across both.
	u.wmu.Lock()
	defer u.wmu.Unlock()
	u.mu.Lock()
	if u.broken != nil {
		err := u.broken
		u.mu.Unlock()
		go done(err)
		return
	}
	u.pending = append(u.pending, done)
	u.mu.Unlock()
	bufs := net.Buffers{head}
	if len(body) > 0 {
		bufs = append(bufs, body)
	}
	if _, err := bufs.WriteTo(u.conn); err != nil {
		u.breakWith(err)
	}
}

// breakLocked ends the upload with err: pending and later sends fail.
func (u *RefUpload) breakLocked(err error) {
	if u.broken == nil {
		u.broken = fmt.Errorf("reference upload: %w", err)
		u.conn.Close()
	}
}

// readAnswers completes sends at their acknowledgements and records the
// answer to the file.
func (u *RefUpload) readAnswers() {
	defer close(u.finished)
	r := bufio.NewReader(u.conn)
	fail := func(err error) {
		u.mu.Lock()
		u.breakLocked(err)
		pending := u.pending
		u.pending = nil
		u.mu.Unlock()
		for _, done := range pending {
			done(u.broken)
		}
		u.err = u.broken
	}
	for {
		kind, err := r.ReadByte()
		if err != nil {
			fail(fmt.Errorf("the connection ended before cryo answered: %w", err))
			return
		}
		switch kind {
		case 'K':
			u.mu.Lock()
			if len(u.pending) == 0 {
				u.mu.Unlock()
				fail(errors.New("cryo acknowledged a frame not sent"))
				return
			}
			done := u.pending[0]
			u.pending = u.pending[1:]
			u.mu.Unlock()
			done(nil)
		case 'S':
			var b [8]byte
			if _, err := io.ReadFull(r, b[:]); err != nil {
				fail(err)
				return
			}
			u.size = int64(binary.LittleEndian.Uint64(b[:]))
			u.conn.Close()
			return
		case 'X':
			var b [4]byte
			if _, err := io.ReadFull(r, b[:]); err != nil {
				fail(err)
				return
			}
			msg := make([]byte, min(binary.LittleEndian.Uint32(b[:]), 4096))
			io.ReadFull(r, msg)
			// cryo's word is the file's error, even when a write of
			// ours already failed on the connection it closed.
			cerr := fmt.Errorf("reference upload: cryo: %s", msg)
			fail(cerr)
			u.err = cerr
			return
		default:
			fail(fmt.Errorf("cryo sent frame %q", kind))
			return
		}
	}
}

// Finish ends the file and waits until cryo has packed it; it returns
// the size cryo counted.
func (u *RefUpload) Finish() (int64, error) {
	u.wmu.Lock()
	if u.brokenErr() == nil {
		if _, err := u.conn.Write([]byte{'E'}); err != nil {
			u.breakWith(err)
		}
	}
	u.wmu.Unlock()
	<-u.finished
	return u.size, u.err
}

// Abort cuts the stream: cryo drops the file. Pending sends fail.
func (u *RefUpload) Abort() {
	u.mu.Lock()
	u.breakLocked(errors.New("aborted"))
	u.mu.Unlock()
	<-u.finished
}

// serveRefs serves one reference upload on the hijacked conn: the file's
// bytes, read from the frames, go to sink.
func serveRefs(ctx context.Context, conn *net.UnixConn, sink Sink, path string) {
	defer conn.Close()
	// A hijacked connection outlives its server's Close: the request's
	// context ending (Session.Close cancels it) ends the stream.
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	if _, err := conn.Write([]byte("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: " + RefsProtocol + "\r\n\r\n")); err != nil {
		return
	}
	fr := &refReader{conn: conn, files: map[uint32]*os.File{}}
	defer fr.closeFiles()
	cut := cutWhenDone(sink, func() { conn.SetReadDeadline(time.Now()) })
	n, err := sink.AddFile(ctx, path, FileMode, fr)
	cut()
	if err == nil && !fr.ended {
		// A sink that stopped reading before the end took a file cut
		// short: never acknowledged as whole.
		err = errors.New("the file was not read to its end")
	}
	if err != nil {
		msg := []byte(err.Error())
		conn.Write(append(binary.LittleEndian.AppendUint32([]byte{'X'}, uint32(len(msg))), msg...))
		return
	}
	conn.Write(binary.LittleEndian.AppendUint64([]byte{'S'}, uint64(n)))
}

// refReader reads a reference upload's frames as the file's bytes.
type refReader struct {
	conn *net.UnixConn
	// buf holds bytes read from conn, from off; fds the fds received
	// with them, in order.
	buf      []byte
	off, end int
	fds      []int

	files map[uint32]*os.File
	sizes map[uint32]uint64

	// The frame being read: the ranges left of an R frame (of file
	// cur), or the bytes left of a D frame.
	cur    *os.File
	ranges [][2]uint64
	inline int
	ended  bool
	err    error // the first error Read returned
}

// fill reads more of the stream into buf, taking the fds it carries.
func (r *refReader) fill() error {
	if r.buf == nil {
		r.buf = make([]byte, 64<<10)
	}
	if r.off > 0 {
		r.end = copy(r.buf, r.buf[r.off:r.end])
		r.off = 0
	}
	oob := make([]byte, unix.CmsgSpace(4*4))
	n, oobn, flags, _, err := r.conn.ReadMsgUnix(r.buf[r.end:], oob)
	if flags&unix.MSG_CTRUNC != 0 && err == nil {
		err = errors.New("more fds than one frame passes")
	}
	got := 0
	if oobn > 0 {
		msgs, perr := unix.ParseSocketControlMessage(oob[:oobn])
		for _, m := range msgs {
			if fds, ferr := unix.ParseUnixRights(&m); ferr == nil {
				r.fds = append(r.fds, fds...)
				got += len(fds)
			}
		}
		if perr != nil && err == nil {
			err = perr
		}
	}
	r.end += n
	// An F frame's fd comes with the frame's first byte, and a read
	// stops after the bytes that brought fds: one read brings at most
	// one, and at most one more is in hand (that of an F frame whose
	// first byte ended the buffer). More are fds no frame names ('E'
	// checks that none is left).
	if (got > 1 || len(r.fds) > 2) && err == nil {
		err = errors.New("fds passed without their frames")
	}
	if n == 0 && err == nil {
		err = io.ErrUnexpectedEOF
	}
	if err == io.EOF {
		err = io.ErrUnexpectedEOF
	}
	return err
}

// need makes sure n bytes of the stream are buffered.
func (r *refReader) need(n int) error {
	for r.end-r.off < n {
		if err := r.fill(); err != nil {
			return fmt.Errorf("reference upload cut short: %w", err)
		}
	}
	return nil
}

func (r *refReader) u32() uint32 {
	v := binary.LittleEndian.Uint32(r.buf[r.off:])
	r.off += 4
	return v
}

func (r *refReader) u64() uint64 {
	v := binary.LittleEndian.Uint64(r.buf[r.off:])
	r.off += 8
	return v
}

// frame reads the next frame's head; at 'E' it returns io.EOF.
func (r *refReader) frame() error {
	if err := r.need(1); err != nil {
		return err
	}
	kind := r.buf[r.off]
	r.off++
	switch kind {
	case 'E':
		if len(r.fds) > 0 {
			return errors.New("reference upload: fds passed without their frames")
		}
		r.ended = true
		return io.EOF
	case 'F':
		if err := r.need(12); err != nil {
			return err
		}
		h, size := r.u32(), r.u64()
		if len(r.fds) == 0 {
			return errors.New("reference upload: a file frame came without its fd")
		}
		fd := r.fds[0]
		r.fds = r.fds[1:]
		f := os.NewFile(uintptr(fd), fmt.Sprintf("sentry file %d", h))
		if _, ok := r.files[h]; ok || len(r.files) == maxRefFiles {
			f.Close()
			return fmt.Errorf("reference upload: file handle %d passed twice, or more than %d files", h, maxRefFiles)
		}
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG || uint64(st.Size) < size {
			f.Close()
			return fmt.Errorf("reference upload: file %d is not a regular file of at least %d bytes", h, size)
		}
		r.files[h] = f
		if r.sizes == nil {
			r.sizes = map[uint32]uint64{}
		}
		r.sizes[h] = size
		return nil
	case 'R':
		if err := r.need(8); err != nil {
			return err
		}
		h, n := r.u32(), r.u32()
		f, ok := r.files[h]
		if !ok || n == 0 || n > maxRefRanges {
			return fmt.Errorf("reference upload: %d ranges of file handle %d (passed: %v)", n, h, ok)
		}
		if err := r.need(int(16 * n)); err != nil {
			return err
		}
		total := uint64(0)
		r.ranges = r.ranges[:0]
		for range n {
			off, l := r.u64(), r.u64()
			if l == 0 || off+l < off || off+l > r.sizes[h] {
				return fmt.Errorf("reference upload: range [%d,+%d) outside file %d's %d bytes", off, l, h, r.sizes[h])
			}
			if l > maxRefFrame-total {
				return fmt.Errorf("reference upload: a frame of over %d bytes", maxRefFrame)
			}
			total += l
			r.ranges = append(r.ranges, [2]uint64{off, l})
		}
		r.cur = f
		return nil
	case 'D':
		if err := r.need(4); err != nil {
			return err
		}
		n := r.u32()
		if n == 0 || n > maxRefFrame {
			return fmt.Errorf("reference upload: a frame of %d bytes (1 to %d)", n, maxRefFrame)
		}
		r.inline = int(n)
		return nil
	}
	return fmt.Errorf("reference upload: unknown frame %q", kind)
}

// Read implements io.Reader: the file's bytes, frame after frame. Its
// first error is its answer from then on: the stream is out of step.
func (r *refReader) Read(p []byte) (int, error) {
	if r.err != nil {
		return 0, r.err
	}
	n, err := r.read(p)
	if err != nil && err != io.EOF {
		r.err = err
	}
	return n, err
}

func (r *refReader) read(p []byte) (int, error) {
	if r.ended {
		return 0, io.EOF
	}
	for len(r.ranges) == 0 && r.inline == 0 {
		if err := r.frame(); err != nil {
			return 0, err
		}
	}
	n := 0
	if r.inline > 0 {
		if r.off == r.end {
			if err := r.fill(); err != nil {
				return 0, fmt.Errorf("reference upload cut short: %w", err)
			}
		}
		n = copy(p[:min(len(p), r.inline)], r.buf[r.off:r.end])
		r.off += n
		r.inline -= n
	} else {
		rg := &r.ranges[0]
		k, err := r.cur.ReadAt(p[:min(uint64(len(p)), rg[1])], int64(rg[0]))
		if err != nil {
			return 0, fmt.Errorf("reference upload: read the sentry's file at %d: %w", rg[0], err)
		}
		n = k
		rg[0] += uint64(k)
		rg[1] -= uint64(k)
		if rg[1] == 0 {
			r.ranges = r.ranges[1:]
		}
	}
	if len(r.ranges) == 0 && r.inline == 0 {
		if _, err := r.conn.Write([]byte{'K'}); err != nil {
			return n, fmt.Errorf("reference upload: acknowledge: %w", err)
		}
	}
	return n, nil
}

func (r *refReader) closeFiles() {
	for _, f := range r.files {
		f.Close()
	}
	for _, fd := range r.fds {
		unix.Close(fd)
	}
}
