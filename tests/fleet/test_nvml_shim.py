"""ci/node/nvml-shim, the kubelet node's libnvidia-ml.so.1 stand-in, as NVIDIA's own Go bindings see it
(go-nvml v0.13.4-1 with go-nvlib and go-gpuallocator, through its nvml-check client): no driver
loaded, eight H200s on 580.95.05, a driver swapped while one process initializes NVML again, and a
malformed state file; and through ctypes what go-nvml cannot reach: calls before nvmlInit, short
buffers, a nested nvmlInit. Skipped only when ci/build-nvml-shim.sh has not built it."""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import uuid
from collections.abc import Iterator
from enum import IntEnum
from pathlib import Path

import pytest

from pytest_gpucanary.fleet.binaries import CI_DIR, NVML_SHIM

GPU_UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
UUIDS = [f"GPU-{uuid.uuid5(uuid.NAMESPACE_URL, f'gpucanary/canary-0/{i}')}" for i in range(8)]
BUS_IDS = [f"00000000:{bus}:00.0" for bus in ("18", "2A", "3A", "5D", "9A", "AB", "BA", "DB")]  # an HGX board's
H200_MEMORY_BYTES = 143771 << 20  # nvidia-smi's 143771 MiB
H200_PCI_DEVICE_ID = 0x233510DE  # device 0x2335, vendor 0x10de
EVENT_WAIT_MS = 100  # nvml-check's wait on its event set
PER_GPU_CALLS = ("DeviceGetHandleByIndex", "DeviceGetName", "DeviceGetUUID", "DeviceGetMemoryInfo",
                 "DeviceGetMemoryInfo_v2", "DeviceGetPciInfo", "DeviceGetMinorNumber", "DeviceGetCudaComputeCapability",
                 "DeviceGetArchitecture", "DeviceGetBrand", "DeviceGetHandleByUUID", "DeviceGetHandleByPciBusId")


class Nvml(IntEnum):
    """nvmlReturn_t values (nvml.h) the shim returns."""

    SUCCESS = 0
    UNINITIALIZED = 1
    INVALID_ARGUMENT = 2
    NOT_SUPPORTED = 3
    NOT_FOUND = 6
    INSUFFICIENT_SIZE = 7
    DRIVER_NOT_LOADED = 9
    TIMEOUT = 10
    UNKNOWN = 999


def answer(code: Nvml, error: str) -> dict[str, object]:
    return {"code": int(code), "error": error}


def built_shim() -> Path:
    """The build of GPUCANARY_NVML_SHIM_DIR, else of the build cache when it matches these sources."""
    explicit = os.environ.get(NVML_SHIM.env_var)
    if explicit:
        shim_dir = Path(explicit)
    else:
        cached = subprocess.run(["bash", str(CI_DIR / NVML_SHIM.script), "--cached"],
                                capture_output=True, text=True, timeout=30)
        if cached.returncode != 0:
            pytest.skip("the NVML shim is not built: run bash ci/build-nvml-shim.sh")
        shim_dir = Path(cached.stdout.strip())
    missing = [name for name in NVML_SHIM.required if not (shim_dir / name).is_file()]
    if missing:
        pytest.skip(f"{shim_dir} has no {missing[0]}: run bash ci/build-nvml-shim.sh")
    return shim_dir


@pytest.fixture
def shim_dir() -> Path:
    return built_shim()


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "gpucanary-nvml.env"


def h200_state(driver_version: str, cuda_driver_version: int) -> str:
    devices = [f"DEVICE={gpu_uuid} {bus_id} {minor}" for minor, (gpu_uuid, bus_id) in enumerate(zip(UUIDS, BUS_IDS))]
    return "\n".join([
        "# written by the fleet's driver stand-in", f"DRIVER_VERSION={driver_version}",
        f"CUDA_DRIVER_VERSION={cuda_driver_version}", "PRODUCT_NAME=NVIDIA H200",
        f"MEMORY_TOTAL_BYTES={H200_MEMORY_BYTES}", "CUDA_COMPUTE_CAPABILITY=9.0", "ARCHITECTURE=HOPPER",
        "BRAND=NVIDIA", f"PCI_DEVICE_ID={H200_PCI_DEVICE_ID:#x}", "PCI_SUBSYSTEM_ID=0x18be10de", *devices,
    ]) + "\n"


STATE_LINES = h200_state("580.95.05", 13000).count("\n")


