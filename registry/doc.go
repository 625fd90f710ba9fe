// Package registry is cryo's OCI registry: distribution/v3's registry (its
// handlers.App, storage drivers, auth, TLS, pull-through proxy and garbage
// collector, unmodified) extended through distribution's own extension
// points with what distribution lacks and cryo needs.
//
// The shell in this package wires them:
//
//   - a registry middleware (extensions.go) through which the app hands
//     over its namespace and driver and every manifest it stores or deletes
//     is recorded, whatever request stored it;
//   - explicit routes for cryo's endpoints (the chunk index lookups, the
//     referrers API, health), sendfile for filesystem blobs and single
//     fetches for a mirror's first requests (blobs.go, mirror.go);
//     everything else goes to distribution's app untouched;
//   - authorization of those endpoints with the access controller
//     distribution builds from the same configuration;
//   - read-only refusal of writes during maintenance, stall timeouts,
//     Prometheus metrics and storage statistics.
//
// The jobs live in sub-packages, each over the storage driver:
// chunkindex (chunk digest to verified blobs), referrers (OCI 1.1
// referrers), maintenance (gc, read-only lease, redis cache flush), and
// extstore and distlayout (what they share about cryo's and distribution's
// storage layouts). Extension state lives in the registry's own storage
// driver under /cryo/v1/, so replicas sharing an object store share it too.
package registry
