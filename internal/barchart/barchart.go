// Package barchart draws grouped bar charts as PNG files for the benchmark
// reports in docs/benchmarks.md.
//
// Drawn with the standard image packages and x/image's basic font: a chart
// library would be a large dependency for a few rectangles and labels.
package barchart

import (
	"fmt"
	"image"
	"image/color"
	"image/draw"
	"image/png"
	"os"

	"golang.org/x/image/font"
	"golang.org/x/image/font/basicfont"
	"golang.org/x/image/math/fixed"
)

// Chart is a grouped bar chart: one group of bars per entry of Groups, one
// bar per entry of Series in each group.
type Chart struct {
	// Title is drawn above the bars.
	Title string
	// Groups label the groups along the x axis; Series name the bars of a
	// group (the legend).
	Groups, Series []string
	// Values[g][s] is the height of series s in group g.
	Values [][]float64
	// Format prints a bar's value above it (default "%.2f").
	Format string
}

var palette = []color.RGBA{
	{0x4e, 0x79, 0xa7, 255}, {0xa0, 0xcb, 0xe8, 255}, {0xe1, 0x57, 0x59, 255},
	{0x59, 0xa1, 0x4f, 255}, {0x8c, 0xd1, 0x7d, 255}, {0xf2, 0x8e, 0x2b, 255},
}

// WritePNG draws c into a PNG file at path.
func WritePNG(path string, c Chart) error {
	if len(c.Series) > len(palette) {
		return fmt.Errorf("barchart: %d series, at most %d", len(c.Series), len(palette))
	}
	if c.Format == "" {
		c.Format = "%.2f"
	}
	const w, h, left, bottom, top = 900, 420, 60, 60, 40
	img := image.NewRGBA(image.Rect(0, 0, w, h))
	draw.Draw(img, img.Bounds(), image.White, image.Point{}, draw.Src)
	maxV := 0.0
	for _, g := range c.Values {
		for _, v := range g {
			maxV = max(maxV, v)
		}
	}
	if maxV == 0 {
		maxV = 1
	}
	text := func(x, y int, s string) {
		d := font.Drawer{Dst: img, Src: image.Black, Face: basicfont.Face7x13, Dot: fixed.P(x, y)}
		d.DrawString(s)
	}
	text(left, 20, c.Title)
	plotH := h - top - bottom
	groupW := (w - left - 20) / max(1, len(c.Groups))
	barW := groupW / (len(c.Series) + 1)
	for gi, group := range c.Groups {
		for si := range c.Series {
			v := 0.0
			if gi < len(c.Values) && si < len(c.Values[gi]) {
				v = c.Values[gi][si]
			}
			bh := int(float64(plotH) * v / maxV)
			x0 := left + gi*groupW + si*barW
			draw.Draw(img, image.Rect(x0, h-bottom-bh, x0+barW-4, h-bottom), &image.Uniform{palette[si]}, image.Point{}, draw.Src)
			text(x0, h-bottom-bh-4, fmt.Sprintf(c.Format, v))
		}
		text(left+gi*groupW, h-bottom+16, group)
	}
	draw.Draw(img, image.Rect(left-2, top, left, h-bottom), image.Black, image.Point{}, draw.Src)
	draw.Draw(img, image.Rect(left-2, h-bottom, w-20, h-bottom+2), image.Black, image.Point{}, draw.Src)
	for si, s := range c.Series {
		x := left + (si%3)*280
		y := h - 22 + (si/3)*14 - 10
		draw.Draw(img, image.Rect(x, y-9, x+10, y+1), &image.Uniform{palette[si]}, image.Point{}, draw.Src)
		text(x+14, y, s)
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := png.Encode(f, img); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
