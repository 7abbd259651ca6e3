#!/usr/bin/env bash
# Fetch Debian's Prometheus Pushgateway binary, which the verdict tests push to, into a cache outside the
# repo (like build.sh): the package is downloaded and unpacked, never installed, so no service is set
# up or started on the host. The directory is keyed by the package version, so a warm run fetches
# nothing. Prints the binary's path on stdout; progress goes to stderr.
set -euo pipefail
cache=${GPUCANARY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpucanary}
version=$(apt-cache policy prometheus-pushgateway | awk '/Candidate:/ {print $2}')
[ -n "$version" ] && [ "$version" != "(none)" ] || { echo "apt knows no prometheus-pushgateway package" >&2; exit 1; }
out="$cache/bin/pushgateway-${version//[^A-Za-z0-9.+-]/_}"

if [ -f "$out/.complete" ]; then
  echo "pushgateway $version up to date in $out" >&2
  echo "$out/pushgateway"; exit 0
fi
tmp="$out.partial"
rm -rf "$tmp"; mkdir -p "$tmp/deb"
echo "fetching prometheus-pushgateway $version" >&2
(cd "$tmp/deb" && apt-get download -qq "prometheus-pushgateway=$version" >&2)
dpkg-deb -x "$tmp"/deb/*.deb "$tmp/root"
install -m 755 "$tmp/root/usr/bin/prometheus-pushgateway" "$tmp/pushgateway"
rm -rf "$tmp/deb" "$tmp/root"
rm -rf "$out"; mv "$tmp" "$out"; touch "$out/.complete"
echo "$out/pushgateway"
