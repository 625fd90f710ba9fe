package fetch

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/cryo-oci/cryo/format"
)

// TestFirstOf checks the failover every fetch goes through: endpoints
// asked in order until one succeeds, every failure reported by endpoint
// name (errors.Is sees each), and no endpoint asked once ctx is done.
func TestFirstOf(t *testing.T) {
	eps := []Endpoint{{Name: "mirror-a"}, {Name: "mirror-b"}, {Name: "primary"}}
	errDown := errors.New("connection refused")
	fails := map[string]error{"mirror-a": errDown, "mirror-b": format.ErrDigestMismatch}
	var asked []string
	try := func(_ context.Context, ep Endpoint) (string, error) {
		asked = append(asked, ep.Name)
		if err := fails[ep.Name]; err != nil {
			return "", err
		}
		return "bytes from " + ep.Name, nil
	}

	got, err := FirstOf(context.Background(), eps, try)
	if err != nil || got != "bytes from primary" || !slices.Equal(asked, []string{"mirror-a", "mirror-b", "primary"}) {
		t.Fatalf("got %q, %v after asking %v; want the primary's bytes after both mirrors", got, err, asked)
	}

	fails["primary"] = errDown
	asked = nil
	_, err = FirstOf(context.Background(), eps, try)
	want := "mirror-a: connection refused; mirror-b: digest mismatch; primary: connection refused"
	if err == nil || err.Error() != want || !errors.Is(err, errDown) || !errors.Is(err, format.ErrDigestMismatch) {
		t.Fatalf("every endpoint failing: %v; want %q, wrapping each error", err, want)
	}

	ctx, cancel := context.WithCancel(context.Background())
	asked = nil
	_, err = FirstOf(ctx, eps, func(ctx context.Context, ep Endpoint) (string, error) {
		asked = append(asked, ep.Name)
		cancel()
		return "", ctx.Err()
	})
	if !errors.Is(err, context.Canceled) || !slices.Equal(asked, []string{"mirror-a"}) {
		t.Fatalf("canceled during the first endpoint: %v after asking %v; want only mirror-a asked", err, asked)
	}

	if _, err := FirstOf(context.Background(), nil, try); !errors.Is(err, ErrNoEndpoints) {
		t.Fatalf("no endpoints: %v, want ErrNoEndpoints", err)
	}
}
