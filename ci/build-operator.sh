#!/usr/bin/env bash
# Build one release of the NVIDIA GPU Operator controller into a cache outside the repo.
#
#   bash ci/build-operator.sh [RELEASE]      RELEASE defaults to $GPUCANARY_OPERATOR_RELEASE, then v26.7.0
#
# Releases and where their source comes from:
#   v26.7.0 v26.3.3 v25.10.1  the release tag's source tree: a local archive
#                             $GPUCANARY_OPERATOR_ARCHIVE_DIR/gpu-operator-<tag>.tar.gz (default
#                             ../shared/third-party from the repo root), or, with
#                             GPUCANARY_OPERATOR_SOURCE=git, `git clone --depth 1 --branch <tag>` of
#                             $GPUCANARY_OPERATOR_GIT_URL (default https://github.com/NVIDIA/gpu-operator;
#                             a clone of upstream must be the tag's known commit, a mirror's is stamped as is).
#                             Built with `go build -mod=vendor` (the tree vendors its dependencies).
#   v25.3.4                   the Go module pinned by pseudo-version in ci/operator/go.mod (its release
#                             tags are not valid Go versions for the module path).
# The binary is stamped with the release and commit through the same -X internal/info.version and
# internal/info.gitCommit pair the operator's Makefile sets (VERSION from the tree's versions.mk).
# A release tree's cmd/nvidia-validator (the operator's validator, which v25.10 and later ship in the
# operator's own image) is built beside it from the same tree, stamped the same way.
#
# Prints the binary directory on stdout; progress goes to stderr. The directory also holds
# paths.env (KEY=VALUE lines) naming the release and the tree its assets/, manifests/ and CRDs
# come from, always the same tree the binary was built from. The operator reads assets and
# manifests from /opt/gpu-operator at run time, so whoever starts it has to put them there.
# A warm cache builds nothing. Exit codes: 0 built or up to date, 2 unknown release or source,
# 3 source missing (archive not found, clone failed), 1 build failure.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)

RELEASE=${1:-${GPUCANARY_OPERATOR_RELEASE:-v26.7.0}}
# Commits of the release tags (github.com/NVIDIA/gpu-operator); a clone is checked against them.
declare -A COMMITS=(
  [v26.7.0]=10ee5b3638b89e11e949412aafa5ba99279c3721
  [v26.3.3]=b0a49c0e7b2e061dcd83f2bb2fe4fe960c5d0338
  [v25.10.1]=846018752b8a34d4039feb6f18629b4c64210e32
  [v25.3.4]=d73a0086a6ba
)
if [ -z "${COMMITS[$RELEASE]:-}" ]; then
  echo "unknown GPU Operator release '$RELEASE'; use one of: v26.7.0 v26.3.3 v25.10.1 v25.3.4" >&2
  exit 2
fi

cache=${GPUCANARY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpucanary}
MOD=github.com/NVIDIA/gpu-operator
UPSTREAM=https://$MOD
info=$MOD/internal/info
BUILDS="gpu-operator nvidia-validator"     # the commands a tree build makes (cmd/<name>): part of its cache key
export GOTOOLCHAIN=local CGO_ENABLED=0

# paths.env for a tree at $2 (release $3, commit $4, source $5) into directory $1; $6 is where the
# tree is now, if it is not yet at $2.
write_paths_env() {
  local crds=deployments/gpu-operator/crds
  [ -f "${6:-$2}/$crds/nvidia.com_clusterpolicies.yaml" ] || crds=config/crd/bases
  crds="$2/$crds"
  {
    echo "GPU_OPERATOR_VERSION=$3"
    echo "GPU_OPERATOR_COMMIT=$4"
    echo "GPU_OPERATOR_SOURCE=$5"
    echo "GPU_OPERATOR_MODULE_DIR=$2"
    echo "GPU_OPERATOR_ASSETS_DIR=$2/assets"
    echo "GPU_OPERATOR_MANIFESTS_DIR=$2/manifests"
    echo "GPU_OPERATOR_CRD_DIR=$crds"
  } >"$1/paths.env.tmp"
  mv "$1/paths.env.tmp" "$1/paths.env"
}

