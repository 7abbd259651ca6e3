"""Container images for the fleet's kubelet nodes, written as OCI image-layout tars (no registry).

The machine has no registry and must not reach one, so every image a real node runs is made here
from files already on the machine and imported into the node's containerd (`ctr images import`)
under the names the manifests use; pods run them with `imagePullPolicy: Never` (or IfNotPresent,
which then finds them). Each image is one uncompressed layer, so its diff ID is its digest.

- busybox: Debian's static busybox with a link per applet. It stands in for the workload images
  (busybox:1.36 in fixtures/workloads/probe.yaml) and for anything that needs a shell.
- pause: ci/node/pause, standing in for registry.k8s.io/pause as the sandbox image.
- allreduce: ci/node/allreduce as /allreduce, a two-rank all-reduce over TCP standing in for
  nccl-tests' all_reduce_perf (same flags and summary lines), with busybox so a manifest can wrap
  it in `sh -c`.
- on a kubelet node that is a canary pool (GPUCANARY_FLEET_KUBELET_POOL=1), images under the names
  the fleet's ClusterPolicy and NVIDIADriver give, each doing as a real process what the control
  plane can observe of that operand (see operator_plugin_images and pool_operand_images), and the
  canary's GPU job, service and probe images.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pytest_gpucanary.errors import EnvError

BUSYBOX = "/bin/busybox"
PAUSE_IMAGE = "localhost/gpucanary/pause:1"
BUSYBOX_IMAGES = ("localhost/gpucanary/busybox:1", "docker.io/library/busybox:1.36", "docker.io/library/busybox:latest")
ALLREDUCE_IMAGE = "localhost/gpucanary/allreduce:1"
_BASH = ("/bin/bash", b'#!/bin/sh\nexec /bin/sh "$@"\n')  # for an operand's `bash -c` entrypoint script
_BASE_DIRS = ("bin", "etc", "dev", "proc", "sys", "run", "var", "root")  # in every image, with /tmp
_PASSWD = b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n"


@dataclass(frozen=True)
class ImageSpec:
    names: tuple[str, ...]
    entrypoint: tuple[str, ...]
    files: tuple[tuple[str, Path], ...]  # (path in image, file on this machine)
    links: tuple[tuple[str, str], ...] = ()  # (path in image, symlink target)
    data: tuple[tuple[str, bytes], ...] = ()  # (path in image, content), executable
    env: tuple[str, ...] = ()  # NAME=value, besides PATH


def _member(
    name: str, *, kind: bytes = tarfile.REGTYPE, mode: int = 0o644, size: int = 0, link: str = ""
) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.linkname, info.mtime = kind, mode, size, link, 0
    return info


def _layer(spec: ImageSpec) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for directory in _BASE_DIRS:
            tar.addfile(_member(directory, kind=tarfile.DIRTYPE, mode=0o755))
        tar.addfile(_member("tmp", kind=tarfile.DIRTYPE, mode=0o1777))
        tar.addfile(_member("etc/passwd", size=len(_PASSWD)), io.BytesIO(_PASSWD))
        inside_paths = [inside for inside, _ in (*spec.files, *spec.data, *spec.links)]
        parents = sorted(
            {str(parent) for inside in inside_paths for parent in Path(inside.lstrip("/")).parents}
            - {".", "tmp", *_BASE_DIRS}
        )
        for directory in parents:
            tar.addfile(_member(directory, kind=tarfile.DIRTYPE, mode=0o755))
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
        config = {
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "Env": ["PATH=/usr/bin:/bin", *spec.env],
                "Entrypoint": list(spec.entrypoint),
                "WorkingDir": "/",
            },
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        }
        config_digest, config_size = _blob(tar, json.dumps(config).encode())
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": config_digest,
                "size": config_size,
            },
            "layers": [
                {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest, "size": layer_size}
            ],
        }
        manifest_digest, manifest_size = _blob(tar, json.dumps(manifest).encode())
        index = {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": manifest_digest,
                    "size": manifest_size,
                    "annotations": {
                        "io.containerd.image.name": name,
                        "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1],
                    },
                }
                for name in spec.names
            ],
        }
        for name, data in (
            ("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'),
            ("index.json", json.dumps(index).encode()),
        ):
            tar.addfile(_member(name, size=len(data)), io.BytesIO(data))


def _busybox_applets() -> list[str]:
    if not Path(BUSYBOX).exists():
        raise EnvError(
            f"{BUSYBOX} is missing, so the kubelet node has no workload image",
            hint="apt-get install busybox-static (ci/install-node-deps.sh)",
        )
    listed = subprocess.run([BUSYBOX, "--list"], capture_output=True, text=True, check=True).stdout.split()
    return [applet for applet in listed if applet != "busybox"]


def _busybox(
    names: tuple[str, ...],
    entrypoint: tuple[str, ...] = ("/bin/sh",),
    *,
    files: tuple[tuple[str, Path], ...] = (),
    data: tuple[tuple[str, bytes], ...] = (),
    env: tuple[str, ...] = (),
) -> ImageSpec:
    return ImageSpec(
        names,
        entrypoint,
        (("/bin/busybox", Path(BUSYBOX)), *files),
        tuple((f"/bin/{applet}", "busybox") for applet in _busybox_applets()),
        data,
        env,
    )


def shared_libraries(binary: Path) -> tuple[tuple[str, Path], ...]:
    """The machine's shared libraries a dynamically linked `binary` loads (its loader among them), each at its
    own path: what a cgo binary needs in an image that is otherwise a static busybox."""
    listed = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True).stdout
    paths = [word for line in listed.splitlines() for word in line.split() if word.startswith("/")]
    return tuple((path, Path(path)) for path in dict.fromkeys(paths))


def operator_plugin_images(*, device_plugin: str, plugin_dir: Path) -> list[ImageSpec]:
    """The image of the GPU Operator's device-plugin and GFD DaemonSet pods, under the ClusterPolicy's device plugin
    name (NVIDIA ships both commands in that image): NVIDIA's binaries from `plugin_dir` (cgo: with the C library
    they and the NVML library they load link), and busybox for the operator's entrypoint script (sh, lsmod).
    Like NVIDIA's image (a CUDA base) it asks the NVIDIA runtime for every GPU, which then mounts the driver's
    NVML into GFD's container."""
    binaries = [plugin_dir / name for name in ("nvidia-device-plugin", "gpu-feature-discovery")]
    libraries = dict(library for binary in binaries for library in shared_libraries(binary))
    return [
        _busybox(
            (device_plugin,),
            ("/bin/nvidia-device-plugin",),
            files=(*((f"/bin/{b.name}", b) for b in binaries), *libraries.items()),
            data=(_BASH,),
            env=("NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"),
        ),
    ]


