#!/usr/bin/env bash
# Build the fleet's real kubelet node from Go modules into a cache outside the repo: kubelet from
# the same k8s.io/kubernetes module as the control plane (ci/go.mod), and the node's stand-ins in
# ci/node/ (pause, the namespace-only CNI plugin, the TCP all-reduce
# standing in for nccl-tests, the driver manager stand-in, the NVIDIA container runtime stand-in). containerd and runc come
# from Debian (ci/install-node-deps.sh). The cache directory is keyed by the Kubernetes version,
# go.sum and the stand-ins' sources, so a warm run builds nothing.
# Prints the binary directory on stdout; progress goes to stderr. With --cached it builds nothing:
# it prints the directory if it is complete and exits 1 otherwise.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"

K8S=$(grep -Eo 'k8s.io/kubernetes v[0-9.]+' go.mod | head -1 | sed 's/.* v//')
sum=$( (cat go.sum; find node -name '*.go' -not -path 'node/nvml-shim/*' -not -path 'node/device-plugin/*' -not -path 'node/nfd-master/*' -not -path 'node/dra-driver/*' | sort | xargs cat) | sha256sum | cut -c1-12)
cache=${GPUCANARY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpucanary}
out="$cache/bin/kubelet-node-$K8S-$sum"
bins="kubelet pause gpucanary-netns allreduce driver-manager nvidia-container-runtime"

if [ -f "$out/.complete" ]; then
  echo "kubelet node binaries up to date in $out" >&2
  echo "$out"; exit 0
fi
if [ "${1:-}" = --cached ]; then
  echo "kubelet node binaries not built for these sources ($out); run bash ci/build-kubelet.sh" >&2
  exit 1
fi
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-trimpath -mod=mod"
tmp="$out.partial"
rm -rf "$tmp"; mkdir -p "$tmp"
start=$(date +%s)

echo "building kubelet v$K8S" >&2
minor=$(cut -d. -f2 <<<"$K8S")
ld="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ld+=" -X $p.gitVersion=v$K8S -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean -X $p.buildDate=2000-01-01T00:00:00Z"
done
go build -pgo=off -tags selinux,notest,grpcnotrace -ldflags "$ld" -o "$tmp/" k8s.io/kubernetes/cmd/kubelet
kubelet_s=$(( $(date +%s) - start ))

echo "building the node's stand-ins (pause, gpucanary-netns, allreduce, driver-manager, nvidia-container-runtime)" >&2
go build -pgo=off -ldflags "-s -w" -o "$tmp/pause" ./node/pause
go build -pgo=off -ldflags "-s -w" -o "$tmp/gpucanary-netns" ./node/netns-cni
go build -pgo=off -ldflags "-s -w" -o "$tmp/allreduce" ./node/allreduce
go build -pgo=off -ldflags "-s -w" -o "$tmp/driver-manager" ./node/driver-manager
go build -pgo=off -ldflags "-s -w" -o "$tmp/nvidia-container-runtime" ./node/nvidia-runtime

for b in $bins; do [ -x "$tmp/$b" ] || { echo "build produced no $b" >&2; exit 1; }; done
echo "built in $(( $(date +%s) - start ))s (kubelet ${kubelet_s}s)" >&2
rm -rf "$out"; mv "$tmp" "$out"; touch "$out/.complete"
echo "$out"
