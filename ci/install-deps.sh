#!/usr/bin/env bash
# Install the Debian packages the local fleet and the CI template tests need, when they are missing.
set -euo pipefail
missing=()
command -v prometheus >/dev/null || missing+=(prometheus)
command -v openssl >/dev/null || missing+=(openssl)
command -v shellcheck >/dev/null || missing+=(shellcheck)  # actionlint checks run: scripts with it
command -v groovyc >/dev/null || missing+=(groovy)          # compiles the Jenkinsfile template
command -v chromium >/dev/null || missing+=(chromium)       # renders the gate's HTML report in its e2e test
command -v cc >/dev/null || missing+=(gcc)                 # builds the NVML shim (ci/build-nvml-shim.sh)
command -v go >/dev/null || { echo "Go >= 1.26 is required to build the fleet; install it first" >&2; exit 1; }
[ ${#missing[@]} -eq 0 ] && exit 0
echo "installing Debian packages: ${missing[*]}" >&2
sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
