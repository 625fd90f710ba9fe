package barchart

import (
	"image/png"
	"os"
	"path/filepath"
	"testing"
)

func TestWritePNG(t *testing.T) {
	path := filepath.Join(t.TempDir(), "c.png")
	c := Chart{Title: "t", Groups: []string{"a", "b"}, Series: []string{"x", "y"}, Values: [][]float64{{1, 2}, {3, 0}}}
	if err := WritePNG(path, c); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatal(err)
	}
	// The tallest bar (group b, series x) reaches the top of the plot area
	// in the first series' colour; the zero bar draws nothing.
	groupW := (900 - 60 - 20) / 2
	x := 60 + groupW + 2
	if r, g, b, _ := img.At(x, 42).RGBA(); r>>8 != 0x4e || g>>8 != 0x79 || b>>8 != 0xa7 {
		t.Errorf("top of the tallest bar at (%d,42) is %x %x %x", x, r>>8, g>>8, b>>8)
	}
	c.Series = make([]string, 7)
	if err := WritePNG(path, c); err == nil {
		t.Error("7 series accepted; the palette has 6")
	}
}
