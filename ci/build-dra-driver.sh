#!/usr/bin/env bash
# Build the GPU kubelet plugin of NVIDIA's DRA driver for GPUs (gpu-kubelet-plugin), unmodified, from the module
# version ci/node/dra-driver/go.mod pins (sigs.k8s.io/dra-driver-nvidia-gpu v0.5.0, the one GPU Operator v26.7.0
# deploys), into a cache outside the repo; it runs over the NVML stand-in (ci/node/nvml-shim). The Go module proxy
# serves two of its requirements in no usable version, and go.mod replaces them: k8s.io/kubernetes v1.37.0-rc.0 by
# v1.37.2 (the plugin uses only its checkpoint manager) and github.com/NVIDIA/go-nvfm by ci/node/dra-driver/go-nvfm,
# a compile-only stand-in (reached only behind the Fabric Manager feature gate, off by default). cgo: it dlopens
# libnvidia-ml.so.1 through go-nvml. Stamped with the module version through the -X internal/info.version its
# Makefile sets. The cache directory is keyed by go.mod, go.sum, the stand-in and this script, so a warm run
# builds nothing (2 to 4 minutes cold on 2 cores, about 870 MiB peak memory). Beside it, nvidia-cdi-hook from the
# NVIDIA Container Toolkit version the driver requires, which NVIDIA's plugin image carries at /usr/bin and the plugin
# copies to the node for the CDI specs it writes (the Dockerfile takes it from that toolkit's image).
# Prints the output directory on stdout; progress goes to stderr.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/node/dra-driver"

MOD=sigs.k8s.io/dra-driver-nvidia-gpu
version=$(awk -v m="$MOD" '$1 == "require" && $2 == m { print $3 } $1 == m { print $2 }' go.mod | head -1)
sum=$(cat go.mod go.sum tools.go go-nvfm/go.mod go-nvfm/pkg/nvfm/*.go "$here/build-dra-driver.sh" | sha256sum | cut -c1-12)
cache=${GPUCANARY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpucanary}
out="$cache/bin/dra-driver-nvidia-gpu-$version-$sum"

if [ -f "$out/.complete" ]; then
  echo "gpu-kubelet-plugin $version up to date in $out" >&2
  echo "$out"; exit 0
fi
command -v "${CC:-cc}" >/dev/null || { echo "no C compiler to build gpu-kubelet-plugin (cgo): install gcc" >&2; exit 1; }
export GOTOOLCHAIN=local CGO_ENABLED=1 GOFLAGS="-trimpath -mod=readonly"
tmp="$out.partial"
rm -rf "$tmp"; mkdir -p "$tmp"
start=$(date +%s)
echo "building gpu-kubelet-plugin $version ($MOD, 2 to 4 minutes cold on 2 cores)" >&2
# go-nvml's cgo preamble declares all of nvml.h, whose deprecated calls would each print a warning
CGO_CFLAGS="-O2 -g -Wno-deprecated-declarations" go build -pgo=off \
  -ldflags "-s -w -X $MOD/internal/info.version=$version" -o "$tmp/gpu-kubelet-plugin" "$MOD/cmd/gpu-kubelet-plugin"
CGO_CFLAGS="-O2 -g -Wno-deprecated-declarations" go build -pgo=off -ldflags "-s -w" -o "$tmp/nvidia-cdi-hook" \
  github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-cdi-hook
for bin in gpu-kubelet-plugin nvidia-cdi-hook; do
  [ -x "$tmp/$bin" ] || { echo "build produced no $bin" >&2; exit 1; }
done
echo "built in $(( $(date +%s) - start ))s" >&2
rm -rf "$out"; mv "$tmp" "$out"; touch "$out/.complete"
echo "$out"
