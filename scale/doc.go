// Package scale holds cryo's scale-out integration tests, all with real
// processes: registry replicas on SeaweedFS (a distributed S3-compatible
// object store) sharing a redis blob-descriptor cache, configured by what
// the cryo-registry Helm chart renders, garbage collection
// against the shared store, replicas and the store failing mid-flight, and
// regional mirrors in front of a primary. The package has no code of its
// own; `make test` runs it, installing SeaweedFS, redis and the other tools
// first (scripts/install-test-deps.sh).
package scale
