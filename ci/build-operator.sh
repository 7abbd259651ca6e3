#!/usr/bin/env bash
# Build the NVIDIA GPU Operator controller from its Go module into a cache outside the repo.
# The module is pinned by pseudo-version in ci/operator/go.mod (its release tags are not valid
# Go versions for the module path). The cache directory is keyed by that pin and go.sum, so a
# warm run builds nothing.
# Prints the binary directory on stdout; progress goes to stderr.
# The directory also holds paths.env (KEY=VALUE lines): where the operator module sits in the
# module cache, and so where its assets/, manifests/ and CRDs are. The operator reads those from
# /opt/gpu-operator at run time, so whoever starts it has to put them there (or bind-mount them).
set -euo pipefail
here=$(cd "$(dirname "$0")/operator" && pwd)
cd "$here"

MOD=github.com/NVIDIA/gpu-operator
PSEUDO=$(awk -v m="$MOD" '$1 == m { print $2; exit }' go.mod)
[ -n "$PSEUDO" ] || { echo "no $MOD requirement in $here/go.mod" >&2; exit 1; }
sum=$(sha256sum go.sum | cut -c1-12)
cache=${GPUCANARY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpucanary}
out="$cache/bin/gpu-operator-$PSEUDO-$sum"

export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-trimpath -mod=readonly"

# Resolve the operator module in the module cache (downloads it if the cache was cleaned) and
# write paths.env into $1.
write_paths() {
  local dir rel crds
  dir=$(go mod download -json "$MOD@$PSEUDO" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  [ -n "$dir" ] && [ -d "$dir/assets" ] || { echo "module $MOD@$PSEUDO has no assets/ in the module cache" >&2; return 1; }
  rel=$(sed -n 's/^VERSION ?= *//p' "$dir/versions.mk" | head -1)
  crds="$dir/deployments/gpu-operator/crds"
  [ -f "$crds/nvidia.com_clusterpolicies.yaml" ] || crds="$dir/config/crd/bases"
  {
    echo "GPU_OPERATOR_VERSION=${rel:-unknown}"
    echo "GPU_OPERATOR_PSEUDO_VERSION=$PSEUDO"
    echo "GPU_OPERATOR_MODULE_DIR=$dir"
    echo "GPU_OPERATOR_ASSETS_DIR=$dir/assets"
    echo "GPU_OPERATOR_MANIFESTS_DIR=$dir/manifests"
    echo "GPU_OPERATOR_CRD_DIR=$crds"
  } >"$1/paths.env.tmp"
  mv "$1/paths.env.tmp" "$1/paths.env"
}

if [ -f "$out/.complete" ]; then
  moddir=$(sed -n 's/^GPU_OPERATOR_MODULE_DIR=//p' "$out/paths.env" 2>/dev/null || true)
  if [ -z "$moddir" ] || [ ! -d "$moddir/assets" ]; then
    echo "operator module gone from the module cache; fetching it again" >&2
    write_paths "$out"
  fi
  echo "gpu-operator binary up to date in $out" >&2
  echo "$out"; exit 0
fi

tmp="$out.partial"
rm -rf "$tmp"; mkdir -p "$tmp"
start=$(date +%s)

write_paths "$tmp"
rel=$(sed -n 's/^GPU_OPERATOR_VERSION=//p' "$tmp/paths.env")
commit=${PSEUDO##*-}
echo "building gpu-operator $rel ($MOD@$PSEUDO)" >&2
info=$MOD/internal/info
go build -pgo=off -ldflags "-s -w -X $info.version=$rel -X $info.gitCommit=$commit" \
  -o "$tmp/gpu-operator" "$MOD/cmd/gpu-operator"

[ -x "$tmp/gpu-operator" ] || { echo "build produced no gpu-operator" >&2; exit 1; }
echo "built in $(( $(date +%s) - start ))s" >&2
rm -rf "$out"; mv "$tmp" "$out"; touch "$out/.complete"
echo "$out"
