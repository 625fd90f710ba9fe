package main

import (
	"encoding/json"
	"fmt"
	"io"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/progress"
	"github.com/cryo-oci/cryo/transfer"
	"github.com/spf13/cobra"
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

// formatOptions are the flags that choose what a push, pack or checkpoint
// writes: the format version and, for v2, the snapshot whose packs it
// reuses.
type formatOptions struct {
	version     string
	base        string
	noBase      bool
	plainTables bool
}

// register adds --format (and, if withBase, --base and --no-base).
func (o *formatOptions) register(cmd *cobra.Command, withBase bool) {
	cmd.Flags().StringVar(&o.version, "format", "v2", `snapshot format: v2 (64 KiB chunks in 4 MiB packs read by byte range: a second checkpoint of the same app stores little more than what changed) or v1 (a blob per 1 MiB chunk: for pullers of a cryo older than format v2, which refuse v2)`)
	if withBase {
		cmd.Flags().StringVar(&o.base, "base", "", "v2: tag or digest of an earlier v2 snapshot in the same repository whose packs the new one may reference (default: what the tag pushed to names now, else the v2 snapshot the registry stored last in the repository, else the newest v2 snapshot among its last 16 tags)")
		cmd.Flags().BoolVar(&o.noBase, "no-base", false, "v2: reference no earlier snapshot's packs; store every chunk anew")
	}
	cmd.Flags().BoolVar(&o.plainTables, "plain-tables", false, "v2: store chunk tables as plain JSON, not zstd-compressed: about 4x the table bytes, but the tables' and manifests' digests depend on no compressor (chunks stored zstd-encoded still do; SPEC.md 15.3)")
}

// pack returns the packing options the flags give.
func (o *formatOptions) pack(concurrency int) (format.PackOptions, error) {
	v, err := format.ParseVersion(o.version)
	if err != nil {
		return format.PackOptions{}, fmt.Errorf("--format: %w", err)
	}
	if o.plainTables && v != format.V2 {
		return format.PackOptions{}, fmt.Errorf("--plain-tables needs --format v2 (v1 tables are plain JSON)")
	}
	return format.PackOptions{Concurrency: concurrency, Format: v, PlainTables: o.plainTables}, nil
}

// push returns the push options the flags give.
func (o *formatOptions) push(concurrency int, noChunkIndex bool) (transfer.PushOptions, error) {
	popts, err := o.pack(concurrency)
	if err != nil {
		return transfer.PushOptions{}, err
	}
	if popts.Format != format.V2 && (o.base != "" || o.noBase) {
		return transfer.PushOptions{}, fmt.Errorf("--base and --no-base need --format v2")
	}
	return transfer.PushOptions{Pack: popts, NoChunkIndex: noChunkIndex, Base: o.base, NoBase: o.noBase}, nil
}
