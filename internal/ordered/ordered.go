// Package ordered runs work on a stream of items in parallel and hands the
// results on in the order the items came. Pack and unpack use it to compress,
// hash and fetch chunks on every core while writing files and tables in order.
package ordered

import (
	"context"

	"golang.org/x/sync/errgroup"
)

type result[R any] struct {
	v   R
	err error
}

type job[T, R any] struct {
	item T
	res  chan result[R]
}

// Map calls produce, which emits items; runs fn on each item on up to workers
// goroutines; and calls sink with the results one at a time, in emit order.
// At most window items are in flight, which bounds memory. The first error
// from produce, fn or sink cancels the rest and is returned.
func Map[T, R any](ctx context.Context, workers, window int,
	produce func(ctx context.Context, emit func(T) error) error,
	fn func(ctx context.Context, item T) (R, error),
	sink func(R) error,
) error {
	workers = max(workers, 1)
	window = max(window, workers)
	g, ctx := errgroup.WithContext(ctx)
	jobs := make(chan job[T, R], window)
	queue := make(chan chan result[R], window)
	g.Go(func() error {
		defer close(jobs)
		defer close(queue)
		return produce(ctx, func(item T) error {
			res := make(chan result[R], 1)
			select {
			case queue <- res:
			case <-ctx.Done():
				return context.Cause(ctx)
			}
			select {
			case jobs <- job[T, R]{item, res}:
				return nil
			case <-ctx.Done():
				return context.Cause(ctx)
			}
		})
	})
	for range workers {
		g.Go(func() error {
			for j := range jobs {
				if err := ctx.Err(); err != nil {
					j.res <- result[R]{err: err}
					continue
				}
				v, err := fn(ctx, j.item)
				j.res <- result[R]{v, err}
			}
			return nil
		})
	}
	g.Go(func() error {
		for res := range queue {
			var r result[R]
			select {
			case r = <-res:
			case <-ctx.Done():
				return context.Cause(ctx)
			}
			if r.err != nil {
				return r.err
			}
			if err := sink(r.v); err != nil {
				return err
			}
		}
		return nil
	})
	return g.Wait()
}
