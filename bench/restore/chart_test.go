package restore

import (
	"fmt"

	"github.com/cryo-oci/cryo/internal/barchart"
)

// writeChart draws the loopback results as grouped bars: one group per app
// size, one bar per path, height = median seconds until the app runs again.
func writeChart(path string, sizes []int, res map[string][]sample) error {
	c := barchart.Chart{Title: "Time until the restored app runs again (s), loopback, median", Series: paths}
	for _, mib := range sizes {
		c.Groups = append(c.Groups, fmt.Sprintf("%d MiB", mib))
		row := make([]float64, len(paths))
		for pi, p := range paths {
			if s := res[fmt.Sprintf("%d|loopback|%s", mib, p)]; len(s) > 0 {
				row[pi] = med(s, running)
			}
		}
		c.Values = append(c.Values, row)
	}
	return barchart.WritePNG(path, c)
}
