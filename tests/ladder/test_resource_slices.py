"""The device rung on a node that offers its GPUs through DRA: its gpu.nvidia.com ResourceSlices, at the end of the
swap, offer as many devices as before with every one at the target (k8s-driver-manager #203), whether they went away
and came back onto an empty pool at generation 1 (the kubelet deletes them 30 s after the plugin unregisters) or were
updated in place at the same generation (the plugin was back sooner)."""

from __future__ import annotations

import dataclasses
import json

from canned_runs import HAPPY, NEW, NODE, OLD, at, node, operands, run, states, workloads

from pytest_gpucanary.canary.recorder import Record, trim
from pytest_gpucanary.ladder import Outcome
from pytest_gpucanary.ladder.device import check_device
from pytest_gpucanary.ladder.evidence import RunEvidence
from pytest_gpucanary.ladder.slices import judge, semver, slice_cycle, stream_name


def resource_slice(name: str, *, generation: int, version: str, devices: int = 8, driver: str = "gpu.nvidia.com"
                   ) -> dict:
    """As NVIDIA's DRA kubelet plugin publishes one, trimmed as the recorder keeps it."""
    return trim("ResourceSlice", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": name, "managedFields": [{"manager": "kubelet"}]},
        "spec": {"driver": driver, "nodeName": NODE,
                 "pool": {"name": NODE, "generation": generation, "resourceSliceCount": 1},
                 "devices": [{"name": f"gpu-{i}", "attributes": {"type": {"string": "gpu"},
                                                                   "uuid": {"string": f"GPU-{i}"},
                                                                   "driverVersion": {"version": semver(version)}},
                              "capacity": {"memory": {"value": "80Gi"}}} for i in range(devices)]}})


def seen(offset_s: float, kind_type: str, obj: dict) -> Record:
    return Record(stream_name(NODE), kind_type, "ResourceSlice", None, obj["metadata"]["name"], at(offset_s),
                  at(offset_s), obj)


def relisted(offset_s: float, *objs: dict) -> list[Record]:
    marker = Record(stream_name(NODE), "RELISTED", "ResourceSlice", None, None, at(offset_s), at(offset_s),
                    {"count": len(objs)})
    return [marker] + [seen(offset_s, "LISTED", o) for o in objs]


def upgraded_run(slice_records: list[Record]) -> RunEvidence:
    schedule = list(zip([5, 10, 12, 14, 26, 90, 130, 135], HAPPY))
    return run(states(schedule) + operands() + workloads() + [node(500, "upgrade-done")] + slice_records)


OLD_SLICE = resource_slice(f"00000-gpu.nvidia.com-{NODE}-abcde", generation=1, version=OLD)
NEW_SLICE = resource_slice(f"00000-gpu.nvidia.com-{NODE}-fghij", generation=1, version=NEW)  # onto an empty pool


def test_the_recorder_keeps_the_pool_and_each_devices_driver_version_only() -> None:
    assert OLD_SLICE["spec"] == {"driver": "gpu.nvidia.com", "nodeName": NODE,
                                 "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
                                 "devices": [{"name": f"gpu-{i}", "driverVersion": "580.82.7"} for i in range(8)]}
    assert "managedFields" not in OLD_SLICE["metadata"]
    assert semver("580.95.05") == "580.95.5" and semver("575.57.08") == "575.57.8"


def test_slices_gone_in_the_swap_and_back_at_the_target_pass_with_their_evidence() -> None:
    evidence = upgraded_run([*relisted(-30, OLD_SLICE), seen(31, "DELETED", OLD_SLICE), seen(95, "ADDED", NEW_SLICE)])

    verdict = check_device(evidence)

    assert verdict.outcome is Outcome.PASS, verdict.summary
    assert "gpu.nvidia.com ResourceSlices republished at the target on 1" in verdict.summary
    lines = [e.text for e in verdict.evidence if e.kind == "ResourceSlice"]
    assert lines == ["generation 1, 8 devices at driverVersion 580.82.7",
                     "no slice: the DRA kubelet plugin is not registered",
                     "generation 1, 8 devices at driverVersion 580.95.5"], lines
    cycle = slice_cycle(evidence, NODE)
    assert cycle and cycle.gone and cycle.final and cycle.gone.wall_ns == at(31) and cycle.final.wall_ns == at(95)


def test_a_slice_updated_in_place_at_the_same_generation_passes() -> None:
    """The plugin back within the kubelet's 30 s: its ResourceSlice controller updates the one slice in place and
    keeps the pool's generation; the devices at the target are what says it restarted on the new driver."""
    in_place = resource_slice(OLD_SLICE["metadata"]["name"], generation=1, version=NEW)
    evidence = upgraded_run([*relisted(-30, OLD_SLICE), seen(60, "MODIFIED", in_place)])

    verdict = check_device(evidence)

    assert verdict.outcome is Outcome.PASS, verdict.summary
    assert [e.text for e in verdict.evidence if e.kind == "ResourceSlice"] == [
        "generation 1, 8 devices at driverVersion 580.82.7", "generation 1, 8 devices at driverVersion 580.95.5"]


def test_slices_that_never_went_away_fail_naming_the_plugin_left_on_the_old_driver() -> None:
    verdict = check_device(upgraded_run([*relisted(-30, OLD_SLICE)]))

    assert verdict.outcome is Outcome.FAIL
    assert f"node {NODE}'s gpu.nvidia.com ResourceSlices never changed (generation 1, 8 devices at driverVersion " \
           "580.82.7): the DRA kubelet plugin was not restarted" in verdict.summary, verdict.summary


