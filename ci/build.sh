#!/usr/bin/env bash
# Build the local fleet's control plane from Go modules into a cache outside the repo.
# The cache directory is keyed by the pinned versions and go.sum, so a warm run builds nothing.
# Prints the binary directory on stdout; progress goes to stderr.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"

K8S=$(grep -Eo 'k8s.io/kubernetes v[0-9.]+' go.mod | head -1 | sed 's/.* v//')
ETCD=$(grep -Eo 'go.etcd.io/etcd/server/v3 v[0-9.]+' go.mod | head -1 | sed 's/.* v//')
KWOK=$(grep -Eo 'sigs.k8s.io/kwok v[0-9.]+' go.mod | head -1 | sed 's/.* v//')
sum=$(sha256sum go.sum | cut -c1-12)
cache=${GPUCANARY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpucanary}
out="$cache/bin/k8s-$K8S-etcd-$ETCD-kwok-$KWOK-$sum"
bins="etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok kwokctl"

export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-trimpath -mod=mod"

# kwok's own Stage manifests and CRDs ship in its module; the fleet reads them from here.
copy_kwok_manifests() {
  [ -d "$1/kwok-manifests" ] && return 0
  local dir; dir=$(go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)
  mkdir -p "$1/kwok-manifests"; cp -r "$dir/kustomize/stage" "$dir/kustomize/crd" "$1/kwok-manifests/"; chmod -R u+w "$1/kwok-manifests"
}

if [ -f "$out/.complete" ]; then
  copy_kwok_manifests "$out"
  echo "control plane binaries up to date in $out" >&2
  echo "$out"; exit 0
fi
tmp="$out.partial"
rm -rf "$tmp"; mkdir -p "$tmp"
start=$(date +%s)

echo "building Kubernetes v$K8S (kube-apiserver, kube-controller-manager, kube-scheduler, kubectl)" >&2
minor=$(cut -d. -f2 <<<"$K8S")
ld="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ld+=" -X $p.gitVersion=v$K8S -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean -X $p.buildDate=2000-01-01T00:00:00Z"
done
go build -pgo=off -tags selinux,notest,grpcnotrace -ldflags "$ld" -o "$tmp/" \
  k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl

echo "building etcd v$ETCD" >&2
go build -pgo=off -ldflags "-s -w" -o "$tmp/etcd" go.etcd.io/etcd/server/v3

echo "building kwok and kwokctl v$KWOK" >&2
go build -pgo=off -ldflags "-s -w" -o "$tmp/" sigs.k8s.io/kwok/cmd/kwok sigs.k8s.io/kwok/cmd/kwokctl

copy_kwok_manifests "$tmp"
for b in $bins; do [ -x "$tmp/$b" ] || { echo "build produced no $b" >&2; exit 1; }; done
echo "built in $(( $(date +%s) - start ))s" >&2
rm -rf "$out"; mv "$tmp" "$out"; touch "$out/.complete"
echo "$out"
