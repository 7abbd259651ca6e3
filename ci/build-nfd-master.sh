#!/usr/bin/env bash
# Build node-feature-discovery's nfd-master, unmodified, from the module version ci/node/nfd-master/go.mod pins
# (v0.18.3), into a cache outside the repo, with the NodeFeature/NodeFeatureRule/NodeFeatureGroup CRDs the same
# module ships (deployment/base/nfd-crds/nfd-api-crds.yaml) copied beside it as nfd-api-crds.yaml. Pure Go
# (CGO_ENABLED=0). Stamped with the module version through the -X pkg/version.version its Makefile sets. The
# cache directory is keyed by go.sum and this script, so a warm run builds nothing.
# Prints the output directory on stdout; progress goes to stderr.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/node/nfd-master"

MOD=sigs.k8s.io/node-feature-discovery
version=$(awk -v m="$MOD" '$1 == "require" && $2 == m { print $3 } $1 == m { print $2 }' go.mod | head -1)
sum=$(cat go.mod go.sum tools.go "$here/build-nfd-master.sh" | sha256sum | cut -c1-12)
cache=${GPUCANARY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpucanary}
out="$cache/bin/nfd-master-$version-$sum"

if [ -f "$out/.complete" ]; then
  echo "nfd-master $version up to date in $out" >&2
  echo "$out"; exit 0
fi
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-trimpath -mod=readonly"
tmp="$out.partial"
rm -rf "$tmp"; mkdir -p "$tmp"
start=$(date +%s)
echo "building nfd-master $version ($MOD, a few minutes on 2 cores)" >&2
go build -pgo=off \
  -ldflags "-s -w -X $MOD/pkg/version.version=$version" -o "$tmp/nfd-master" "$MOD/cmd/nfd-master"
dir=$(go list -m -f '{{.Dir}}' "$MOD")
install -m 0644 "$dir/deployment/base/nfd-crds/nfd-api-crds.yaml" "$tmp/nfd-api-crds.yaml"
echo "built in $(( $(date +%s) - start ))s" >&2
rm -rf "$out"; mv "$tmp" "$out"; touch "$out/.complete"
echo "$out"
