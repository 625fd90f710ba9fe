package registry

import (
	"io"
	"net/http"
	"time"
)

// Timeouts of the registry's HTTP server.
//
// A request's headers must arrive within ReadHeaderTimeout, and a
// keep-alive connection is closed after IdleTimeout without a request.
// There is no overall read or write timeout (http.Server's ReadTimeout and
// WriteTimeout): they bound a whole request, and a multi-GB blob upload or
// download over a slow link takes longer than any bound that is still
// useful against slow clients. Instead each request gets a stall timeout:
// while a handler reads the body, the client must send something at least
// every StallTimeout; while it writes the response, the client must take
// something at least every StallTimeout (a blob sent with sendfile: a
// stallSegment, 1 MiB, per StallTimeout, 17 KiB/s at the default); a body
// the handler left unread is discarded within StallTimeout. A client that
// stops for longer loses its connection. A steady transfer, however slow
// and long, goes on.
const (
	ReadHeaderTimeout   = 30 * time.Second
	IdleTimeout         = 2 * time.Minute
	DefaultStallTimeout = time.Minute
)

// stallSegment is how much of a response written with ReadFrom (a blob
// sent with sendfile) is sent under one write deadline.
const stallSegment = 1 << 20

// withStallTimeouts applies the per-request stall timeout (see above) to h,
// through http.ResponseController's deadlines.
func withStallTimeouts(h http.Handler, stall time.Duration) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rc := http.NewResponseController(w)
		// A write deadline a previous request on the connection left.
		_ = rc.SetWriteDeadline(time.Time{})
		var body *stallBody
		if r.Body != nil && r.Body != http.NoBody {
			body = &stallBody{ReadCloser: r.Body, rc: rc, stall: stall}
			r.Body = body
		}
		sw := &stallWriter{ResponseWriter: w, rc: rc, stall: stall}
		h.ServeHTTP(sw, r)
		// The server flushes what the handler left buffered, and first
		// discards what is left of a body the handler did not read to its
		// end (up to 256 KiB): both within the stall timeout. A body read to
		// its end has no deadline left (stallBody clears it), for net/http
		// then reads the connection in the background, and a deadline that
		// fired there would cancel the request.
		sw.extend()
		if body != nil && !body.ended {
			_ = rc.SetReadDeadline(time.Now().Add(stall))
		}
	})
}

// stallBody is a request body that gives the client stall to send each
// next piece, and clears the deadline when the body ends.
type stallBody struct {
	io.ReadCloser
	rc    *http.ResponseController
	stall time.Duration
	ended bool // read to io.EOF
}

func (b *stallBody) Read(p []byte) (int, error) {
	_ = b.rc.SetReadDeadline(time.Now().Add(b.stall))
	n, err := b.ReadCloser.Read(p)
	if err == io.EOF {
		b.ended = true
		_ = b.rc.SetReadDeadline(time.Time{})
	}
	return n, err
}

// stallWriter is a ResponseWriter that gives the client stall to take each
// next piece of the response. It keeps the io.ReaderFrom of the writer it
// wraps, so blob downloads still use sendfile, a segment at a time.
type stallWriter struct {
	http.ResponseWriter
	rc    *http.ResponseController
	stall time.Duration
}

func (w *stallWriter) extend() { _ = w.rc.SetWriteDeadline(time.Now().Add(w.stall)) }

func (w *stallWriter) WriteHeader(code int) {
	w.extend()
	w.ResponseWriter.WriteHeader(code)
}

func (w *stallWriter) Write(p []byte) (int, error) {
	w.extend()
	return w.ResponseWriter.Write(p)
}

func (w *stallWriter) Flush() {
	w.extend()
	_ = w.rc.Flush()
}

// ReadFrom sends src in segments, each under a fresh deadline. A source
// that is an io.LimitedReader (http.ServeContent's) is unwrapped, so that
// each segment is one LimitedReader over the file, which sendfile takes.
func (w *stallWriter) ReadFrom(src io.Reader) (int64, error) {
	rf, ok := w.ResponseWriter.(io.ReaderFrom)
	if !ok {
		w.extend()
		return io.Copy(writerOnly{w}, src)
	}
	inner, remaining := src, int64(-1)
	if lr, ok := src.(*io.LimitedReader); ok {
		inner, remaining = lr.R, lr.N
		defer func() { lr.N = remaining }()
	}
	var total int64
	for remaining != 0 {
		seg := int64(stallSegment)
		if remaining > 0 {
			seg = min(seg, remaining)
		}
		w.extend()
		n, err := rf.ReadFrom(&io.LimitedReader{R: inner, N: seg})
		total += n
		if remaining > 0 {
			remaining -= n
		}
		if err != nil || n < seg {
			return total, err
		}
	}
	return total, nil
}

// Unwrap lets http.ResponseController reach the underlying writer.
func (w *stallWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// writerOnly hides a writer's ReadFrom from io.Copy.
type writerOnly struct{ io.Writer }
