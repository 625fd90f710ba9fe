package format

import (
	"errors"

	"github.com/cryo-oci/cryo/format/chunker"
)

// Limits every reader enforces before it trusts or allocates anything.
const (
	// MaxManifestSize is the largest manifest or index accepted, the limit
	// distribution puts on a manifest PUT.
	MaxManifestSize = 4 << 20
	// MaxTableSize is the largest chunk table accepted.
	MaxTableSize = 4 << 20
	// MaxChunksPerPart is the most chunks one file part may hold. With it a
	// part's manifest stays near 1 MiB, well under MaxManifestSize.
	MaxChunksPerPart = 4096
	// MaxChunkSize is the largest uncompressed chunk accepted.
	MaxChunkSize = chunker.MaxChunkSize
	// MaxFiles is the most files a snapshot may hold.
	MaxFiles = 10000
	// MaxParts is the most parts one file may be split into.
	MaxParts = 1 << 16
)

// Errors that callers may test for with errors.Is. Each is wrapped with
// context that names the offending file, chunk or digest.
var (
	// ErrInvalid marks malformed input: a manifest, index or chunk table that
	// breaks a rule of SPEC.md.
	ErrInvalid = errors.New("invalid snapshot")
	// ErrDigestMismatch marks content whose digest or size is not the one
	// recorded for it.
	ErrDigestMismatch = errors.New("digest mismatch")
	// ErrTooLarge marks input over one of the limits above.
	ErrTooLarge = errors.New("over size limit")
	// ErrUnsupported marks input of a kind cryo refuses to pack, such as a
	// symlink or a device file.
	ErrUnsupported = errors.New("unsupported file")
)
