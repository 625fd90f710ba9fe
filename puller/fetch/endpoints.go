package fetch

import (
	"context"
	"errors"
	"fmt"
	"strings"
)

// ErrNoEndpoints is FirstOf's error for an empty list of endpoints.
var ErrNoEndpoints = errors.New("no endpoints")

// FirstOf calls try with each endpoint in order and returns the first
// success: the failover every fetch of a snapshot's objects goes through
// (mirrors first, then the primary). try must verify what it returns, so
// that a bad endpoint's answer counts as its failure and the next one is
// asked. Otherwise FirstOf returns the error of every endpoint tried, each
// prefixed with the endpoint's name (errors.Is and errors.As see each). It
// stops early when ctx is done.
func FirstOf[T any](ctx context.Context, eps []Endpoint, try func(context.Context, Endpoint) (T, error)) (T, error) {
	var zero T
	if len(eps) == 0 {
		return zero, ErrNoEndpoints
	}
	errs := make(endpointErrors, 0, len(eps))
	for _, ep := range eps {
		v, err := try(ctx, ep)
		if err == nil {
			return v, nil
		}
		errs = append(errs, fmt.Errorf("%s: %w", ep.Name, err))
		if ctx.Err() != nil {
			break
		}
	}
	return zero, errs
}

// endpointErrors are the errors of one round of failover, one per endpoint
// tried (each prefixed with its name); errors.Is sees each of them.
type endpointErrors []error

func (e endpointErrors) Error() string {
	msgs := make([]string, len(e))
	for i, err := range e {
		msgs[i] = err.Error()
	}
	return strings.Join(msgs, "; ")
}

func (e endpointErrors) Unwrap() []error { return e }
