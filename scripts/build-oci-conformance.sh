#!/usr/bin/env bash
# Builds bin/oci-conformance, the OCI distribution-spec conformance runner,
# from the version pinned in conformance/tools (a separate Go module, so
# nothing of the runner enters cryo's own go.mod).
#
#   scripts/build-oci-conformance.sh          build bin/oci-conformance and
#                                             write bin/.oci-conformance.stamp
#   scripts/build-oci-conformance.sh --stamp  print the stamp the current
#                                             inputs give
#
# -X main.Version=<pinned module version>: built from the module cache the
# runner has no VCS information, and its reports (report.html, junit.xml)
# would name the conformance commit "unknown".
#
# The stamp is the sha256 of conformance/tools/go.mod, go.sum and this
# script: scripts/install-test-deps.sh rebuilds when it changes.
set -euo pipefail

SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
REPO=$(cd "$(dirname "$SELF")/.." && pwd)
TOOLS="$REPO/conformance/tools"
BIN="$REPO/bin"
PKG=github.com/opencontainers/distribution-spec/conformance

stamp() {
	cat "$TOOLS/go.mod" "$TOOLS/go.sum" "$SELF" | sha256sum | cut -d' ' -f1
}

if [[ "${1:-}" == "--stamp" ]]; then
	stamp
	exit 0
fi

cd "$TOOLS"
VERSION=$(go list -m -f '{{.Version}}' "$PKG")
mkdir -p "$BIN"
echo "build-oci-conformance: building $PKG@$VERSION into $BIN/oci-conformance"
CGO_ENABLED=0 go build -ldflags "-X main.Version=$VERSION" -o "$BIN/oci-conformance.tmp" "$PKG"
mv -f "$BIN/oci-conformance.tmp" "$BIN/oci-conformance"
stamp >"$BIN/.oci-conformance.stamp"
echo "build-oci-conformance: bin/oci-conformance ($VERSION)"
