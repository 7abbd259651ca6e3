"""A DRA node's GPUs across the driver swap, from its ResourceSlices.

NVIDIA's DRA kubelet plugin (driver `gpu.nvidia.com`) publishes a node's GPUs as ResourceSlices, each device with
a `driverVersion` attribute (semver: 580.95.05 is 580.95.5), read from NVML when the plugin starts. The driver manager
takes the plugin off the node for the swap (`nvidia.com/gpu.deploy.dra-driver`, k8s-driver-manager #203); the kubelet
deletes its slices 30 s after it unregisters (kubelet `defaultWipingDelay`), and the plugin restarted on the new
driver publishes them again: onto an empty pool at generation 1, or, back within those 30 s, by updating its slice in
place at the same generation (k8s.io/dynamic-resource-allocation's ResourceSlice controller). So neither the gap nor
the generation says the plugin restarted; the versions do. A plugin that was never taken off keeps offering the old
driver's devices, and its CDI specs fail the claims prepared against them (#203): the device rung wants each pool
node's slices, at the end, to offer as many devices as before, every one at the target. Pure: reads a RunEvidence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pytest_gpucanary.gpu_operator import DRA_GPU_DRIVER
from pytest_gpucanary.ladder.model import Evidence, Outcome
from pytest_gpucanary.ladder.rules import Finding

if TYPE_CHECKING:
    from pytest_gpucanary.ladder.evidence import RunEvidence

GPU_DRIVER = DRA_GPU_DRIVER  # NVIDIA's DRA driver for GPUs
KIND = "ResourceSlice"


def stream_name(node: str) -> str:
    """The recorder's stream of one node's slices: a relist's marker names no node, its stream does."""
    return f"slices-{node}"


def semver(version: str) -> str:
    """A driver version as the DRA driver writes it: 580.95.05 -> 580.95.5."""
    return ".".join(str(int(part)) if part.isdigit() else part for part in version.split("."))


def trimmed_spec(spec: dict) -> dict:
    """What the recorder keeps of a slice: its pool and each device's driverVersion (devices carry a dozen more
    attributes the ladder does not read)."""
    devices = []
    for device in spec.get("devices") or []:
        attributes = device.get("attributes") or {}
        version = next(
            (v.get("version") or v.get("string") for k, v in attributes.items() if k.split("/")[-1] == "driverVersion"),
            None,
        )
        devices.append({"name": device.get("name"), "driverVersion": version})
    return {k: spec.get(k) for k in ("driver", "nodeName", "pool")} | {"devices": devices}


@dataclass(frozen=True)
class Offer:
    """What the node's slices offered from one instant on: none at all, or a pool generation and devices."""

    wall_ns: int
    slices: int
    generation: int
    devices: int
    versions: tuple[str, ...]

    def describe(self) -> str:
        if not self.slices:
            return "no slice: the DRA kubelet plugin is not registered"
        return f"generation {self.generation}, {self.devices} devices at driverVersion {'/'.join(self.versions) or '?'}"


@dataclass(frozen=True)
class SliceCycle:
    node: str
    before: Offer | None  # standing at the upgrade's start; None where the node offered nothing then
    gone: Offer | None  # the first instant after the start with no slice of the node
    final: Offer | None  # the last change after the start; None where nothing changed
    offers: tuple[Offer, ...]  # every change


def _offer(wall_ns: int, live: dict[str, dict]) -> Offer:
    devices = [d for s in live.values() for d in s.get("devices") or []]
    return Offer(
        wall_ns,
        len(live),
        max((int((s.get("pool") or {}).get("generation") or 0) for s in live.values()), default=0),
        len(devices),
        tuple(sorted({d.get("driverVersion") or "?" for d in devices})),
    )


def _offers(ev: RunEvidence, node: str) -> list[Offer]:
    live: dict[str, dict] = {}
    changes: list[Offer] = []
    records = [
        r
        for r in ev.index.of_kind(KIND)
        if r.stream == stream_name(node) or (r.object.get("spec") or {}).get("nodeName") == node
    ]
    for i, record in enumerate(records):
        spec = record.object.get("spec") or {}
        if record.type == "RELISTED":
            live = {}
        elif record.type == "WATCH_ERROR" or spec.get("driver") != GPU_DRIVER:
            continue
        elif record.type == "DELETED":
            live.pop(record.name or "", None)
        else:
            live[record.name or ""] = spec
        if i + 1 < len(records) and records[i + 1].received_wall_ns == record.received_wall_ns:
            continue  # a relist's items arrive at its marker's instant: judge the set once it is whole
        offer = _offer(record.received_wall_ns, live)
        if not changes or changes[-1].describe() != offer.describe():
            changes.append(offer)
    return changes


def slice_cycle(ev: RunEvidence, node: str) -> SliceCycle | None:
    """The node's offers around the upgrade; None where no slice of NVIDIA's GPU driver was ever recorded for it
    (a cluster whose GPUs are extended resources)."""
    offers = _offers(ev, node)
    if not any(o.slices for o in offers):
        return None
    start = ev.upgrade_started_wall_ns
    before = next((o for o in reversed(offers) if o.wall_ns <= start), None)
    after = [o for o in offers if o.wall_ns > start]
    gone = next((o for o in after if not o.slices), None)
    return SliceCycle(
        node, before if before and before.slices else None, gone, after[-1] if after else None, tuple(offers)
    )


def judge(ev: RunEvidence, node: str) -> tuple[Finding | None, list[Evidence]]:
    """The device rung's ResourceSlice finding for a pool node that upgraded, with its evidence; no finding where
    the node offers no DRA GPUs."""
    cycle = slice_cycle(ev, node)
    if cycle is None:
        return None, []
    start = ev.upgrade_started_wall_ns
    items = [
        Evidence(o.wall_ns, ev.offset_s(o.wall_ns), KIND, node, o.describe())
        for o in cycle.offers
        if o.wall_ns > start or o is cycle.before
    ]
    before, final, target = cycle.before, cycle.final, semver(ev.driver_to)
    what = f"node {node}'s {GPU_DRIVER} ResourceSlices"
    if before is None:
        return Finding(Outcome.INCONCLUSIVE, f"node {node} offered no {GPU_DRIVER} devices before the upgrade"), items
    end = final or before
    at_target = end.devices >= before.devices and end.versions == (target,)
    if final is None and not at_target:
        return Finding(
            Outcome.FAIL,
            f"{what} never changed ({before.describe()}): the DRA kubelet plugin was not restarted on the new "
            "driver and offers the old one's devices (k8s-driver-manager #203)",
        ), items
    if not end.slices:
        return Finding(Outcome.FAIL, f"{what} went away and did not come back"), items
    if not at_target:
        return Finding(
            Outcome.FAIL, f"{what} offer {end.describe()} at the end, expected {before.devices} devices at {target}"
        ), items
    if final is None:  # a change that keeps the driver's version: nothing tells the slices apart
        return Finding(
            Outcome.PASS, f"{what} offered the target throughout ({before.describe()}); the plugin's pod says more"
        ), items
    how = (
        f"went away at {ev.offset_s(cycle.gone.wall_ns):+.0f}s and came back"
        if cycle.gone is not None
        else "were republished in place (the plugin was back within the kubelet's 30 s)"
    )
    return Finding(
        Outcome.PASS,
        f"{what} {how} at {ev.offset_s(final.wall_ns):+.0f}s: {final.describe()} (was {before.describe()})",
    ), items
