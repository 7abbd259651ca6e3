"""The rollout's stall classifier on recorded pod and node sequences: causes that will not clear by
themselves become terminal, and those that recover (a slow pull, one restart then Ready) never do."""

from __future__ import annotations

from pytest_gpucanary.config import Settings
from pytest_gpucanary.ladder import stall
from pytest_gpucanary.ladder.rollout import check_rollout
from pytest_gpucanary.ladder.model import Outcome
from pytest_gpucanary.ladder.timeline import Record

NODE = "gpu-kubelet-0"
S = 10**9
IMAGE = "nvcr.io/nvidia/driver:999.1-ubuntu22.04"


def driver_pod(at_s: float, *, init: list[dict] | None = None, containers: list[dict] | None = None,
               scheduled: dict | None = None, uid: str = "u1", type_: str = "MODIFIED") -> Record:
    status: dict = {"phase": "Pending", "initContainerStatuses": init or [], "containerStatuses": containers or []}
    if scheduled:
        status["conditions"] = [{"type": "PodScheduled", **scheduled}]
    obj = {"metadata": {"name": "nvidia-driver-daemonset-abc", "namespace": "gpu-operator", "uid": uid,
                        "labels": {"app": "nvidia-driver-daemonset"},
                        "ownerReferences": [{"kind": "DaemonSet", "name": "nvidia-driver-daemonset"}]},
           "spec": {"nodeName": NODE}, "status": status}
    return Record("pods", type_, "Pod", "gpu-operator", "nvidia-driver-daemonset-abc", int(at_s * S), int(at_s * S), obj)


def waiting(reason: str, message: str = "", *, name: str = "nvidia-driver-ctr", restarts: int = 0,
            last: dict | None = None) -> dict:
    return {"name": name, "image": IMAGE, "restartCount": restarts, "state": {"waiting": {"reason": reason,
                                                                                         "message": message}},
            "lastState": {"terminated": last} if last else {}}


def running(name: str = "nvidia-driver-ctr", restarts: int = 0) -> dict:
    return {"name": name, "image": IMAGE, "restartCount": restarts, "state": {"running": {}}}


def node(at_s: float, ready: str, reason: str = "KubeletNotReady") -> Record:
    obj = {"metadata": {"name": NODE}, "status": {"conditions": [{"type": "Ready", "status": ready, "reason": reason,
                                                                  "message": "container runtime is down"}]}}
    return Record(f"node-{NODE}", "MODIFIED", "Node", None, NODE, int(at_s * S), int(at_s * S), obj)


PULL = 'Back-off pulling image "' + IMAGE + '": not found'


def pulls(*steps: tuple[float, str]) -> list[Record]:
    return [driver_pod(t, containers=[waiting(reason, PULL if reason == "ImagePullBackOff" else "not found")])
            for t, reason in steps]


def test_a_pull_that_fails_across_back_offs_is_terminal_naming_the_image() -> None:
    records = pulls((40, "ErrImagePull"), (41, "ImagePullBackOff"), (52, "ErrImagePull"), (53, "ImagePullBackOff"),
                    (73, "ErrImagePull"))
    assert stall.terminal(records[:4], [NODE], since_wall_ns=0) is None           # two attempts: may still come
    cause = stall.terminal(records, [NODE], since_wall_ns=0)
    assert cause is not None and cause.terminal_wall_ns == 73 * S and cause.since_wall_ns == 40 * S
    line = cause.line(40)
    assert line.startswith("driver pod gpu-operator/nvidia-driver-daemonset-abc, container nvidia-driver-ctr on "
                           f"{NODE}: ErrImagePull since +40 s: image {IMAGE}: not found (3 pull attempts)"), line


def test_a_status_that_only_shows_the_back_off_is_terminal_after_a_minute() -> None:
    records = pulls(*[(40 + 10 * i, "ImagePullBackOff") for i in range(8)])
    cause = stall.terminal(records, [NODE], since_wall_ns=0)
    assert cause is not None and cause.terminal_wall_ns == 100 * S


def test_a_slow_pull_that_succeeds_is_never_terminal() -> None:
    records = [*pulls((40, "ErrImagePull"), (41, "ImagePullBackOff")),
               driver_pod(60, containers=[waiting("ContainerCreating")]), driver_pod(90, containers=[running()])]
    assert stall.causes(records, NODE, since_wall_ns=0) == []
    assert stall.terminal(records, [NODE], since_wall_ns=0) is None


def test_an_image_name_that_can_never_pull_is_terminal_at_once() -> None:
    records = [driver_pod(5, containers=[waiting("InvalidImageName", "couldn't parse image name")])]
    assert stall.terminal(records, [NODE], since_wall_ns=0).reason == "InvalidImageName"


def test_an_init_container_in_a_crash_loop_is_terminal_after_three_restarts_with_its_exit() -> None:
    unload = {"exitCode": 1, "reason": "Error", "message": "Could not unload NVIDIA driver kernel modules, driver is "
                                                           "in use"}
    records = [driver_pod(10 + 20 * n, init=[waiting("CrashLoopBackOff", name="k8s-driver-manager", restarts=n,
                                                     last=unload)])
               for n in (1, 2, 3)]
    assert stall.terminal(records[:2], [NODE], since_wall_ns=0) is None
    cause = stall.terminal(records, [NODE], since_wall_ns=0)
    assert cause is not None and cause.what.endswith("init container k8s-driver-manager")
    assert cause.message == ("exit code 1 (Error) after 3 restarts: Could not unload NVIDIA driver kernel modules, "
                             "driver is in use")


