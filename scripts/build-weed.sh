#!/usr/bin/env bash
# Builds bin/weed: SeaweedFS (master, volume, filer and S3 gateway in one
# binary), the distributed object store the scale tests run cryo's registry
# replicas on. From the Go module proxy, at WEED_VERSION.
#
# `go install github.com/seaweedfs/seaweedfs/weed@version` is refused because
# SeaweedFS's go.mod has a replace directive, so the module is downloaded
# (verified against the checksum database like any module) and built inside
# its own module directory, with its own go.mod and go.sum. Idempotent: a
# second run only checks the stamp. --stamp prints the stamp and exits.
set -euo pipefail

WEED_VERSION=v0.0.0-20261109003541-7506e5f91cd6
MODULE=github.com/seaweedfs/seaweedfs

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN="$REPO/bin"
STAMP="$BIN/.weed.stamp"

if [[ "${1:-}" == "--stamp" ]]; then
	echo "$MODULE@$WEED_VERSION"
	exit 0
fi

say() { echo "build-weed: $*"; }

if [[ -x "$BIN/weed" && "$(cat "$STAMP" 2>/dev/null)" == "$MODULE@$WEED_VERSION" ]]; then
	say "bin/weed: $MODULE@$WEED_VERSION (up to date)"
	exit 0
fi
say "downloading $MODULE@$WEED_VERSION"
dir=$(cd /tmp && GOFLAGS= go mod download -json "$MODULE@$WEED_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
if [[ -z "$dir" || ! -d "$dir/weed" ]]; then
	say "no module directory for $MODULE@$WEED_VERSION"
	exit 1
fi
say "building bin/weed (a few minutes on 2 cores)"
mkdir -p "$BIN"
(cd "$dir" && GOFLAGS=-mod=readonly CGO_ENABLED=0 go build -trimpath -o "$BIN/weed.tmp" ./weed)
mv "$BIN/weed.tmp" "$BIN/weed"
echo "$MODULE@$WEED_VERSION" >"$STAMP"
say "bin/weed: $("$BIN/weed" version 2>/dev/null | head -n1)"
