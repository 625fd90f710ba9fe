// Package statefile reads (and, for tests and tools, writes) the metadata
// header of gVisor's checkpoint.img.
//
// The header is written by gVisor's pkg/state/statefile: the 8-byte magic
// "gVisorSF", an 8-byte big-endian length, then that many bytes of a JSON
// object of string keys and string values (runsc_version, _timestamp,
// container_count, ...). Only the header is read, never the state stream
// behind it. It is read by hand because gVisor is not a dependency of cryo's
// module, and the header is a stable, tiny framing.
package statefile

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// Magic starts every gVisor state file.
const Magic = "gVisorSF"

// MaxMetadataSize bounds the JSON header that is read. Real headers are a
// few KiB (they carry the container specs); a larger length is corrupt.
const MaxMetadataSize = 16 << 20

// Metadata keys that cryo records in a snapshot.
const (
	KeyRunscVersion   = "runsc_version"
	KeyTimestamp      = "_timestamp"
	KeyContainerCount = "container_count"
)

// ErrNotStateFile is returned for input that does not start with Magic.
var ErrNotStateFile = errors.New("not a gVisor state file")

// ReadMetadata reads the metadata header at the start of r. It reads the
// header and nothing more: r is left at the state stream behind it.
func ReadMetadata(r io.Reader) (map[string]string, error) {
	var hdr [16]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return nil, fmt.Errorf("read state file header: %w", ErrNotStateFile)
		}
		return nil, fmt.Errorf("read state file header: %w", err)
	}
	if string(hdr[:8]) != Magic {
		return nil, ErrNotStateFile
	}
	n := binary.BigEndian.Uint64(hdr[8:])
	if n > MaxMetadataSize {
		return nil, fmt.Errorf("state file metadata of %d bytes exceeds %d", n, MaxMetadataSize)
	}
	buf := make([]byte, n)
	if _, err := io.ReadFull(r, buf); err != nil {
		return nil, fmt.Errorf("read state file metadata (%d bytes): %w", n, err)
	}
	var md map[string]string
	if err := json.Unmarshal(buf, &md); err != nil {
		return nil, fmt.Errorf("decode state file metadata: %w", err)
	}
	return md, nil
}

// Header returns the header of a state file with metadata md: what
// ReadMetadata reads. The state stream follows it.
func Header(md map[string]string) []byte {
	js, _ := json.Marshal(md) // a map of strings always encodes
	out := append([]byte(Magic), binary.BigEndian.AppendUint64(nil, uint64(len(js)))...)
	return append(out, js...)
}
