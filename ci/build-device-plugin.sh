#!/usr/bin/env bash
# Build NVIDIA's k8s-device-plugin and GPU Feature Discovery, unmodified, from the module version ci/node/device-plugin/go.mod pins (the
# Go module proxy serves v0.19.3), into a cache outside the repo, for the fleet's kubelet pool nodes, where it
# runs over the NVML stand-in (ci/node/nvml-shim). cgo: it dlopens libnvidia-ml.so.1 through go-nvml. Stamped
# with the module version through the -X internal/info.version its Makefile sets. The cache directory is keyed
# by go.sum and this script, so a warm run builds nothing.
# Prints the output directory on stdout; progress goes to stderr.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/node/device-plugin"

MOD=github.com/NVIDIA/k8s-device-plugin
version=$(awk -v m="$MOD" '$1 == "require" && $2 == m { print $3 } $1 == m { print $2 }' go.mod | head -1)
sum=$(cat go.mod go.sum tools.go "$here/build-device-plugin.sh" | sha256sum | cut -c1-12)
cache=${GPUCANARY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpucanary}
out="$cache/bin/k8s-device-plugin-$version-$sum"

if [ -f "$out/.complete" ]; then
  echo "k8s-device-plugin $version up to date in $out" >&2
  echo "$out"; exit 0
fi
command -v "${CC:-cc}" >/dev/null || { echo "no C compiler to build k8s-device-plugin (cgo): install gcc" >&2; exit 1; }
export GOTOOLCHAIN=local CGO_ENABLED=1 GOFLAGS="-trimpath -mod=readonly"
tmp="$out.partial"
rm -rf "$tmp"; mkdir -p "$tmp"
start=$(date +%s)
echo "building nvidia-device-plugin and gpu-feature-discovery $version ($MOD, a minute or two on 2 cores)" >&2
# go-nvml's cgo preamble declares all of nvml.h, whose deprecated calls would each print a warning
# the device plugin and GFD, from one module, as NVIDIA ships them in one image
for cmd in nvidia-device-plugin gpu-feature-discovery; do
  CGO_CFLAGS="-O2 -g -Wno-deprecated-declarations" go build -pgo=off \
    -ldflags "-s -w -X $MOD/internal/info.version=$version" -o "$tmp/$cmd" "$MOD/cmd/$cmd"
done
echo "built in $(( $(date +%s) - start ))s" >&2
rm -rf "$out"; mv "$tmp" "$out"; touch "$out/.complete"
echo "$out"