def test_one_restart_then_ready_is_not_a_cause() -> None:
    records = [driver_pod(10, containers=[waiting("CrashLoopBackOff", restarts=1, last={"exitCode": 2})]),
               driver_pod(30, containers=[running(restarts=1)])]
    assert stall.causes(records, NODE, since_wall_ns=0) == []


def test_a_pod_that_goes_away_takes_its_cause_with_it() -> None:
    records = [*pulls((40, "ErrImagePull"), (41, "ImagePullBackOff"), (52, "ErrImagePull"), (73, "ErrImagePull")),
               driver_pod(80, containers=[waiting("ImagePullBackOff")], type_="DELETED")]
    assert stall.terminal(records, [NODE], since_wall_ns=0) is None


def test_a_node_not_ready_and_an_unschedulable_pod_are_terminal_after_three_minutes() -> None:
    records = [node(10, "False"), node(100, "False")]
    assert stall.causes(records, NODE, since_wall_ns=0)[0].terminal_wall_ns is None
    records.append(node(190, "Unknown", "NodeStatusUnknown"))
    assert stall.terminal(records, [NODE], since_wall_ns=0).reason == "NotReady"
    assert stall.causes([*records, node(200, "True")], NODE, since_wall_ns=0) == []
    pending = [driver_pod(t, scheduled={"status": "False", "reason": "Unschedulable",
                                        "message": "0/5 nodes are available: 1 Insufficient memory"})
               for t in (10, 200)]
    cause = stall.terminal(pending, [NODE], since_wall_ns=0)
    assert cause.reason == "Unschedulable" and "Insufficient memory" in cause.message


def test_causes_before_the_upgrade_are_not_counted() -> None:
    records = pulls((1, "ErrImagePull"), (2, "ErrImagePull"), (3, "ErrImagePull"))
    assert stall.terminal(records, [NODE], since_wall_ns=10 * S) is None


def test_the_rollout_rung_names_the_terminal_cause_instead_of_the_budget() -> None:
    import dataclasses

    from test_ladder import T0, run, states

    pulled = pulls((40, "ErrImagePull"), (41, "ImagePullBackOff"), (52, "ErrImagePull"), (53, "ImagePullBackOff"),
                   (73, "ErrImagePull"))
    shifted = [dataclasses.replace(r, received_wall_ns=T0 + r.received_wall_ns) for r in pulled]
    records = states([(2, "upgrade-required"), (4, "cordon-required"), (6, "pod-restart-required")], name=NODE)
    verdict = check_rollout(run(records + shifted, pool_nodes=(NODE,)), Settings())
    assert verdict.outcome is Outcome.FAIL
    assert f"node {NODE} in pod-restart-required: driver pod gpu-operator/nvidia-driver-daemonset-abc, container " \
           f"nvidia-driver-ctr on {NODE}: ErrImagePull since +40 s: image {IMAGE}" in verdict.summary, verdict.summary
    assert "it will not clear by itself (called at +73s, not waiting out the budget 1200 s)" in verdict.summary


def test_a_crash_loops_log_tail_is_quoted_by_the_rung_and_kept_as_evidence() -> None:
    import dataclasses

    from test_ladder import T0, run, states

    unload = {"exitCode": 1, "reason": "Error"}
    looping = [driver_pod(10 + 20 * n, init=[waiting("CrashLoopBackOff", name="k8s-driver-manager", restarts=n,
                                                     last=unload)]) for n in (1, 2, 3)]
    cause = stall.terminal(looping, [NODE], since_wall_ns=0)
    assert (cause.namespace, cause.pod, cause.container) == ("gpu-operator", "nvidia-driver-daemonset-abc",
                                                             "k8s-driver-manager")
    log = stall.log_record(cause, "unloading nvidia\n+ rmmod nvidia\nrmmod: ERROR: Module nvidia is in use\n\n",
                           mono_ns=80 * S, wall_ns=80 * S)
    assert stall.last_meaningful(log.object["lines"]) == "rmmod: ERROR: Module nvidia is in use"
    shifted = [dataclasses.replace(r, received_wall_ns=T0 + r.received_wall_ns) for r in [*looping, log]]
    records = states([(2, "upgrade-required"), (4, "cordon-required"), (6, "pod-restart-required")], name=NODE)
    verdict = check_rollout(run(records + shifted, pool_nodes=(NODE,)), Settings())
    assert "CrashLoopBackOff since +30 s: exit code 1 (Error) after 3 restarts; its log ends: rmmod: ERROR: Module " \
           "nvidia is in use; it will not clear by itself" in verdict.summary, verdict.summary
    assert [e.text for e in verdict.evidence if e.kind == "ContainerLog"][-1] == "rmmod: ERROR: Module nvidia is in use"
