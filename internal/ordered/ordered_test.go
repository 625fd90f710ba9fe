package ordered

import (
	"context"
	"errors"
	"math/rand/v2"
	"testing"
	"time"
)

func TestMapKeepsOrder(t *testing.T) {
	var got []int
	err := Map(context.Background(), 4, 8,
		func(ctx context.Context, emit func(int) error) error {
			for i := range 200 {
				if err := emit(i); err != nil {
					return err
				}
			}
			return nil
		},
		func(ctx context.Context, i int) (int, error) {
			time.Sleep(time.Duration(rand.IntN(200)) * time.Microsecond)
			return i * i, nil
		},
		func(v int) error { got = append(got, v); return nil })
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 200 {
		t.Fatalf("got %d results, want 200", len(got))
	}
	for i, v := range got {
		if v != i*i {
			t.Fatalf("result %d is %d, want %d", i, v, i*i)
		}
	}
}

func TestMapStopsOnError(t *testing.T) {
	boom := errors.New("boom")
	for _, where := range []string{"produce", "fn", "sink"} {
		t.Run(where, func(t *testing.T) {
			sunk := 0
			err := Map(context.Background(), 3, 6,
				func(ctx context.Context, emit func(int) error) error {
					for i := 0; ; i++ {
						if where == "produce" && i == 50 {
							return boom
						}
						if err := emit(i); err != nil {
							return err
						}
					}
				},
				func(ctx context.Context, i int) (int, error) {
					if where == "fn" && i == 50 {
						return 0, boom
					}
					return i, nil
				},
				func(v int) error {
					if where == "sink" && v == 50 {
						return boom
					}
					sunk++
					return nil
				})
			if !errors.Is(err, boom) {
				t.Fatalf("got %v, want boom", err)
			}
			if sunk > 50 {
				t.Fatalf("sink saw %d results after the failing item", sunk)
			}
		})
	}
}
