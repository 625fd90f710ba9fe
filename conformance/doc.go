// Package conformance checks cryo against real third-party software, as
// tests only: the OCI distribution-spec conformance suite run against
// `cryo registry serve` (conformance_test.go), and interoperability with the
// oras CLI, the stock distribution registry and runsc (interop_test.go).
//
// The third-party versions are pinned in separate Go modules so that nothing
// of them enters cryo's own go.mod: conformance/tools pins the conformance
// runner (built into bin/oci-conformance by scripts/build-oci-conformance.sh),
// conformance/gvisor the gVisor release runsc is built from
// (scripts/build-runsc.sh). scripts/install-test-deps.sh builds both.
package conformance