def test_slices_back_at_the_old_version_or_with_fewer_devices_fail() -> None:
    stale = resource_slice(f"00000-gpu.nvidia.com-{NODE}-x", generation=1, version=OLD)
    fewer = resource_slice(f"00000-gpu.nvidia.com-{NODE}-z", generation=1, version=NEW, devices=7)

    for back, expected in ((stale, "offer generation 1, 8 devices at driverVersion 580.82.7 at the end, expected 8 "
                                   "devices at 580.95.5"),
                           (fewer, "offer generation 1, 7 devices at driverVersion 580.95.5 at the end")):
        verdict = check_device(upgraded_run([*relisted(-30, OLD_SLICE), seen(31, "DELETED", OLD_SLICE),
                                             seen(95, "ADDED", back)]))
        assert verdict.outcome is Outcome.FAIL and expected in verdict.summary, verdict.summary


def test_slices_that_offered_the_target_before_and_never_changed_pass() -> None:
    """A change that keeps the driver's version (the restart-only path): the slices cannot tell an old plugin from a
    new one, and do not fail the rung; the plugin's pod is judged on its own."""
    evidence = upgraded_run([*relisted(-30, NEW_SLICE)])
    finding, _ = judge(evidence, NODE)
    assert finding is not None and finding.outcome is Outcome.PASS, finding
    assert "offered the target throughout (generation 1, 8 devices at driverVersion 580.95.5)" in finding.line
    assert check_device(evidence).outcome is Outcome.PASS


def test_slices_that_went_away_and_stayed_away_fail() -> None:
    verdict = check_device(upgraded_run([*relisted(-30, OLD_SLICE), seen(31, "DELETED", OLD_SLICE)]))

    assert verdict.outcome is Outcome.FAIL and "went away and did not come back" in verdict.summary


def test_a_relist_after_a_watch_gap_is_one_instant_not_a_gap() -> None:
    """A relist clears what the stream knew and lists it again at one instant: the slice standing through it is
    not a slice that went away."""
    records = [*relisted(-30, OLD_SLICE), *relisted(20, OLD_SLICE), seen(31, "DELETED", OLD_SLICE),
               *relisted(95, NEW_SLICE)]

    cycle = slice_cycle(upgraded_run(records), NODE)

    assert cycle is not None and cycle.gone is not None and cycle.gone.wall_ns == at(31)
    assert [o.slices for o in cycle.offers] == [1, 0, 1]


def test_a_node_without_dra_gpus_is_judged_as_before() -> None:
    other_driver = resource_slice("nic", generation=1, version=OLD, driver="rdma.example.com")

    with_nic, without = upgraded_run([seen(-30, "ADDED", other_driver)]), upgraded_run([])

    assert slice_cycle(with_nic, NODE) is None
    assert check_device(with_nic).summary == check_device(without).summary
    assert "ResourceSlice" not in json.dumps([e.text for e in check_device(without).evidence])


def dra_only(evidence_records: list[Record], *, plugin_restarted: bool = True) -> RunEvidence:
    """The same upgrade on a GPUCluster-mode node: no device plugin and no nvidia.com/gpu; NVIDIA's DRA kubelet
    plugin (app nvidia-dra-driver-kubelet-plugin) stops for the swap and comes back after the new driver."""
    records = []
    for record in evidence_records:
        obj = record.object
        if record.kind == "Node":
            allocatable = {k: v for k, v in obj["status"]["allocatable"].items() if k != "nvidia.com/gpu"}
            obj = {**obj, "status": {**obj["status"], "allocatable": allocatable}}
        labels = (obj.get("metadata") or {}).get("labels") or {}
        if record.kind == "Pod" and labels.get("app") == "nvidia-device-plugin-daemonset":
            if not plugin_restarted and record.name.endswith("-new"):
                continue
            obj = {**obj, "metadata": {**obj["metadata"], "labels": {"app": "nvidia-dra-driver-kubelet-plugin"}}}
        records.append(dataclasses.replace(record, object=obj))
    return run(records)


def gpucluster_run(**kwargs: bool) -> RunEvidence:
    schedule = list(zip([5, 10, 12, 14, 26, 90, 130, 135], HAPPY))
    return dra_only(states(schedule) + operands() + workloads() + [node(500, "upgrade-done")] +
                    [*relisted(-30, OLD_SLICE), seen(31, "DELETED", OLD_SLICE), seen(95, "ADDED", NEW_SLICE)], **kwargs)


def test_a_node_that_offers_gpus_only_through_dra_is_judged_by_its_kubelet_plugin_and_slices() -> None:
    verdict = check_device(gpucluster_run())

    assert verdict.outcome is Outcome.PASS, verdict.summary
    assert "then validator and DRA kubelet plugin Ready; gpu.nvidia.com ResourceSlices republished at the target on " \
           "1" in verdict.summary, verdict.summary
    assert "nvidia.com/gpu" not in verdict.summary
    assert any(e.kind == "Pod" and "plugin-canary-0-new" in e.ref for e in verdict.evidence), verdict.evidence


def test_a_dra_kubelet_plugin_left_from_before_the_new_driver_fails_the_rung() -> None:
    verdict = check_device(gpucluster_run(plugin_restarted=False))

    assert verdict.outcome is Outcome.FAIL, verdict.summary
    assert "DRA kubelet plugin" in verdict.summary, verdict.summary
