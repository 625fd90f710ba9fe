//go:build tools

// Package tools pins the OCI distribution-spec conformance runner that
// cryo's conformance test (conformance/conformance_test.go) runs against
// `cryo registry serve`. It is a separate module so that nothing of the
// runner enters cryo's own go.mod; scripts/build-oci-conformance.sh builds
// it into bin/oci-conformance.
package tools

import _ "github.com/opencontainers/distribution-spec/conformance"
