package benchutil

import "testing"

func TestMedianAndSpread(t *testing.T) {
	for _, tc := range []struct {
		v      []float64
		median float64
		spread string
	}{
		{nil, 0, "0.00"},
		{[]float64{3}, 3, "3.00"},
		{[]float64{3, 1, 2}, 2, "2.00 (1.00–3.00)"},
		{[]float64{4, 1, 3, 2}, 2.5, "2.50 (1.00–4.00)"},
	} {
		if got := Median(tc.v); got != tc.median {
			t.Errorf("Median(%v) = %v, want %v", tc.v, got, tc.median)
		}
		if got := Spread(tc.v, "%.2f"); got != tc.spread {
			t.Errorf("Spread(%v) = %q, want %q", tc.v, got, tc.spread)
		}
	}
	v := []float64{4, 1, 3, 2}
	Median(v)
	if v[0] != 4 {
		t.Errorf("Median sorted its argument: %v", v)
	}
	if got := Percentile([]float64{5, 1, 4, 2, 3}, 0.99); got != 4 {
		t.Errorf("Percentile(0.99) = %v, want 4 (nearest rank below)", got)
	}
}
