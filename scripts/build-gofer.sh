#!/usr/bin/env bash
# Builds cryo's gVisor checkpoint gofer into bin/cryo-gofer/checkpointgofer,
# from module checkpointgofer (cryo's puller packages + the gVisor version
# pinned in conformance/gvisor, which runsc is built from: the gofer
# protocol is internal to one gVisor release). Its own dir, never
# gvisor-bin/ beside runsc (that would replace gVisor's own gofer for every
# sandbox): cryo restore points runsc at it with GVISOR_SIDECAR_BINARIES_DIR.
#
# Same build flags as scripts/build-runsc.sh: static, and the release label
# runsc reports, which the gofer compares with GVISOR_ENFORCE_RELEASE.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN="$REPO/bin"
VERSION=$(cd "$REPO/conformance/gvisor" && go list -m -f '{{.Version}}' gvisor.dev/gvisor)
GOFER_VERSION=$(cd "$REPO/checkpointgofer" && go list -m -f '{{.Version}}' gvisor.dev/gvisor)
if [[ "$VERSION" != "$GOFER_VERSION" ]]; then
	echo "build-gofer: checkpointgofer/go.mod pins gVisor $GOFER_VERSION, runsc is built from $VERSION (conformance/gvisor): make them the same" >&2
	exit 1
fi
mkdir -p "$BIN/cryo-gofer"
cd "$REPO/checkpointgofer"
CGO_ENABLED=0 go build \
	-ldflags "-X gvisor.dev/gvisor/runsc/version.version=$VERSION" \
	-o "$BIN/cryo-gofer/checkpointgofer.tmp" .
mv -f "$BIN/cryo-gofer/checkpointgofer.tmp" "$BIN/cryo-gofer/checkpointgofer"