def dra_plugin_image(name: str, dra_dir: Path) -> ImageSpec:
    """The image of the GPU Operator's DRA kubelet plugin DaemonSet pods (GPUCluster mode), under the GPUCluster's
    draDriver name: NVIDIA's gpu-kubelet-plugin and the nvidia-cdi-hook it copies to the node (both cgo, with the C
    library they link), and busybox for the DaemonSet's `bash -c` script."""
    binaries = [dra_dir / "gpu-kubelet-plugin", dra_dir / "nvidia-cdi-hook"]
    libraries = dict(library for binary in binaries for library in shared_libraries(binary))
    return _busybox(
        (name,),
        ("/usr/bin/gpu-kubelet-plugin",),
        files=(*((f"/usr/bin/{b.name}", b) for b in binaries), *libraries.items()),
        data=(_BASH,),
    )


# The driver container: `nvidia-driver init` loads the driver. Here that is /sys/module/nvidia/refcnt
# on a tmpfs in the container's own mount namespace (the startup probe reads it there) and a marker on
# the node's /run/nvidia that the driver manager unloads; then it waits for SIGTERM.
_DRIVER = b"""#!/bin/sh
set -eu
[ "${1:-}" = init ] || { echo "usage: nvidia-driver init"; exit 1; }
trap 'echo "driver container stopping"; exit 0' TERM INT
fault=$(head -n 1 /etc/driver-fault 2>/dev/null || true)
if [ "$fault" = crash ] || [ "$fault" = hang ]; then
  echo "Installing NVIDIA driver kernel modules..."; tail -n +2 /etc/driver-fault
  [ "$fault" = hang ] || exit 1
  while :; do sleep 1; done
fi
mount -t tmpfs -o size=1m nvidia-module /sys/module
mkdir -p /sys/module/nvidia /run/nvidia/validations
if [ "$fault" = unvalidated ]; then          # loads, but nvidia-smi fails for the validator
  tail -n +2 /etc/driver-fault > /run/nvidia/validations/.gpucanary-nvidia-smi-fails
else
  rm -f /run/nvidia/validations/.gpucanary-nvidia-smi-fails
fi
# the driver's root as NVIDIA's validator and device plugin find it (the real container binds its own root
# there): its nvidia-smi and libnvidia-ml.so.1, each renamed into place (a plugin may have the library mapped),
# which the driver manager removes when it unloads the driver
root=/run/nvidia/driver
mkdir -p $root/usr/bin $root/usr/lib64 $root/dev
# and its /dev, where the real container's module load makes the GPUs' device nodes (major 195): NVIDIA's CDI
# generator (the DRA kubelet plugin's) takes them from there for each prepared GPU; nothing opens them
for i in GPU_INDEXES; do [ -e $root/dev/nvidia$i ] || mknod -m 0666 $root/dev/nvidia$i c 195 $i; done
[ -e $root/dev/nvidiactl ] || mknod -m 0666 $root/dev/nvidiactl c 195 255
cp /usr/lib64/libnvidia-ml.so.1 $root/usr/lib64/.libnvidia-ml.so.1 && mv -f $root/usr/lib64/.libnvidia-ml.so.1 $root/usr/lib64/libnvidia-ml.so.1
# the versioned libraries by which NVIDIA's CDI generator (the DRA kubelet plugin's) finds the driver's library
# directory and what to mount from it (libcuda.so.<version>); the stand-in's NVML is the only library there
for lib in libcuda libnvidia-ml; do
  cp /usr/lib64/libnvidia-ml.so.1 $root/usr/lib64/.$lib && mv -f $root/usr/lib64/.$lib $root/usr/lib64/$lib.so.$(cat /etc/driver-version)
done
cp /etc/driver-root/nvidia-smi $root/usr/bin/.nvidia-smi && mv -f $root/usr/bin/.nvidia-smi $root/usr/bin/nvidia-smi
echo 1 > /sys/module/nvidia/refcnt
cat /etc/driver-version > /run/nvidia/gpucanary-driver-loaded
gpucanary-nvml-state /etc/nvml-gpus /run/nvidia/gpucanary-nvml.env
echo "driver $(cat /etc/driver-version) loaded"
while :; do sleep 1; done
"""
GPU_PRODUCT = "NVIDIA H100 80GB HBM3"  # the KWOK GPU nodes' (fixtures/fleet/gpu-node.yaml: GFD's gpu.product)
GPU_MEMORY_MIB = 81559  # its total memory as NVML reports it (GFD's nvidia.com/gpu.memory)
GPU_BUSES = ("18", "2A", "3A", "5D", "9A", "AB", "BA", "DB")  # the PCI bus of each of a node's eight GPUs
_DRIVER = _DRIVER.replace(b"GPU_INDEXES", " ".join(str(i) for i in range(len(GPU_BUSES))).encode())
NVML_STATE_PATH = "/run/nvidia/gpucanary-nvml.env"  # where the driver above writes it (the shim's default)
# What the node's NVML stand-in (ci/node/nvml-shim) answers while this driver is loaded: the driver's
# GPUs (`nvml_gpus`) and eight devices, their UUIDs derived from the node's name, written whole and then
# renamed, so a reader never sees half of it. The driver manager removes it when it unloads the driver.
NVML_STATE_SCRIPT = b"""#!/bin/sh
set -eu
gpus=$1 state=$2
{
  cat "$gpus"
  i=0
  for bus in BUSES; do
    h=$(echo "${NODE_NAME:-node}/$i" | md5sum | cut -c1-32)
    echo "DEVICE=GPU-$(echo "$h" | cut -c1-8)-$(echo "$h" | cut -c9-12)-$(echo "$h" | cut -c13-16)-$(echo "$h" | cut -c17-20)-$(echo "$h" | cut -c21-32) 00000000:$bus:00.0 $i"
    i=$((i + 1))
  done
} > "$state.new"
mv -f "$state.new" "$state"
""".replace(b"BUSES", " ".join(GPU_BUSES).encode())
# CUDA driver API version per driver branch (nvidia-smi's "CUDA Version"): the highest branch at or below
# the driver's major version
_CUDA_OF_BRANCH = {580: 13000, 575: 12090, 570: 12080, 565: 12070, 560: 12060, 555: 12050, 550: 12040}


