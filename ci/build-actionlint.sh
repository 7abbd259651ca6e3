#!/usr/bin/env bash
# Build actionlint, the GitHub Actions workflow checker the template tests run, from its Go module
# into a cache outside the repo (like build.sh). The directory is keyed by the pinned version, so a
# warm run builds nothing. Prints the binary's path on stdout; progress goes to stderr.
set -euo pipefail
# Pinned: the newest release the module proxy serves that builds with Go 1.26.
VERSION=v1.7.12
cache=${GPUCANARY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpucanary}
out="$cache/bin/actionlint-$VERSION"

if [ -f "$out/.complete" ]; then
  echo "actionlint $VERSION up to date in $out" >&2
  echo "$out/actionlint"; exit 0
fi
export GOTOOLCHAIN=local CGO_ENABLED=0
tmp="$out.partial"
rm -rf "$tmp"; mkdir -p "$tmp"
start=$(date +%s)
echo "building actionlint $VERSION" >&2
GOBIN="$tmp" go install -trimpath -ldflags "-s -w" "github.com/rhysd/actionlint/cmd/actionlint@$VERSION"
[ -x "$tmp/actionlint" ] || { echo "build produced no actionlint" >&2; exit 1; }
echo "built in $(( $(date +%s) - start ))s" >&2
rm -rf "$out"; mv "$tmp" "$out"; touch "$out/.complete"
echo "$out/actionlint"
