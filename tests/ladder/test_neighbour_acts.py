"""Others acting on the pool during a run: cordons and taints by writers other than the upgrade and the canary
(as the apiserver names them, from the node's managedFields), and NodeMaintenances for a pool node; named in every
receipt, judged by nothing."""

from __future__ import annotations

import copy
import dataclasses
import json
import xml.etree.ElementTree as ET

from canned_runs import NODE, at, clean_run  # canned runs, shared
from test_receipt import judged

from pytest_gpucanary.ladder.neighbours import NeighbourAct, neighbour_acts
from pytest_gpucanary.ladder.timeline import Record
from pytest_gpucanary.receipt.json import render_json
from pytest_gpucanary.receipt.junit import render_stage_junit
from pytest_gpucanary.receipt.markdown import render_markdown
from pytest_gpucanary.canary.recorder import spec_writers, trim

QUARANTINE = {"key": "nvsentinel.dgxc.nvidia.com/quarantine", "value": "true", "effect": "NoSchedule"}
FENCE = {"key": "gpucanary.io/run", "value": "r-1", "effect": "NoSchedule"}
CORDON_TAINT = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}


def node(offset_s: float, *, taints: list[dict] = (), cordoned: bool = False, writers: dict | None = None,
         name: str = NODE) -> Record:
    meta = {"name": name, **({"specWriters": writers} if writers else {})}
    return Record("nodes", "MODIFIED", "Node", None, name, at(offset_s), at(offset_s),
                  {"metadata": meta, "spec": {"taints": list(taints), "unschedulable": cordoned}})


def maintenance(offset_s: float, kind_type: str, node_name: str, name: str = "net-upgrade") -> Record:
    return Record("node-maintenance", kind_type, "NodeMaintenance", "nvidia-network-operator", name, at(offset_s),
                  at(offset_s), {"metadata": {"name": name}, "spec": {"nodeName": node_name,
                                                                       "requestorID": "nvidia.network.operator"}})


def test_taints_and_cordons_of_others_are_named_with_their_writer_and_the_upgrades_own_are_not() -> None:
    records = [
        node(0, taints=[FENCE], writers={"taints": "gpucanary"}),                          # where it stood
        node(10, taints=[FENCE, QUARANTINE], writers={"taints": "nvsentinel"}),              # NVSentinel quarantines
        node(20, taints=[FENCE, QUARANTINE, CORDON_TAINT], cordoned=True,
             writers={"taints": "kube-controller-manager", "unschedulable": "gpu-operator"}),  # the upgrade's cordon
        node(30, taints=[FENCE, QUARANTINE], writers={"taints": "kube-controller-manager", "unschedulable": "gpu-operator"}),
        node(40, taints=[FENCE, QUARANTINE], cordoned=True, writers={"taints": "nvsentinel", "unschedulable": "kubectl-cordon"}),
        node(50, taints=[FENCE], cordoned=True, writers={"taints": "kubectl-taint", "unschedulable": "kubectl-cordon"}),
        node(60, taints=[], cordoned=False, writers={"taints": "gpucanary", "unschedulable": "gpucanary"}),  # restore
        node(70, cordoned=True, name="other-node", writers={"unschedulable": "kubectl-cordon"}),           # not the pool
    ]
    assert [(a.wall_ns, a.what, a.by) for a in neighbour_acts(records, [NODE])] == [
        (at(10), "tainted nvsentinel.dgxc.nvidia.com/quarantine=true:NoSchedule", "nvsentinel"),
        (at(40), "cordoned", "kubectl-cordon"),
        (at(50), "untainted nvsentinel.dgxc.nvidia.com/quarantine=true:NoSchedule", "kubectl-taint")]


