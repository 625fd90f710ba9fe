// Package conformance runs the OCI distribution-spec conformance suite
// against `cryo registry serve` (see conformance_test.go). The suite's runner
// is pinned in the separate module conformance/tools and built into
// bin/oci-conformance by scripts/install-test-deps.sh; the gVisor version
// cryo's tests use is pinned the same way in conformance/gvisor.
package conformance
