// Package registry is cryo's OCI registry: distribution/v3's registry (its
// handlers.App, storage drivers, auth, TLS, pull-through proxy and garbage
// collector, unmodified) behind a thin HTTP shell that adds what distribution
// lacks and cryo needs:
//
//   - the OCI 1.1 referrers API (GET /v2/<name>/referrers/<digest> and the
//     OCI-Subject header on manifest PUT), in referrers.go;
//   - a chunk index from a chunk's uncompressed sha256 to the blobs that
//     carry it, so pushers skip chunks the registry holds in another
//     encoding (/v2/_cryo/chunks/...), in chunkindex.go;
//   - Prometheus metrics and storage statistics (dedup ratio), in metrics.go
//     and stats.go;
//   - garbage collection that keeps the chunk index and referrers true, in
//     gc.go.
//
// The extension state lives in the registry's own storage driver under
// /cryo/v1/, so replicas sharing an object store share it too.
package registry
