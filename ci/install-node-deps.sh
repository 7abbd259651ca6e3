#!/usr/bin/env bash
# Install the Debian packages the fleet's real kubelet node needs, when they are missing:
# containerd (with ctr and the runc v2 shim), runc, busybox-static (the workload image's files),
# the CNI loopback plugin, iproute2 and util-linux (the namespace-only CNI plugin, nsenter).
set -euo pipefail
missing=()
command -v containerd >/dev/null || missing+=(containerd)
command -v runc >/dev/null || missing+=(runc)
[ -x /bin/busybox ] || missing+=(busybox-static)
[ -x /usr/lib/cni/loopback ] || missing+=(containernetworking-plugins)
command -v ip >/dev/null || missing+=(iproute2)
command -v nsenter >/dev/null || missing+=(util-linux)
[ ${#missing[@]} -eq 0 ] && exit 0
echo "installing Debian packages for the kubelet node: ${missing[*]}" >&2
sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
$sudo apt-get update -qq
# policy-rc.d (or the lack of systemd) keeps Debian's containerd service from starting; the fleet
# runs its own containerd per node
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
