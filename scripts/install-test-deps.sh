#!/usr/bin/env bash
# Installs what cryo's tests need on a fresh machine (Debian, root, Go):
#   - fuse3, python3 and redis-server from apt (apt-get update runs once,
#     only if a package is missing),
#   - bin/helm: Helm 3 at HELM_VERSION, for the chart tests,
#   - bin/weed: SeaweedFS, for the registry-replicas tests, built by
#     scripts/build-weed.sh,
#   - bin/oras: the oras CLI at ORAS_VERSION,
#   - bin/runsc: built from the gVisor version pinned in conformance/gvisor
#     by scripts/build-runsc.sh, rebuilt when bin/.runsc.stamp is stale,
#   - bin/oci-conformance: the OCI distribution-spec conformance runner pinned
#     in conformance/tools, built by scripts/build-oci-conformance.sh, rebuilt
#     when bin/.oci-conformance.stamp is stale.
# Idempotent: a second run only checks. bin/ is git-ignored.
set -euo pipefail

ORAS_VERSION=1.3.6
HELM_VERSION=3.22.0
APT_PACKAGES=(fuse3 python3 redis-server)

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN="$REPO/bin"

say() { echo "install-test-deps: $*"; }

# --- apt packages -----------------------------------------------------------
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
	if dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed'; then
		say "$pkg: installed"
	else
		missing+=("$pkg")
	fi
done
if ((${#missing[@]})); then
	SUDO=()
	if [[ $(id -u) -ne 0 ]]; then SUDO=(sudo); fi
	say "apt-get update (missing: ${missing[*]})"
	"${SUDO[@]}" apt-get update -qq
	say "apt-get install ${missing[*]}"
	DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

mkdir -p "$BIN"

# --- oras -------------------------------------------------------------------
oras_version() { "$BIN/oras" version 2>/dev/null | awk '$1 == "Version:" {print $2}'; }
have=$(oras_version || true)
if [[ "$have" == "$ORAS_VERSION" || "$have" == "$ORAS_VERSION+"* ]]; then
	say "bin/oras: $have"
else
	say "go install oras.land/oras/cmd/oras@v$ORAS_VERSION into bin/ (have: ${have:-none})"
	GOBIN="$BIN" go install "oras.land/oras/cmd/oras@v$ORAS_VERSION"
	say "bin/oras: $(oras_version)"
fi

# --- helm -------------------------------------------------------------------
# A go-installed helm reports only v3.NN itself; its module version is exact.
helm_version() { go version -m "$BIN/helm" 2>/dev/null | awk '$1 == "mod" && $2 == "helm.sh/helm/v3" {print $3}'; }
have=$(helm_version || true)
if [[ "$have" == "v$HELM_VERSION" ]]; then
	say "bin/helm: $have"
else
	say "go install helm.sh/helm/v3/cmd/helm@v$HELM_VERSION into bin/ (have: ${have:-none})"
	GOBIN="$BIN" GOFLAGS= go install "helm.sh/helm/v3/cmd/helm@v$HELM_VERSION"
	say "bin/helm: $(helm_version)"
fi

# --- SeaweedFS --------------------------------------------------------------
"$REPO/scripts/build-weed.sh"

# --- staticcheck ------------------------------------------------------------
if [[ -x "$BIN/staticcheck" ]] && "$BIN/staticcheck" -version 2>/dev/null | grep -q "(0.8.2)"; then
	say "bin/staticcheck: $("$BIN/staticcheck" -version)"
else
	say "go install honnef.co/go/tools/cmd/staticcheck@v0.8.2 into bin/"
	GOBIN="$BIN" go install honnef.co/go/tools/cmd/staticcheck@v0.8.2
fi

# --- runsc ------------------------------------------------------------------
want=$("$REPO/scripts/build-runsc.sh" --stamp)
have=$(cat "$BIN/.runsc.stamp" 2>/dev/null || true)
if [[ -x "$BIN/runsc" && "$have" == "$want" ]]; then
	say "bin/runsc: $("$BIN/runsc" --version | head -n1) (up to date)"
else
	say "building bin/runsc (stamp ${have:-none} != $want)"
	"$REPO/scripts/build-runsc.sh"
fi

# --- oci-conformance --------------------------------------------------------
want=$("$REPO/scripts/build-oci-conformance.sh" --stamp)
have=$(cat "$BIN/.oci-conformance.stamp" 2>/dev/null || true)
if [[ -x "$BIN/oci-conformance" && "$have" == "$want" ]]; then
	say "bin/oci-conformance: $(go version -m "$BIN/oci-conformance" | awk '$1 == "mod" {print $3}') (up to date)"
else
	say "building bin/oci-conformance (stamp ${have:-none} != $want)"
	"$REPO/scripts/build-oci-conformance.sh"
fi

# --- registry (stock distribution, for the interop tests) --------------------
"$REPO/scripts/build-registry.sh"