def check_env(state: Path) -> dict[str, str]:
    return {**os.environ, "GPUCANARY_NVML_STATE": str(state)}


def run_check(shim_dir: Path, state: Path) -> tuple[dict, str]:
    """One nvmlInit round of nvml-check: what it printed, and its stderr."""
    result = subprocess.run([str(shim_dir / "nvml-check")], capture_output=True, text=True, timeout=60,
                            env=check_env(state))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout), result.stderr


@pytest.mark.parametrize("content", [None, "", h200_state("", 13000)],
                         ids=["no state file", "empty file", "driver unloaded"])
def test_no_driver_loaded_fails_nvml_init_and_nothing_else_answers(shim_dir: Path, state: Path,
                                                                    content: str | None) -> None:
    if content is not None:
        state.write_text(content)
    seen, stderr = run_check(shim_dir, state)
    assert seen["init"] == answer(Nvml.DRIVER_NOT_LOADED, "Driver Not Loaded")
    assert seen["calls"] == {"SystemGetDriverVersion": answer(Nvml.UNINITIALIZED, "Uninitialized"),
                             "DeviceGetCount": answer(Nvml.UNINITIALIZED, "Uninitialized")}
    assert (seen["driver_version"], seen["count"], seen["gpus"]) == ("", 0, [])
    assert seen["shutdown"]["code"] == Nvml.UNINITIALIZED
    assert stderr == ""


def test_eight_h200s_on_580_95_05_as_nvidias_bindings_see_them(shim_dir: Path, state: Path) -> None:
    state.write_text(h200_state("580.95.05", 13000))
    seen, stderr = run_check(shim_dir, state)
    assert seen["init"] == answer(Nvml.SUCCESS, "Success")
    assert (seen["driver_version"], seen["nvml_version"]) == ("580.95.05", "13.580.95.05")
    assert (seen["cuda_driver_version"], seen["cuda_driver_version_v2"]) == (13000, 13000)
    assert seen["count"] == 8
    gpus = seen["gpus"]
    assert [g["index"] for g in gpus] == list(range(8))
    assert {g["name"] for g in gpus} == {"NVIDIA H200"}
    assert [g["uuid"] for g in gpus] == UUIDS
    assert len({g["uuid"] for g in gpus}) == 8 and all(GPU_UUID.match(g["uuid"]) for g in gpus)
    assert {(g["memory_total_bytes"], g["memory_free_bytes"], g["memory_v2_total_bytes"]) for g in gpus} \
        == {(H200_MEMORY_BYTES, H200_MEMORY_BYTES, H200_MEMORY_BYTES)}
    assert [g["pci_bus_id"] for g in gpus] == BUS_IDS
    assert {g["pci_device_id"] for g in gpus} == {H200_PCI_DEVICE_ID}
    assert [g["minor"] for g in gpus] == list(range(8))
    assert {(g["compute_capability"], g["architecture"], g["brand"]) for g in gpus} == {("9.0", 9, 14)}
    assert [(g["index_by_uuid"], g["index_by_pci_bus_id"]) for g in gpus] == [(i, i) for i in range(8)]
    # go-nvlib's strings, which GFD turns into labels; MIG, fabric and coherence all read as absent
    assert seen["nvlib_error"] == ""
    assert [g["pci_bus_id"] for g in seen["nvlib"]] == [b.removeprefix("0000").lower() for b in BUS_IDS]
    assert {(g["architecture"], g["brand"], g["compute_capability"]) for g in seen["nvlib"]} \
        == {("Hopper", "Nvidia", "9.0")}
    assert not any(g[flag] for g in seen["nvlib"]
                   for flag in ("mig_capable", "mig_enabled", "fabric_attached", "coherent"))
    # the device plugin's GetPreferredAllocation: go-gpuallocator needs a topology level for every pair
    assert seen["allocator_error"] == ""
    assert len(seen["preferred_allocation"]) == 2 and set(seen["preferred_allocation"]) <= set(UUIDS)
    assert (seen["is_mig_device"], seen["max_mig_device_count"]) == (False, 0)
    assert EVENT_WAIT_MS <= seen["event_wait_ms"] < EVENT_WAIT_MS + 1000
    not_success = {name: c for name, c in seen["calls"].items() if c["code"] != Nvml.SUCCESS}
    assert not_success == {"DeviceGetHandleByUUID/unknown": answer(Nvml.NOT_FOUND, "Not Found"),
                           "DeviceGetMigMode/0": answer(Nvml.NOT_SUPPORTED, "Not Supported"),
                           # NVIDIA's DRA kubelet plugin asks every GPU for each GPU instance profile
                           "DeviceGetGpuInstanceProfileInfo/0": answer(Nvml.NOT_SUPPORTED, "Not Supported"),
                           "DeviceGetNvLinkState/0": answer(Nvml.NOT_SUPPORTED, "Not Supported"),
                           "EventSetWait": answer(Nvml.TIMEOUT, "Timeout")}
    assert {f"{name}/{i}" for name in PER_GPU_CALLS for i in range(8)} <= seen["calls"].keys()
    assert seen["shutdown"]["code"] == Nvml.SUCCESS
    assert stderr == ""


