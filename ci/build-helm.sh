#!/usr/bin/env bash
# Build the helm CLI, which renders gpu-operator Helm values into a ClusterPolicy, from its Go
# module into a cache outside the repo (like build-actionlint.sh). Helm's module keeps its own
# go.mod (its Kubernetes libraries are newer than the fleet's in ci/go.mod), so it is built with
# `go install module@version`. The directory is keyed by the pinned version and this script's
# hash, so a warm run builds nothing. Prints the binary's path on stdout; progress goes to stderr.
set -euo pipefail
# Pinned: the newest v3 release the module proxy serves that builds with Go 1.26.
VERSION=v3.22.0
sum=$(sha256sum "$0" | cut -c1-12)
cache=${GPUCANARY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpucanary}
out="$cache/bin/helm-$VERSION-$sum"

if [ -f "$out/.complete" ]; then
  echo "helm $VERSION up to date in $out" >&2
  echo "$out/helm"; exit 0
fi
export GOTOOLCHAIN=local CGO_ENABLED=0
tmp="$out.partial"
rm -rf "$tmp"; mkdir -p "$tmp"
start=$(date +%s)
echo "building helm $VERSION" >&2
# The version stamp is what `helm version` prints; unstamped it would say only the minor.
GOBIN="$tmp" go install -trimpath \
  -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean" \
  "helm.sh/helm/v3/cmd/helm@$VERSION"
[ -x "$tmp/helm" ] || { echo "build produced no helm" >&2; exit 1; }
echo "built in $(( $(date +%s) - start ))s" >&2
rm -rf "$out"; mv "$tmp" "$out"; touch "$out/.complete"
echo "$out/helm"
