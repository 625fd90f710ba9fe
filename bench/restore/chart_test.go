package restore

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

// writeChart draws the loopback results as grouped bars: one group per app
// size, one bar per path, height = median seconds until the app runs again.
// Drawn with the standard image packages and x/image's basic font: a chart
// library would be a large dependency for six rectangles and some labels.
func writeChart(path string, sizes []int, res map[string][]sample) error {
	const w, h, left, bottom, top = 900, 420, 60, 60, 40
	img := image.NewRGBA(image.Rect(0, 0, w, h))
	draw.Draw(img, img.Bounds(), image.White, image.Point{}, draw.Src)
	colors := []color.RGBA{{0x4e, 0x79, 0xa7, 255}, {0xa0, 0xcb, 0xe8, 255}, {0xe1, 0x57, 0x59, 255}, {0x59, 0xa1, 0x4f, 255}, {0x8c, 0xd1, 0x7d, 255}}
	maxV := 0.0
	val := func(mib int, p string) float64 {
		s := res[fmt.Sprintf("%d|loopback|%s", mib, p)]
		if len(s) == 0 {
			return 0
		}
		return med(s, running)
	}
	for _, mib := range sizes {
		for _, p := range paths {
			maxV = max(maxV, val(mib, p))
		}
	}
	if maxV == 0 {
		maxV = 1
	}
	text := func(x, y int, s string) {
		d := font.Drawer{Dst: img, Src: image.Black, Face: basicfont.Face7x13, Dot: fixed.P(x, y)}
		d.DrawString(s)
	}
	text(left, 20, "Time until the restored app runs again (s), loopback, median")
	plotH := h - top - bottom
	groupW := (w - left - 20) / max(1, len(sizes))
	barW := groupW / (len(paths) + 1)
	for gi, mib := range sizes {
		for pi, p := range paths {
			v := val(mib, p)
			bh := int(float64(plotH) * v / maxV)
			x0 := left + gi*groupW + pi*barW
			draw.Draw(img, image.Rect(x0, h-bottom-bh, x0+barW-4, h-bottom), &image.Uniform{colors[pi]}, image.Point{}, draw.Src)
			text(x0, h-bottom-bh-4, fmt.Sprintf("%.2f", v))
		}
		text(left+gi*groupW+groupW/3, h-bottom+16, fmt.Sprintf("%d MiB", mib))
	}
	draw.Draw(img, image.Rect(left-2, top, left, h-bottom), image.Black, image.Point{}, draw.Src)
	draw.Draw(img, image.Rect(left-2, h-bottom, w-20, h-bottom+2), image.Black, image.Point{}, draw.Src)
	for pi, p := range paths {
		x := left + (pi%3)*280
		y := h - 22 + (pi/3)*14 - 10
		draw.Draw(img, image.Rect(x, y-9, x+10, y+1), &image.Uniform{colors[pi]}, image.Point{}, draw.Src)
		text(x+14, y, p)
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
