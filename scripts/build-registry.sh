#!/usr/bin/env bash
# Builds bin/registry: the stock CNCF distribution registry, at the version of
# github.com/distribution/distribution/v3 pinned in cryo's go.mod. The
# conformance tests run it to check that cryo's client works with a registry
# that has none of cryo's extensions (no chunk index, no referrers additions).
#
# `go build ./cmd/registry` inside cryo's module would need go.sum entries for
# every storage driver the stock binary links (azure, gcs, ...), which cryo
# does not import; so the binary is built in module mode from distribution's
# own go.mod (`go install pkg@version`), leaving cryo's go.mod and go.sum
# untouched. Idempotent: a second run only checks the version.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN="$REPO/bin"
PKG=github.com/distribution/distribution/v3/cmd/registry

say() { echo "build-registry: $*"; }

want=$(cd "$REPO" && go list -m -f '{{.Version}}' github.com/distribution/distribution/v3)
have=$("$BIN/registry" --version 2>/dev/null | awk '{print $3}' || true)
if [[ "$have" == "$want" || "$have" == "$want+"* ]]; then
	say "bin/registry: $have (up to date)"
	exit 0
fi
say "go install $PKG@$want into bin/ (have: ${have:-none})"
mkdir -p "$BIN"
(cd "$REPO" && GOFLAGS= GOBIN="$BIN" go install "$PKG@$want")
say "bin/registry: $("$BIN/registry" --version | awk '{print $3}')"