def cuda_driver_version(version: str) -> int:
    """The CUDA driver API version of a driver (NVML's nvmlSystemGetCudaDriverVersion: 13000 for 580)."""
    major = version.split(".", 1)[0]
    return next(
        (
            c
            for branch, c in sorted(_CUDA_OF_BRANCH.items(), reverse=True)
            if branch <= (int(major) if major.isdigit() else 0)
        ),
        12040,
    )


def gpu_uuid(node: str, index: int) -> str:
    """The NVML UUID of a fleet node's GPU `index`, as NVML_STATE_SCRIPT derives it from the node's name."""
    h = hashlib.md5(f"{node}/{index}\n".encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def nvml_gpus(version: str) -> str:
    """The driver's part of the NVML state: the KWOK GPU nodes' GPU, an H100 80GB HBM3 (fixtures/fleet/gpu-node.yaml:
    GFD's nvidia.com/gpu.product and .memory), on `version`."""
    return (
        "\n".join(
            (
                f"DRIVER_VERSION={version}",
                f"CUDA_DRIVER_VERSION={cuda_driver_version(version)}",
                f"PRODUCT_NAME={GPU_PRODUCT}",
                f"MEMORY_TOTAL_BYTES={GPU_MEMORY_MIB << 20}",
                "CUDA_COMPUTE_CAPABILITY=9.0",
                "ARCHITECTURE=HOPPER",
                "BRAND=NVIDIA",
                "PCI_DEVICE_ID=0x233010de",
                "PCI_SUBSYSTEM_ID=0x16c110de",
            )
        )
        + "\n"
    )


_NVIDIA_SMI = b"""#!/bin/sh
[ -f /sys/module/nvidia/refcnt ] || { echo "NVIDIA-SMI has failed: no driver loaded"; exit 9; }
echo "NVIDIA-SMI $(cat /etc/driver-version)   Driver Version: $(cat /etc/driver-version)"
"""
# The nvidia-smi of the driver's root, which NVIDIA's validator runs in its own container (where the driver's
# /sys/module is not): it fails as the fleet's "unvalidated" fault says while that fault's driver is loaded.
_DRIVER_ROOT_NVIDIA_SMI = """#!/bin/sh
fault=/run/nvidia/validations/.gpucanary-nvidia-smi-fails
if [ -f "$fault" ]; then cat "$fault"; exit 9; fi
echo "NVIDIA-SMI {version}   Driver Version: {version}"
"""
# nvcr.io/nvidia/k8s/cuda-sample:vectoradd: /cuda-samples/vectorAdd prints what the sample prints.
_VECTOR_ADD = b"""#!/bin/sh
echo "[Vector addition of 50000 elements]"
echo "Copy input data from the host memory to the CUDA device"
echo "CUDA kernel launch with 196 blocks of 256 threads"
echo "Copy output data from the CUDA device to the host memory"
echo "Test PASSED"
echo "Done"
"""

# agnhost netexec (the default service): a real HTTP server on 127.0.0.1 (a hostNetwork pod on the
# kubelet node), /readyz answering until SIGTERM, which stops it.
_AGNHOST = b"""#!/bin/sh
[ "${1:-}" = netexec ] || { echo "this agnhost has netexec only"; exit 1; }
port=8080
for arg; do case "$arg" in --http-port=*) port=${arg#*=} ;; esac; done
mkdir -p /tmp/www && echo ok > /tmp/www/readyz && echo ok > /tmp/www/index.html
httpd -f -p "127.0.0.1:$port" -h /tmp/www & server=$!
echo "netexec serving on 127.0.0.1:$port"
trap 'echo "SIGTERM: not ready, stopping"; rm -f /tmp/www/readyz; kill $server; exit 0' TERM INT
wait $server
"""


def pool_operand_images(
    bin_dir: Path,
    apiserver_url: str,
    *,
    validator: tuple[str, ...],
    validator_bin: Path,
    nvml_shim: Path,
    driver_manager: str,
    drivers: tuple[str, ...],
    cuda_sample: str,
    probe: str,
    service: str,
    faults: Mapping[str, tuple[str, str]] | None = None,
) -> list[ImageSpec]:
    """The images of the operator's driver and validator pods, and of the canary's GPU job, probe and
    service, for a kubelet node that is a canary pool. The validator's is NVIDIA's `validator_bin` (built
    from the operator release's tree); each driver's root holds the NVML stand-in `nvml_shim`. `drivers` are
    driver image names (<repository>/driver:<version>-<os>); a version in `faults` gets a driver container that prints the
    fault's message and then exits 1 ("crash") or waits without loading ("hang"), or that loads while the
    validator's nvidia-smi check fails with the message and retries ("unvalidated")."""
    faults = faults or {}
    specs = [
        _busybox(validator, files=(("/bin/nvidia-validator", validator_bin),)),
        _busybox(
            (driver_manager,),
            ("/bin/driver-manager",),
            files=(("/bin/driver-manager", bin_dir / "driver-manager"),),
            data=(("/etc/gpucanary/apiserver", apiserver_url.encode() + b"\n"),),
        ),
        _busybox((cuda_sample,), data=(("/cuda-samples/vectorAdd", _VECTOR_ADD),)),
        _busybox((probe,)),
        _busybox((service,), ("/agnhost",), data=(("/agnhost", _AGNHOST),)),
    ]
    for name in drivers:
        version = name.rsplit(":", 1)[1].split("-", 1)[0]
        fault = (("/etc/driver-fault", "\n".join(faults[version]).encode() + b"\n"),) if version in faults else ()
        specs.append(
            _busybox(
                (name,),
                ("/bin/nvidia-driver",),
                files=(("/usr/lib64/libnvidia-ml.so.1", nvml_shim),),
                data=(
                    ("/bin/nvidia-driver", _DRIVER),
                    ("/bin/nvidia-smi", _NVIDIA_SMI),
                    ("/etc/driver-root/nvidia-smi", _DRIVER_ROOT_NVIDIA_SMI.format(version=version).encode()),
                    ("/bin/gpucanary-nvml-state", NVML_STATE_SCRIPT),
                    ("/etc/nvml-gpus", nvml_gpus(version).encode()),
                    ("/etc/driver-version", version.encode() + b"\n"),
                    *fault,
                ),
            )
        )
    return specs


def node_images(bin_dir: Path) -> list[ImageSpec]:
    """The images every kubelet node gets."""
    return [
        _busybox(BUSYBOX_IMAGES),
        ImageSpec((PAUSE_IMAGE,), ("/pause",), (("/pause", bin_dir / "pause"),)),
        _busybox((ALLREDUCE_IMAGE,), ("/allreduce",), files=(("/allreduce", bin_dir / "allreduce"),)),
    ]


def import_images(
    specs: list[ImageSpec], *, directory: Path, address: Path, enter: tuple[str, ...] = (), ctr: Path | None = None
) -> None:
    """Write each image's tar under `directory` and import it into containerd's k8s.io namespace;
    `enter` prefixes ctr's command line (nsenter into the namespace where `address` is); `ctr` is the runtime's own
    (Debian's on PATH when None)."""
    found = str(ctr) if ctr else shutil.which("ctr")
    if found is None:
        raise EnvError("ctr is not installed", hint="apt-get install containerd (ci/install-node-deps.sh)")
    directory.mkdir(parents=True, exist_ok=True)
    for spec in specs:
        path = directory / (spec.names[0].rsplit("/", 1)[1].replace(":", "-") + ".tar")
        write_oci_tar(spec, path)
        result = subprocess.run(
            [*enter, found, f"--address={address}", "--namespace=k8s.io", "images", "import", str(path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if result.returncode != 0:
            raise EnvError(f"ctr images import {path.name} failed: {result.stderr.strip()[:300]}")
