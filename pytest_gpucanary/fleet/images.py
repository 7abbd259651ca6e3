"""Container images for the fleet's kubelet nodes, written as OCI image-layout tars (no registry).

The machine has no registry and must not reach one, so every image a real node runs is made here
from files already on the machine and imported into the node's containerd (`ctr images import`)
under the names the manifests use; pods run them with `imagePullPolicy: Never` (or IfNotPresent,
which then finds them). Each image is one uncompressed layer, so its diff ID is its digest.

- busybox: Debian's static busybox with a link per applet. It stands in for the workload images
  (busybox:1.36 in fixtures/workloads/probe.yaml) and for anything that needs a shell.
- pause: ci/node/pause, standing in for registry.k8s.io/pause as the sandbox image.
- fake-gpu-plugin: ci/node/fake-gpu-plugin, standing in for nvcr.io/nvidia/k8s-device-plugin.
- allreduce: ci/node/allreduce as /allreduce, a two-rank all-reduce over TCP standing in for
  nccl-tests' all_reduce_perf (same flags and summary lines), with busybox so a manifest can wrap
  it in `sh -c`.
- with the operator's device plugin (GPUCANARY_FLEET_KUBELET_DEVICE_PLUGIN=operator), two more under
  the names the fleet's ClusterPolicy gives: the validator image (busybox: the device plugin's
  init container only waits for a file) and the device plugin image (busybox, the fake plugin as
  /bin/nvidia-device-plugin, and /bin/bash handing the operator's entrypoint script to busybox sh,
  whose bash-compatible `[[` it uses).
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

from pytest_gpucanary.errors import EnvError

BUSYBOX = "/bin/busybox"
PAUSE_IMAGE = "localhost/gpucanary/pause:1"
BUSYBOX_IMAGES = ("localhost/gpucanary/busybox:1", "docker.io/library/busybox:1.36",
                  "docker.io/library/busybox:latest")
FAKE_GPU_PLUGIN_IMAGE = "localhost/gpucanary/fake-gpu-plugin:1"
ALLREDUCE_IMAGE = "localhost/gpucanary/allreduce:1"
_PASSWD = b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n"


@dataclass(frozen=True)
class ImageSpec:
    names: tuple[str, ...]
    entrypoint: tuple[str, ...]
    files: tuple[tuple[str, Path], ...]          # (path in image, file on this machine)
    links: tuple[tuple[str, str], ...] = ()      # (path in image, symlink target)
    data: tuple[tuple[str, bytes], ...] = ()     # (path in image, content), executable


def _member(name: str, *, kind: bytes = tarfile.REGTYPE, mode: int = 0o644, size: int = 0,
            link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.linkname, info.mtime = kind, mode, size, link, 0
    return info


def _layer(spec: ImageSpec) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for directory in ("bin", "etc", "dev", "proc", "sys", "run", "var", "root"):
            tar.addfile(_member(directory, kind=tarfile.DIRTYPE, mode=0o755))
        tar.addfile(_member("tmp", kind=tarfile.DIRTYPE, mode=0o1777))
        tar.addfile(_member("etc/passwd", size=len(_PASSWD)), io.BytesIO(_PASSWD))
        for inside, source in spec.files:
            data = source.read_bytes()
            tar.addfile(_member(inside.lstrip("/"), mode=0o755, size=len(data)), io.BytesIO(data))
        for inside, data in spec.data:
            tar.addfile(_member(inside.lstrip("/"), mode=0o755, size=len(data)), io.BytesIO(data))
        for inside, target in spec.links:
            tar.addfile(_member(inside.lstrip("/"), kind=tarfile.SYMTYPE, mode=0o777, link=target))
    return buffer.getvalue()


def _blob(tar: tarfile.TarFile, data: bytes) -> tuple[str, int]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    tar.addfile(_member(f"blobs/sha256/{digest[7:]}", size=len(data)), io.BytesIO(data))
    return digest, len(data)


def write_oci_tar(spec: ImageSpec, path: Path) -> None:
    """One OCI image layout tar whose index names the image once per entry of `spec.names`."""
    layer = _layer(spec)
    with tarfile.open(path, "w") as tar:
        layer_digest, layer_size = _blob(tar, layer)
        config = {"architecture": "amd64", "os": "linux",
                  "config": {"Env": ["PATH=/bin"], "Entrypoint": list(spec.entrypoint), "WorkingDir": "/"},
                  "rootfs": {"type": "layers", "diff_ids": [layer_digest]}}
        config_digest, config_size = _blob(tar, json.dumps(config).encode())
        manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                               "digest": config_digest, "size": config_size},
                    "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                                "digest": layer_digest, "size": layer_size}]}
        manifest_digest, manifest_size = _blob(tar, json.dumps(manifest).encode())
        index = {"schemaVersion": 2, "manifests": [
            {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": manifest_digest,
             "size": manifest_size, "annotations": {"io.containerd.image.name": name,
                                                    "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1]}}
            for name in spec.names]}
        for name, data in (("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'),
                           ("index.json", json.dumps(index).encode())):
            tar.addfile(_member(name, size=len(data)), io.BytesIO(data))


def _busybox_applets() -> list[str]:
    if not Path(BUSYBOX).exists():
        raise EnvError(f"{BUSYBOX} is missing, so the kubelet node has no workload image",
                       hint="apt-get install busybox-static (ci/install-node-deps.sh)")
    listed = subprocess.run([BUSYBOX, "--list"], capture_output=True, text=True, check=True).stdout.split()
    return [applet for applet in listed if applet != "busybox"]


def _busybox(names: tuple[str, ...], entrypoint: tuple[str, ...] = ("/bin/sh",), *,
             files: tuple[tuple[str, Path], ...] = (), data: tuple[tuple[str, bytes], ...] = ()) -> ImageSpec:
    return ImageSpec(names, entrypoint, (("/bin/busybox", Path(BUSYBOX)), *files),
                     tuple((f"/bin/{applet}", "busybox") for applet in _busybox_applets()), data)


def operator_plugin_images(bin_dir: Path, *, device_plugin: str, validator: str) -> list[ImageSpec]:
    """The images of the GPU Operator's device-plugin DaemonSet pod, under the ClusterPolicy's names."""
    return [
        _busybox((validator,)),
        _busybox((device_plugin,), ("/bin/nvidia-device-plugin",),
                 files=(("/bin/nvidia-device-plugin", bin_dir / "fake-gpu-plugin"),),
                 data=(("/bin/bash", b'#!/bin/sh\nexec /bin/sh "$@"\n'),)),
    ]


def node_images(bin_dir: Path) -> list[ImageSpec]:
    """The images every kubelet node gets."""
    return [
        _busybox(BUSYBOX_IMAGES),
        ImageSpec((PAUSE_IMAGE,), ("/pause",), (("/pause", bin_dir / "pause"),)),
        ImageSpec((FAKE_GPU_PLUGIN_IMAGE,), ("/fake-gpu-plugin",),
                  (("/fake-gpu-plugin", bin_dir / "fake-gpu-plugin"),)),
        _busybox((ALLREDUCE_IMAGE,), ("/allreduce",), files=(("/allreduce", bin_dir / "allreduce"),)),
    ]


def import_images(specs: list[ImageSpec], *, directory: Path, address: Path, enter: tuple[str, ...] = ()) -> None:
    """Write each image's tar under `directory` and import it into containerd's k8s.io namespace;
    `enter` prefixes ctr's command line (nsenter into the namespace where `address` is)."""
    ctr = shutil.which("ctr")
    if ctr is None:
        raise EnvError("ctr is not installed", hint="apt-get install containerd (ci/install-node-deps.sh)")
    directory.mkdir(parents=True, exist_ok=True)
    for spec in specs:
        path = directory / (spec.names[0].rsplit("/", 1)[1].replace(":", "-") + ".tar")
        write_oci_tar(spec, path)
        result = subprocess.run([*enter, ctr, f"--address={address}", "--namespace=k8s.io", "images", "import", str(path)],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise EnvError(f"ctr images import {path.name} failed: {result.stderr.strip()[:300]}")