def test_a_driver_swap_shows_when_the_process_initializes_nvml_again(shim_dir: Path, state: Path) -> None:
    """575.57.08 loaded, then unloaded, then 580.95.05: three nvmlInit rounds of one nvml-check."""
    state.write_text(h200_state("575.57.08", 12090))
    check = subprocess.Popen([str(shim_dir / "nvml-check"), "-rounds", "3"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=check_env(state))
    assert check.stdin is not None and check.stdout is not None

    def next_round(content: str) -> dict:
        state.write_text(content)
        check.stdin.write("\n")
        check.stdin.flush()
        return json.loads(check.stdout.readline())

    try:
        old = json.loads(check.stdout.readline())
        unloaded = next_round("DRIVER_VERSION=\n")
        new = next_round(h200_state("580.95.05", 13000))
        _, stderr = check.communicate(timeout=30)
    finally:
        check.kill()
    assert check.returncode == 0, stderr
    assert (old["init"]["code"], old["driver_version"], old["cuda_driver_version"], old["count"]) \
        == (Nvml.SUCCESS, "575.57.08", 12090, 8)
    assert (unloaded["init"]["code"], unloaded["count"]) == (Nvml.DRIVER_NOT_LOADED, 0)
    assert (new["init"]["code"], new["driver_version"], new["cuda_driver_version"], new["count"]) \
        == (Nvml.SUCCESS, "580.95.05", 13000, 8)
    assert [g["uuid"] for g in new["gpus"]] == UUIDS


@pytest.mark.parametrize(("line", "problem"), [
    (f"DEVICE={UUIDS[0].upper()} 00000000:18:00.0 0", "DEVICE's UUID is not GPU-"),
    (f"DEVICE={UUIDS[0]} 00000000:18:00.1 0", "DEVICE's PCI bus id is not"),
    ("ARCHITECTURE=hopper", "ARCHITECTURE is not an NVML_DEVICE_ARCH_ suffix"),
    ("MEMORY_TOTAL_BYTES=141GB", "MEMORY_TOTAL_BYTES is not an integer"),
    ("DRIVER VERSION=580.95.05", "unknown key"),
], ids=["uppercase UUID", "PCI function 1", "architecture in lowercase", "memory with a unit", "key with a space"])
def test_a_malformed_state_file_fails_nvml_init_with_one_line_naming_it(shim_dir: Path, state: Path,
                                                                         line: str, problem: str) -> None:
    state.write_text(h200_state("580.95.05", 13000) + line + "\n")
    seen, stderr = run_check(shim_dir, state)
    assert seen["init"] == answer(Nvml.UNKNOWN, "Unknown Error")
    assert seen["calls"]["DeviceGetCount"]["code"] == Nvml.UNINITIALIZED
    assert stderr.count("\n") == 1 and f"{state}:{STATE_LINES + 1}: {problem}" in stderr


def test_a_loaded_driver_without_every_key_fails_nvml_init(shim_dir: Path, state: Path) -> None:
    state.write_text("".join(line + "\n" for line in h200_state("580.95.05", 13000).splitlines()
                             if not line.startswith("BRAND=")))
    seen, stderr = run_check(shim_dir, state)
    assert seen["init"]["code"] == Nvml.UNKNOWN
    assert stderr == f"libnvidia-ml (gpucanary NVML shim): {state}: no BRAND line (a loaded driver needs every key)\n"


@pytest.fixture
def nvml(shim_dir: Path, state: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ctypes.CDLL]:
    """The shim loaded into this process with ctypes (one copy for every test); the test must leave
    NVML shut down, and this shuts it down for the next test if it did not."""
    monkeypatch.setenv("GPUCANARY_NVML_STATE", str(state))
    lib = ctypes.CDLL(str(shim_dir / "libnvidia-ml.so.1"))
    lib.nvmlErrorString.restype = ctypes.c_char_p
    yield lib
    left_initialized = 0
    while lib.nvmlShutdown() == Nvml.SUCCESS:
        left_initialized += 1
    assert left_initialized == 0, "the test left NVML initialized"


def driver_version(nvml: ctypes.CDLL, length: int = 80) -> tuple[int, str]:
    buffer = ctypes.create_string_buffer(length)
    return nvml.nvmlSystemGetDriverVersion(buffer, length), buffer.value.decode()


def test_calls_before_nvml_init_and_into_short_buffers_fail_as_nvml_h_says(nvml: ctypes.CDLL, state: Path) -> None:
    count = ctypes.c_uint(99)
    assert driver_version(nvml) == (Nvml.UNINITIALIZED, "")
    assert nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == Nvml.UNINITIALIZED and count.value == 99
    assert nvml.nvmlShutdown() == Nvml.UNINITIALIZED
    assert nvml.nvmlErrorString(Nvml.UNINITIALIZED) == b"Uninitialized"
    state.write_text(h200_state("580.95.05", 13000))
    assert nvml.nvmlInit_v2() == Nvml.SUCCESS
    assert driver_version(nvml, len("580.95.05")) == (Nvml.INSUFFICIENT_SIZE, "")
    assert driver_version(nvml, len("580.95.05") + 1) == (Nvml.SUCCESS, "580.95.05")
    assert nvml.nvmlDeviceGetCount_v2(None) == Nvml.INVALID_ARGUMENT
    assert nvml.nvmlShutdown() == Nvml.SUCCESS
    assert nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == Nvml.UNINITIALIZED


def test_a_nested_nvml_init_keeps_the_driver_its_first_init_read(nvml: ctypes.CDLL, state: Path) -> None:
    state.write_text(h200_state("580.95.05", 13000))
    assert nvml.nvmlInitWithFlags(0) == Nvml.SUCCESS
    state.write_text(h200_state("575.57.08", 12090))
    assert nvml.nvmlInit() == Nvml.SUCCESS
    assert driver_version(nvml) == (Nvml.SUCCESS, "580.95.05")
    assert nvml.nvmlShutdown() == Nvml.SUCCESS
    assert driver_version(nvml) == (Nvml.SUCCESS, "580.95.05")
    assert nvml.nvmlShutdown() == Nvml.SUCCESS
    assert nvml.nvmlInit_v2() == Nvml.SUCCESS
    assert driver_version(nvml) == (Nvml.SUCCESS, "575.57.08")
    assert nvml.nvmlShutdown() == Nvml.SUCCESS


def test_a_fleet_driver_writes_eight_h100s_at_its_version_with_uuids_of_its_node(shim_dir: Path, tmp_path: Path) -> None:
    """What the kubelet node's driver stand-in writes when it loads (fleet/images.py), run here by sh."""
    from pytest_gpucanary.fleet.images import NVML_STATE_SCRIPT, nvml_gpus

    script, gpus = tmp_path / "gpucanary-nvml-state", tmp_path / "nvml-gpus"
    script.write_bytes(NVML_STATE_SCRIPT)
    gpus.write_text(nvml_gpus("580.95.05"))
    uuids = []
    for node in ("gpu-kubelet-0", "gpu-kubelet-1"):
        state = tmp_path / f"{node}.env"
        subprocess.run(["sh", str(script), str(gpus), str(state)], check=True, timeout=30,
                       env={**os.environ, "NODE_NAME": node})
        assert not state.with_name(state.name + ".new").exists()
        seen, stderr = run_check(shim_dir, state)
        assert stderr == "" and seen["init"] == answer(Nvml.SUCCESS, "Success")
        assert (seen["driver_version"], seen["cuda_driver_version"], seen["count"]) == ("580.95.05", 13000, 8)
        assert {(g["name"], g["memory_total_bytes"]) for g in seen["gpus"]} == {("NVIDIA H100 80GB HBM3", 81559 << 20)}
        assert [g["minor"] for g in seen["gpus"]] == list(range(8))
        assert all(GPU_UUID.match(g["uuid"]) for g in seen["gpus"])
        uuids.append({g["uuid"] for g in seen["gpus"]})
    assert len(uuids[0]) == len(uuids[1]) == 8 and not uuids[0] & uuids[1]
