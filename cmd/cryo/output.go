package main

import (
	"encoding/json"
	"fmt"
	"io"

	"github.com/cryo-oci/cryo/internal/progress"
)

// humanBytes formats n bytes with a binary unit.
func humanBytes(n int64) string { return progress.Bytes(n) }

// percent formats part/whole as a percentage.
func percent(part, whole int64) string {
	if whole == 0 {
		return "-"
	}
	return fmt.Sprintf("%.1f%%", 100*float64(part)/float64(whole))
}

// writeJSON writes v as indented JSON.
func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