tree_version() { sed -n 's/^VERSION ?= *//p' "$1/versions.mk" | head -1; }

build_from_module() {
  cd "$repo/ci/operator"
  local pseudo sum out tmp dir rel start
  pseudo=$(awk -v m="$MOD" '$1 == m { print $2; exit }' go.mod)
  [ -n "$pseudo" ] || { echo "no $MOD requirement in $PWD/go.mod" >&2; exit 1; }
  sum=$(sha256sum go.sum | cut -c1-12)
  out="$cache/bin/gpu-operator-$pseudo-$sum"
  export GOFLAGS="-trimpath -mod=readonly"
  module_dir() { go mod download -json "$MOD@$pseudo" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p'; }
  if [ -f "$out/.complete" ]; then
    dir=$(sed -n 's/^GPU_OPERATOR_MODULE_DIR=//p' "$out/paths.env" 2>/dev/null || true)
    # Also rewrites a paths.env from before it named the commit.
    if [ -z "$dir" ] || [ ! -d "$dir/assets" ] || ! grep -q '^GPU_OPERATOR_COMMIT=' "$out/paths.env"; then
      echo "operator module gone from the module cache or paths.env out of date; resolving it again" >&2
      dir=$(module_dir)
      write_paths_env "$out" "$dir" "$(tree_version "$dir")" "${pseudo##*-}" "module $MOD@$pseudo"
    fi
    echo "gpu-operator $RELEASE up to date in $out" >&2
    echo "$out"; exit 0
  fi
  tmp="$out.partial"; rm -rf "$tmp"; mkdir -p "$tmp"; start=$(date +%s)
  dir=$(module_dir)
  [ -n "$dir" ] && [ -d "$dir/assets" ] || { echo "module $MOD@$pseudo has no assets/ in the module cache" >&2; exit 3; }
  rel=$(tree_version "$dir")
  [ "$rel" = "$RELEASE" ] || { echo "module $MOD@$pseudo is $rel, not $RELEASE" >&2; exit 1; }
  write_paths_env "$tmp" "$dir" "$rel" "${pseudo##*-}" "module $MOD@$pseudo"
  echo "building gpu-operator $rel ($MOD@$pseudo)" >&2
  go build -pgo=off -ldflags "-s -w -X $info.version=$rel -X $info.gitCommit=${pseudo##*-}" \
    -o "$tmp/gpu-operator" "$MOD/cmd/gpu-operator"
  finish "$tmp" "$out" "$start"
}

build_from_tree() {
  local source=${GPUCANARY_OPERATOR_SOURCE:-archive} commit=${COMMITS[$RELEASE]} key archive out tmp start
  local archive_dir=${GPUCANARY_OPERATOR_ARCHIVE_DIR:-}
  local url=${GPUCANARY_OPERATOR_GIT_URL:-$UPSTREAM}
  if [ -z "$archive_dir" ]; then
    # shared/third-party beside the checkout or beside any directory above it (a CI clone may sit deeper)
    local up=$repo
    archive_dir=$(dirname "$repo")/shared/third-party
    while [ "$up" != / ]; do
      up=$(dirname "$up")
      if [ -f "$up/shared/third-party/gpu-operator-$RELEASE.tar.gz" ]; then archive_dir=$up/shared/third-party; break; fi
    done
  fi
  case "$source" in
    archive)
      archive="$archive_dir/gpu-operator-$RELEASE.tar.gz"
      if [ ! -f "$archive" ]; then
        # The same release tag is the same commit: a build of it from any archive is this build.
        for out in "$cache"/bin/gpu-operator-"$RELEASE"-*/; do
          if [ -f "$out/.complete" ] && [ -x "$out/nvidia-validator" ] \
              && grep -q "^GPU_OPERATOR_COMMIT=${commit:0:12}" "$out/paths.env" 2>/dev/null \
              && [ -d "$(sed -n 's/^GPU_OPERATOR_ASSETS_DIR=//p' "$out/paths.env")" ]; then
            echo "gpu-operator $RELEASE (commit $commit) up to date in ${out%/}; no archive needed" >&2
            echo "${out%/}"; exit 0
          fi
        done
        echo "no source archive for GPU Operator $RELEASE at $archive; set GPUCANARY_OPERATOR_ARCHIVE_DIR or GPUCANARY_OPERATOR_SOURCE=git" >&2
        exit 3
      fi
      # Keyed by size and mtime, not a checksum, so a warm run stays well under 0.1 s.
      key=$( (stat -c '%s-%Y' "$archive"; echo "$BUILDS") | sha256sum | cut -c1-12) ;;
    git) key=git-$(printf '%s\n%s' "$url" "$BUILDS" | sha256sum | cut -c1-12) ;;
    *) echo "unknown GPUCANARY_OPERATOR_SOURCE '$source'; use archive or git" >&2; exit 2 ;;
  esac
  out="$cache/bin/gpu-operator-$RELEASE-$key"
  if [ -f "$out/.complete" ]; then
    echo "gpu-operator $RELEASE up to date in $out" >&2
    echo "$out"; exit 0
  fi
  tmp="$out.partial"; rm -rf "$tmp"; mkdir -p "$tmp"; start=$(date +%s)
  if [ "$source" = archive ]; then
    echo "unpacking $archive" >&2
    tar -xzf "$archive" -C "$tmp"
    mv "$tmp/gpu-operator-$RELEASE" "$tmp/src"
  else
    echo "cloning $url at $RELEASE" >&2
    git -c advice.detachedHead=false clone -q --depth 1 --branch "$RELEASE" "$url" "$tmp/src" ||
      { echo "git clone of $url at $RELEASE failed" >&2; exit 3; }
    local head; head=$(git -C "$tmp/src" rev-parse HEAD)
    if [ "$url" = "$UPSTREAM" ]; then
      [ "$head" = "$commit" ] || { echo "$url tag $RELEASE is commit $head, expected $commit" >&2; exit 1; }
    elif [ "$head" != "$commit" ]; then
      echo "note: $url tag $RELEASE is commit $head, not upstream's $commit; stamping $head" >&2
      commit=$head
    fi
    rm -rf "$tmp/src/.git"
  fi
  local rel; rel=$(tree_version "$tmp/src")
  [ "$rel" = "$RELEASE" ] || { echo "the $RELEASE tree's versions.mk says VERSION ?= $rel" >&2; exit 1; }
  local cmd
  for cmd in $BUILDS; do
    echo "building $cmd $rel from its $source tree (go build -mod=vendor, minutes on 2 cores)" >&2
    (cd "$tmp/src" && GOFLAGS="-trimpath -mod=vendor" GOPROXY=off go build -pgo=off \
      -ldflags "-s -w -X $info.version=$rel -X $info.gitCommit=${commit:0:12}" \
      -o "$tmp/$cmd" "./cmd/$cmd")
  done
  # The vendored sources are only needed to build; the rest of the tree is what the fleet reads.
  rm -rf "$tmp/src/vendor"
  write_paths_env "$tmp" "$out/src" "$rel" "${commit:0:12}" "$source" "$tmp/src"
  finish "$tmp" "$out" "$start"
}

finish() {
  [ -x "$1/gpu-operator" ] || { echo "build produced no gpu-operator" >&2; exit 1; }
  echo "built in $(( $(date +%s) - $3 ))s" >&2
  rm -rf "$2"; mv "$1" "$2"; touch "$2/.complete"
  echo "$2"
}

if [ "$RELEASE" = v25.3.4 ]; then build_from_module; else build_from_tree; fi
