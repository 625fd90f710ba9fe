package transfer

import (
	"net/http"
	"strconv"
	"time"

	"github.com/cryo-oci/cryo/registry/api"
	"oras.land/oras-go/v2/registry/remote/retry"
)

// MaxReadOnlyWait is how long a request keeps retrying while the registry
// answers 503 with Retry-After: a registry in read-only mode for garbage
// collection (SPEC.md 12.4) answers so for as long as the sweep takes.
const MaxReadOnlyWait = 5 * time.Minute

// readOnlyPolicy retries a write answered 503 with Retry-After, every
// min(Retry-After, 5s), for up to MaxReadOnlyWait in all (reads are never
// refused in read-only mode: a puller must fail over to its next endpoint
// at once, not wait); other answers and
// errors are retried as oras-go's DefaultPolicy does (a few times, over a
// few seconds), except a pack composition's answers (SPEC.md 12.2.1). One
// policy serves one request.
type readOnlyPolicy struct {
	waited   time.Duration
	attempts int // of the default policy
}

func newRetryTransport(base http.RoundTripper) *retry.Transport {
	return &retry.Transport{Base: base, Policy: func() retry.Policy { return &readOnlyPolicy{} }}
}

// Retry implements retry.Policy.
func (p *readOnlyPolicy) Retry(_ int, resp *http.Response, err error) (time.Duration, error) {
	if err == nil && resp != nil && resp.StatusCode == http.StatusServiceUnavailable && resp.Request != nil &&
		resp.Request.Method != http.MethodGet && resp.Request.Method != http.MethodHead {
		if v := resp.Header.Get("Retry-After"); v != "" {
			if p.waited >= MaxReadOnlyWait {
				return -1, nil
			}
			d := 5 * time.Second
			if s, err := strconv.Atoi(v); err == nil && s >= 0 && time.Duration(s)*time.Second < d {
				d = max(time.Duration(s)*time.Second, 200*time.Millisecond)
			}
			p.waited += d
			return d, nil
		}
	}
	if resp != nil && resp.Request != nil && resp.Request.URL.Path == api.PacksPath {
		// A composition only saves an upload: when it fails, the pack
		// is uploaded at once rather than after a backoff.
		return -1, nil
	}
	d, rerr := retry.DefaultPolicy.Retry(p.attempts, resp, err)
	p.attempts++
	return d, rerr
}
