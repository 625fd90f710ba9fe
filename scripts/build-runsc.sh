#!/usr/bin/env bash
# Builds bin/runsc from the gVisor version pinned in conformance/gvisor
# (a separate Go module, so nothing of gVisor enters cryo's own go.mod).
#
#   scripts/build-runsc.sh          build bin/runsc and write bin/.runsc.stamp
#   scripts/build-runsc.sh --stamp  print the stamp the current inputs give
#
# Two build flags matter:
#   CGO_ENABLED=0  runsc must be static: after pivot_root into its empty
#                  chroot the sandbox and the gofer re-exec /proc/self/exe,
#                  and a dynamically linked runsc fails there with ENOENT
#                  (no ld-linux in the chroot): "error executing umounter:
#                  fork/exec /proc/self/exe: no such file or directory".
#   -X gvisor.dev/gvisor/runsc/version.version=<pinned module version>
#                  a plain `go build` reports "VERSION_MISSING", which ends up
#                  as runsc_version in every checkpoint and makes restore's
#                  version check meaningless.
#
# The stamp is the sha256 of conformance/gvisor/go.mod, go.sum and this
# script: scripts/install-test-deps.sh rebuilds when it changes.
set -euo pipefail

SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
REPO=$(cd "$(dirname "$SELF")/.." && pwd)
TOOLS="$REPO/conformance/gvisor"
BIN="$REPO/bin"

stamp() {
	cat "$TOOLS/go.mod" "$TOOLS/go.sum" "$SELF" | sha256sum | cut -d' ' -f1
}

if [[ "${1:-}" == "--stamp" ]]; then
	stamp
	exit 0
fi

cd "$TOOLS"
VERSION=$(go list -m -f '{{.Version}}' gvisor.dev/gvisor)
mkdir -p "$BIN"
echo "build-runsc: building gvisor.dev/gvisor/runsc@$VERSION into $BIN/runsc"
CGO_ENABLED=0 go build \
	-ldflags "-X gvisor.dev/gvisor/runsc/version.version=$VERSION" \
	-o "$BIN/runsc.tmp" gvisor.dev/gvisor/runsc
mv -f "$BIN/runsc.tmp" "$BIN/runsc"
stamp >"$BIN/.runsc.stamp"
echo "build-runsc: $("$BIN/runsc" --version | head -n1)"
