#!/usr/bin/env bash
# Build a wheelhouse for CI runners that reach no package index: the pytest-gpucanary wheel of this
# checkout (check out the release tag first) and, unless --no-deps, a wheel of every dependency.
# Build it with the Python version and platform of the runners; copy the directory to them and set
# GPUCANARY_FROM to its path (and PIP_NO_INDEX=1). Prints the package's wheel on stdout.
# Usage: ci/wheelhouse.sh OUT_DIR [--no-deps]   (PYTHON selects the interpreter, default python3)
set -euo pipefail
out=${1:?usage: ci/wheelhouse.sh OUT_DIR [--no-deps]}
root=$(cd "$(dirname "$0")/.." && pwd)
args=()
[ "${2:-}" = "--no-deps" ] && args+=(--no-deps)
mkdir -p "$out"
"${PYTHON:-python3}" -m pip wheel --quiet --disable-pip-version-check "${args[@]}" --wheel-dir "$out" "$root" >&2
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/pyproject.toml")
ls "$out/pytest_gpucanary-$version-py3-none-any.whl"
