#!/usr/bin/env bash
# Build containerd v2 (containerd, its runc shim and ctr), unmodified, from the Go module proxy into a cache outside
# the repo, for a kubelet node of a fleet in GPUCluster mode: the kubelet hands a prepared ResourceClaim's devices to
# the runtime only as CRI CDI device names, which Debian's containerd 1.6 ignores and containerd 2 applies (CDI on by
# default). Static (CGO_ENABLED=0, the containerd project's own release flags: no btrfs, no devmapper). The cache
# directory is keyed by the version and this script, so a warm run builds nothing (about 2 minutes cold on 2 cores).
# Prints the output directory on stdout; progress goes to stderr.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

MOD=github.com/containerd/containerd/v2
version=${GPUCANARY_CONTAINERD_VERSION:-v2.4.2}
sum=$(echo "$version" | cat - "$here/build-containerd.sh" | sha256sum | cut -c1-12)
cache=${GPUCANARY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpucanary}
out="$cache/bin/containerd-$version-$sum"

if [ -f "$out/.complete" ]; then
  echo "containerd $version up to date in $out" >&2
  echo "$out"; exit 0
fi
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-trimpath"
tmp="$out.partial"
rm -rf "$tmp"; mkdir -p "$tmp"
start=$(date +%s)
echo "building containerd $version ($MOD: containerd, containerd-shim-runc-v2, ctr; about 2 minutes cold)" >&2
GOBIN="$tmp" go install -pgo=off -tags "no_btrfs no_devmapper no_zfs" \
  -ldflags "-s -w -X $MOD/version.Version=$version" \
  "$MOD/cmd/containerd@$version" "$MOD/cmd/containerd-shim-runc-v2@$version" "$MOD/cmd/ctr@$version"
for bin in containerd containerd-shim-runc-v2 ctr; do
  [ -x "$tmp/$bin" ] || { echo "build produced no $bin" >&2; exit 1; }
done
echo "built in $(( $(date +%s) - start ))s" >&2
rm -rf "$out"; mv "$tmp" "$out"; touch "$out/.complete"
echo "$out"