def test_a_cordon_whose_writer_was_not_recorded_is_not_blamed_on_anyone() -> None:
    records = [node(0), node(10, cordoned=True), node(20, taints=[QUARANTINE])]
    assert [(a.what, a.by) for a in neighbour_acts(records, [NODE])] == [
        ("tainted nvsentinel.dgxc.nvidia.com/quarantine=true:NoSchedule", "unknown")]   # no upgrade taints a node


def test_a_node_maintenance_for_a_pool_node_begins_and_ends_one_for_another_node_is_not_the_pools() -> None:
    records = [maintenance(5, "LISTED", NODE, "before-the-run"), maintenance(10, "ADDED", NODE),
               maintenance(12, "ADDED", "other-node", "elsewhere"), maintenance(15, "MODIFIED", NODE),
               maintenance(90, "DELETED", NODE)]
    assert [a.line() for a in neighbour_acts(records, [NODE])] == [
        f"{NODE}: NodeMaintenance nvidia-network-operator/net-upgrade began by nvidia.network.operator",
        f"{NODE}: NodeMaintenance nvidia-network-operator/net-upgrade ended by nvidia.network.operator"]


def test_the_recorder_keeps_who_wrote_a_nodes_schedulability_and_taints_and_drops_the_rest() -> None:
    managed = [{"manager": "kubelet", "operation": "Update", "fieldsV1": {"f:status": {"f:conditions": {}}}},
               {"manager": "gpu-operator", "operation": "Update", "fieldsV1": {"f:spec": {"f:unschedulable": {}}}},
               {"manager": "nvsentinel", "operation": "Update", "fieldsV1": {"f:spec": {"f:taints": {}}}}]
    assert spec_writers(managed) == {"unschedulable": "gpu-operator", "taints": "nvsentinel"}
    trimmed = trim("Node", {"metadata": {"name": NODE, "managedFields": managed}, "spec": {}, "status": {}})
    assert trimmed["metadata"] == {"name": NODE, "specWriters": {"unschedulable": "gpu-operator", "taints": "nvsentinel"}}


def test_every_receipt_names_what_others_did_to_the_pool() -> None:
    base = clean_run()
    [*_, seen] = [r for r in base.records if r.kind == "Node" and r.received_wall_ns < at(40)]   # the node then
    quarantined = copy.deepcopy(seen.object)
    quarantined["spec"]["taints"] = [QUARANTINE]
    quarantined["metadata"]["specWriters"] = {"taints": "nvsentinel"}
    records = sorted((*base.records, dataclasses.replace(seen, received_mono_ns=at(40), received_wall_ns=at(40),
                                                         object=quarantined), maintenance(45, "ADDED", NODE)),
                     key=lambda r: r.received_wall_ns)
    result, evidence = judged(dataclasses.replace(base, records=tuple(records)))
    line = f"{NODE}: tainted nvsentinel.dgxc.nvidia.com/quarantine=true:NoSchedule by nvsentinel"
    acts = json.loads(render_json(result, evidence))["run"]["neighbours"]
    # the canned node records after +40 s carry no taint: the quarantine is lifted, by a writer not recorded
    assert [(a["by"], a["what"].split()[0]) for a in acts] == [
        ("nvsentinel", "tainted"), ("nvidia.network.operator", "NodeMaintenance"), ("unknown", "untainted")]
    assert acts[0]["offset_s"] == 40.0
    assert f"| others on the pool | +40.0 s {line} |" in render_markdown(result, evidence)
    out = ET.fromstring(render_stage_junit(result, evidence)).find("testsuite/system-out")
    assert out is not None and f"+40.0 s others on the pool: {line}" in out.text
    assert result.gate_passed          # named, not judged


def test_a_run_nobody_else_touched_names_no_one() -> None:
    result, evidence = judged(clean_run())
    assert json.loads(render_json(result, evidence))["run"]["neighbours"] == []
    assert "others on the pool" not in render_markdown(result, evidence)
    assert NeighbourAct(NODE, 0, "cordoned", "x").line() == f"{NODE}: cordoned by x"
