#!/usr/bin/env bash
# Build the kubelet node's NVML stand-in (ci/node/nvml-shim) into a cache outside the repo:
# libnvidia-ml.so.1 from nvml_shim.c, compiled against NVIDIA's nvml.h from the go-nvml module that
# nvml-shim/check/go.mod pins, and nvml-check, its test client on NVIDIA's Go bindings (cgo). The
# cache directory is keyed by the C source, the client's sources, go.sum (which pins go-nvml, hence
# nvml.h) and this script, so a warm run builds nothing.
# Prints the output directory on stdout; progress goes to stderr. With --cached it builds nothing:
# it prints the directory if it is complete and exits 1 otherwise.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/node/nvml-shim"

sum=$(cat nvml_shim.c check/main.go check/go.mod check/go.sum "$here/build-nvml-shim.sh" | sha256sum | cut -c1-12)
cache=${GPUCANARY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpucanary}
out="$cache/bin/nvml-shim-$sum"
bins="libnvidia-ml.so.1 nvml-check"

if [ -f "$out/.complete" ]; then
  echo "NVML shim up to date in $out" >&2
  echo "$out"; exit 0
fi
if [ "${1:-}" = --cached ]; then
  echo "NVML shim not built for these sources ($out); run bash ci/build-nvml-shim.sh" >&2
  exit 1
fi
cc=${CC:-cc}
command -v "$cc" >/dev/null || { echo "no C compiler ($cc) to build the NVML shim: install gcc" >&2; exit 1; }
export GOTOOLCHAIN=local CGO_ENABLED=1 GOFLAGS="-trimpath -mod=mod"
tmp="$out.partial"
rm -rf "$tmp"; mkdir -p "$tmp"
start=$(date +%s)

echo "building nvml-check (go-nvml, go-nvlib and go-gpuallocator as check/go.mod pins them)" >&2
# go-nvml's cgo preamble declares all of nvml.h, whose deprecated calls would each print a warning
(cd check && CGO_CFLAGS="-O2 -g -Wno-deprecated-declarations" go build -pgo=off -ldflags "-s -w" -o "$tmp/nvml-check" .)

nvml_h="$(cd check && go list -m -f '{{.Dir}}' github.com/NVIDIA/go-nvml)/pkg/nvml"
echo "building libnvidia-ml.so.1 against $nvml_h/nvml.h" >&2
"$cc" -std=c11 -O2 -Wall -Wextra -Werror -fPIC -shared -pthread -Wl,-soname,libnvidia-ml.so.1 \
  -I"$nvml_h" -o "$tmp/libnvidia-ml.so.1" nvml_shim.c

for b in $bins; do [ -f "$tmp/$b" ] || { echo "build produced no $b" >&2; exit 1; }; done
echo "built in $(( $(date +%s) - start ))s" >&2
rm -rf "$out"; mv "$tmp" "$out"; touch "$out/.complete"
echo "$out"
