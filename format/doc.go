// Package format defines cryo's snapshot format: how a gVisor checkpoint
// image dir becomes an OCI artifact of per-file chunk tables and
// content-addressed chunk blobs, and back.
//
// The format is specified in SPEC.md at the top of the repository. This
// package holds its types and limits (media types, chunk tables, the snapshot
// index), the chunk encodings (zero, raw, zstd), Pack and Unpack against any
// oras-go content store, verification, and random access into a file's
// chunks. It does no networking of its own: give it a registry-backed store to
// talk to a registry.
package format
