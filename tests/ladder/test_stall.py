"""The rollout's stall classifier on recorded pod and node sequences: causes that will not clear by
themselves become terminal, and those that recover (a slow pull, one restart then Ready) never do."""

from __future__ import annotations

from pytest_gpucanary.config import Settings
from pytest_gpucanary.ladder import diagnosis, stall
from pytest_gpucanary.ladder.cause import EVICTION_REFUSED, NOT_STARTED, OPERAND_BLOCKED, SANDBOX_NOT_READY, UNBOUND_POD, Cause
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


def running(name: str = "nvidia-driver-ctr", restarts: int = 0, ready: bool = True) -> dict:
    return {"name": name, "image": IMAGE, "restartCount": restarts, "state": {"running": {}}, "ready": ready}


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
    pending = [unbound(t) for t in (10, 200)]
    cause = stall.terminal(pending, [NODE], since_wall_ns=0)
    assert cause.reason == "Unschedulable" and "Insufficient memory" in cause.message
    assert cause.line(10).startswith(f"driver pod gpu-operator/nvidia-driver-daemonset-abc on {NODE}: Unschedulable "
                                     "since +10 s: 0/5 nodes are available: 1 Insufficient memory"), cause.line(10)


def unbound(at_s: float, *, node_: str = NODE, type_: str = "MODIFIED", daemonset: bool = True) -> Record:
    """The driver pod as the watch of unbound operator pods records it: no nodeName, pinned by its affinity."""
    record = driver_pod(at_s, scheduled={"status": "False", "reason": "Unschedulable",
                                         "message": "0/5 nodes are available: 1 Insufficient memory"}, type_=type_)
    record.object["spec"] = {"nodeName": None, "daemonSetNode": node_}
    if not daemonset:
        record.object["metadata"]["ownerReferences"] = []
    return Record("unbound-operator-pods", type_, UNBOUND_POD, record.namespace, record.name,
                  record.received_mono_ns, record.received_wall_ns, record.object)


def test_an_unbound_pod_ends_its_cause_once_bound_or_gone_and_only_its_own_nodes_count() -> None:
    assert stall.causes([unbound(10)], NODE, since_wall_ns=0)[0].terminal_wall_ns is None
    bound = driver_pod(100, containers=[waiting("ContainerCreating")])        # the pools' watch sees it bound
    assert stall.causes([unbound(10), bound], NODE, since_wall_ns=0, now_wall_ns=500 * S) == []
    left = unbound(100, type_="DELETED")             # left the unbound watch: bound, or deleted while pending
    assert stall.causes([unbound(10), left], NODE, since_wall_ns=0, now_wall_ns=500 * S) == []
    assert stall.causes([unbound(10, node_="gpu-node-9")], NODE, since_wall_ns=0, now_wall_ns=500 * S) == []
    assert stall.causes([unbound(10, daemonset=False)], NODE, since_wall_ns=0, now_wall_ns=500 * S) == []


def test_the_time_a_stuck_state_may_last_is_the_stall_knob_in_the_run_and_the_rung_alike() -> None:
    from canned_runs import T0, run, states

    records = [node(10, "False"), node(50, "False")]
    assert stall.terminal(records, [NODE], since_wall_ns=0) is None
    assert stall.terminal(records, [NODE], since_wall_ns=0, stuck_s=30).terminal_wall_ns == 40 * S
    assert stall.terminal(records, [NODE], since_wall_ns=0, now_wall_ns=45 * S, stuck_s=30) is not None
    shifted = [node(T0 / S + t, "False") for t in (10, 50)]
    ladder_run = run(states([(2, "upgrade-required"), (4, "cordon-required")], name=NODE) + shifted, pool_nodes=(NODE,))
    assert check_rollout(ladder_run, Settings(stall_s=30)).outcome is Outcome.FAIL
    assert "NotReady" in check_rollout(ladder_run, Settings(stall_s=30)).summary
    assert "NotReady" not in check_rollout(ladder_run, Settings()).summary


def test_causes_before_the_upgrade_are_not_counted() -> None:
    records = pulls((1, "ErrImagePull"), (2, "ErrImagePull"), (3, "ErrImagePull"))
    assert stall.terminal(records, [NODE], since_wall_ns=10 * S) is None


def test_the_rollout_rung_names_the_terminal_cause_instead_of_the_budget() -> None:
    import dataclasses

    from canned_runs import T0, run, states

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

    from canned_runs import T0, run, states

    unload = {"exitCode": 1, "reason": "Error"}
    looping = [driver_pod(10 + 20 * n, init=[waiting("CrashLoopBackOff", name="k8s-driver-manager", restarts=n,
                                                     last=unload)]) for n in (1, 2, 3)]
    cause = stall.terminal(looping, [NODE], since_wall_ns=0)
    assert (cause.namespace, cause.pod, cause.container) == ("gpu-operator", "nvidia-driver-daemonset-abc",
                                                             "k8s-driver-manager")
    log = diagnosis.log_record(cause, "unloading nvidia\n+ rmmod nvidia\nrmmod: ERROR: Module nvidia is in use\n\n",
                               mono_ns=80 * S, wall_ns=80 * S)
    assert diagnosis.last_meaningful(log.object["lines"]) == "rmmod: ERROR: Module nvidia is in use"
    shifted = [dataclasses.replace(r, received_wall_ns=T0 + r.received_wall_ns) for r in [*looping, log]]
    records = states([(2, "upgrade-required"), (4, "cordon-required"), (6, "pod-restart-required")], name=NODE)
    verdict = check_rollout(run(records + shifted, pool_nodes=(NODE,)), Settings())
    assert "CrashLoopBackOff since +30 s: exit code 1 (Error) after 3 restarts; its log ends: rmmod: ERROR: Module " \
           "nvidia is in use; it will not clear by itself" in verdict.summary, verdict.summary
    assert [e.text for e in verdict.evidence if e.kind == "ContainerLog"][-1] == "rmmod: ERROR: Module nvidia is in use"


def test_a_log_tail_is_kept_as_plain_lines_without_credentials() -> None:
    looping = [driver_pod(10 + 20 * n, init=[waiting("CrashLoopBackOff", name="k8s-driver-manager", restarts=n,
                                                     last={"exitCode": 1, "reason": "Error"})]) for n in (1, 2, 3)]
    cause = stall.terminal(looping, [NODE], since_wall_ns=0)
    text = ("pulling https://robot:s3cret@registry.example/driver\nAuthorization: Bearer eyJh.abc\n"
            "\x1b[31mlogin password=hunter2\x1b[0m\r\n::error::forged\rannotation\n")
    lines = diagnosis.log_record(cause, text, mono_ns=S, wall_ns=S).object["lines"]
    assert lines == ["pulling https://***@registry.example/driver", "Authorization: Bearer ***",
                     "login password=***", "::error::forged", "annotation"]


def state(at_s: float, upgrade_state: str) -> Record:
    obj = {"metadata": {"name": NODE, "labels": {"nvidia.com/gpu-driver-upgrade-state": upgrade_state}},
           "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    return Record(f"node-{NODE}", "MODIFIED", "Node", None, NODE, int(at_s * S), int(at_s * S), obj)


def tenant_pod(at_s: float, *, gpus: int = 0, type_: str = "MODIFIED", name: str = "trainer-0") -> Record:
    obj = {"metadata": {"name": name, "namespace": "team-a", "uid": f"uid-{name}", "labels": {"app": "trainer"},
                        "ownerReferences": [{"kind": "StatefulSet", "name": "trainer"}]},
           "spec": {"nodeName": NODE, "gpus": gpus}, "status": {"phase": "Running"}}
    return Record("pods", type_, "Pod", "team-a", name, int(at_s * S), int(at_s * S), obj)


def budget(at_s: float, allowed: int, *, selector: dict | None = None) -> Record:
    obj = {"metadata": {"name": "trainer", "namespace": "team-a"},
           "spec": {"selector": selector or {"matchLabels": {"app": "trainer"}}},
           "status": {"disruptionsAllowed": allowed, "currentHealthy": 1, "desiredHealthy": 1}}
    return Record("budgets", "MODIFIED", "PodDisruptionBudget", "team-a", "trainer", int(at_s * S), int(at_s * S), obj)


def test_a_budget_that_refuses_the_drain_is_named_and_terminal_at_the_drains_timeout() -> None:
    records = [budget(0, 0), tenant_pod(1), state(10, "cordon-required"), state(20, "drain-required"), budget(100, 0)]
    [cause] = stall.causes(records, NODE, since_wall_ns=5 * S, policy={"drain": {"timeoutSeconds": 120}})
    assert cause.what == "pod team-a/trainer-0" and cause.reason == EVICTION_REFUSED
    assert cause.message == ("drain cannot evict it: PodDisruptionBudget team-a/trainer allows 0 disruptions "
                             "(1 healthy, 1 required)")
    assert cause.since_wall_ns == 20 * S and cause.terminal_wall_ns is None
    records.append(budget(140, 0))
    assert stall.terminal(records, [NODE], since_wall_ns=5 * S,
                          policy={"drain": {"timeoutSeconds": 120}}).terminal_wall_ns == 140 * S
    # a drain that waits forever: called after STUCK_S
    assert stall.terminal(records, [NODE], since_wall_ns=5 * S, policy={"drain": {"timeoutSeconds": 0}}) is None
    assert stall.terminal([*records, budget(200, 0)], [NODE], since_wall_ns=5 * S).terminal_wall_ns == 200 * S


def test_a_budget_that_comes_to_allow_the_eviction_clears_the_cause() -> None:
    records = [budget(0, 0), tenant_pod(1), state(20, "drain-required"), budget(60, 1)]
    assert stall.causes(records, NODE, since_wall_ns=0) == []
    evicted = [budget(0, 0), tenant_pod(1), state(20, "drain-required"), tenant_pod(60, type_="DELETED")]
    assert stall.causes(evicted, NODE, since_wall_ns=0) == []


def test_pod_deletion_refusals_count_only_gpu_pods_and_selectors_must_match() -> None:
    cpu = [budget(0, 0), tenant_pod(1), state(20, "pod-deletion-required")]
    assert stall.causes(cpu, NODE, since_wall_ns=0) == []
    gpu = [budget(0, 0), tenant_pod(1, gpus=1), state(20, "pod-deletion-required")]
    assert stall.causes(gpu, NODE, since_wall_ns=0)[0].message.startswith("podDeletion cannot evict it")
    other = [budget(0, 0, selector={"matchExpressions": [{"key": "app", "operator": "In", "values": ["web"]}]}),
             tenant_pod(1), state(20, "drain-required")]
    assert stall.causes(other, NODE, since_wall_ns=0) == []


def test_the_rung_names_the_budget_when_the_operator_gives_up_the_drain() -> None:
    import dataclasses

    from canned_runs import T0, run, states

    lead = [dataclasses.replace(r, received_wall_ns=T0 + r.received_wall_ns)
            for r in (budget(0, 0), tenant_pod(1), state(8, "drain-required"))]
    records = states([(2, "upgrade-required"), (4, "cordon-required"), (8, "drain-required"), (130, "upgrade-failed")],
                     name=NODE)
    evidence = run(lead + records, pool_nodes=(NODE,))
    evidence = dataclasses.replace(evidence, upgrade_policy={"drain": {"enable": True, "timeoutSeconds": 120}})
    verdict = check_rollout(evidence, Settings())
    assert verdict.outcome is Outcome.FAIL
    assert "drain gave up after 122 s: pod team-a/trainer-0: drain cannot evict it: PodDisruptionBudget " \
           "team-a/trainer allows 0 disruptions" in verdict.summary, verdict.summary


def operand_pod(at_s: float, *, holding: bool = True, app: str = "nvidia-device-plugin-daemonset",
                init: str = "driver-validation") -> Record:
    inits = [{"name": init, "state": {"running": {}} if holding else {"terminated": {"exitCode": 0}}}]
    obj = {"metadata": {"name": f"{app}-x", "namespace": "gpu-operator", "uid": app,
                        "labels": {"app": app}, "ownerReferences": [{"kind": "DaemonSet", "name": app}]},
           "spec": {"nodeName": NODE}, "status": {"phase": "Pending" if holding else "Running",
                                                  "initContainerStatuses": inits}}
    return Record("pods", "MODIFIED", "Pod", "gpu-operator", obj["metadata"]["name"], int(at_s * S), int(at_s * S), obj)


def ready_driver(at_s: float) -> Record:
    record = driver_pod(at_s, containers=[running()])
    record.object["status"].update(phase="Running", conditions=[{"type": "Ready", "status": "True"}])
    return record


def test_an_operand_blocked_behind_the_driver_waits_for_the_driver_then_is_terminal() -> None:
    records = [operand_pod(10), driver_pod(10, containers=[waiting("ContainerCreating")]), operand_pod(300)]
    [cause] = [c for c in stall.causes(records, NODE, since_wall_ns=0) if c.reason == OPERAND_BLOCKED]
    assert cause.terminal_wall_ns is None            # the driver is not there yet: the driver is the one to watch
    assert cause.message == "Init:0/1, in init container driver-validation (the driver is not ready)"
    records += [ready_driver(320), operand_pod(400)]
    assert stall.terminal(records, [NODE], since_wall_ns=0) is None
    stuck = stall.terminal([*records, operand_pod(500)], [NODE], since_wall_ns=0)
    assert stuck.reason == OPERAND_BLOCKED and stuck.terminal_wall_ns == 500 * S
    assert stall.causes([*records, operand_pod(450, holding=False)], NODE, since_wall_ns=0) == []


def test_an_operand_blocked_behind_a_ready_driver_is_quoted_by_what_its_check_said_before_the_retry() -> None:
    stuck = stall.terminal([operand_pod(10), ready_driver(20), operand_pod(200)], [NODE], since_wall_ns=0)
    assert stuck.container == "driver-validation" and "(the driver pod is Ready)" in stuck.message, stuck
    log = diagnosis.log_record(stuck, "Attempting to validate a driver container installation\n"
                                      "Failed to initialize NVML: Driver/library version mismatch\n"
                                      "failed to validate the driver, retrying after 5 seconds\n"
                                      "Attempting to validate a driver container installation\n",
                               mono_ns=201 * S, wall_ns=201 * S)
    assert diagnosis.last_meaningful(log.object["lines"]) == "Failed to initialize NVML: Driver/library version mismatch"
    assert diagnosis.last_meaningful(["waiting", "retrying after 5 seconds"]) == "waiting"
    assert diagnosis.last_meaningful(["command failed, retrying after 5 seconds"]) == \
        "command failed, retrying after 5 seconds"           # nothing said before it: the retry is all there is


def test_an_operand_that_waits_on_after_its_driver_turned_ready_is_terminal_without_another_record_of_it() -> None:
    """The operand's last record says the driver was not ready; the driver's Ready starts its time all the same."""
    records = [operand_pod(70), ready_driver(90)]
    [cause] = [c for c in stall.causes(records, NODE, since_wall_ns=0, now_wall_ns=150 * S)
               if c.reason == OPERAND_BLOCKED]
    assert cause.message.endswith("(the driver pod is Ready)") and cause.terminal_wall_ns is None, cause
    stuck = stall.terminal(records, [NODE], since_wall_ns=0, now_wall_ns=271 * S)
    assert stuck.reason == OPERAND_BLOCKED and stuck.terminal_wall_ns == 270 * S, stuck


def test_of_operands_blocked_at_once_the_one_the_others_wait_on_is_named() -> None:
    plugin = lambda at: operand_pod(at, init="toolkit-validation")          # noqa: E731
    validator = lambda at: operand_pod(at, app="nvidia-operator-validator")  # noqa: E731
    stuck = stall.terminal([plugin(10), validator(11), ready_driver(20), plugin(200), validator(200)], [NODE],
                           since_wall_ns=0)
    assert (stuck.pod, stuck.container, stuck.terminal_wall_ns) == ("nvidia-operator-validator-x", "driver-validation",
                                                                    200 * S), stuck


def test_a_crash_loop_keeps_its_first_moment_across_the_runs_between_crashes() -> None:
    looping = [driver_pod(10, containers=[waiting("CrashLoopBackOff", restarts=1, last={"exitCode": 1})]),
               driver_pod(20, containers=[running(restarts=1, ready=False)]),
               driver_pod(22, containers=[waiting("CrashLoopBackOff", restarts=2, last={"exitCode": 1})])]
    [cause] = stall.causes(looping, NODE, since_wall_ns=0)
    assert cause.since_wall_ns == 10 * S
    # the third restart is seen running, not backing off: terminal all the same, and still a cause then
    again = [*looping, driver_pod(40, containers=[running(restarts=3, ready=False)])]
    [cause] = stall.causes(again, NODE, since_wall_ns=0)
    assert cause.terminal_wall_ns == 40 * S and cause.reason == "CrashLoopBackOff"
    assert stall.causes([*again, driver_pod(60, containers=[running(restarts=3)])], NODE, since_wall_ns=0) == []


def test_the_receipt_picture_brackets_the_stall_from_first_seen_to_the_call() -> None:
    import dataclasses

    from canned_runs import T0, run, states

    from pytest_gpucanary.ladder import evaluate
    from pytest_gpucanary.receipt.html import timeline_svg
    from pytest_gpucanary.receipt.json import parse_json, render_json

    pulled = pulls((40, "ErrImagePull"), (41, "ImagePullBackOff"), (52, "ErrImagePull"), (53, "ImagePullBackOff"),
                   (73, "ErrImagePull"))
    shifted = [dataclasses.replace(r, received_wall_ns=T0 + r.received_wall_ns) for r in pulled]
    evidence = run(states([(2, "upgrade-required"), (6, "pod-restart-required")], name=NODE) + shifted,
                   pool_nodes=(NODE,))
    result = evaluate(evidence, Settings())
    svg = timeline_svg(result, evidence)
    assert "ErrImagePull from +40s, will not clear: +73s" in svg
    assert [c.reason for c in result.stalls] == ["ErrImagePull"]
    assert parse_json(render_json(result, evidence)) == result      # the receipt keeps it for the gate's pictures
    slow = run(states([(2, "upgrade-required"), (6, "pod-restart-required")], name=NODE) + shifted[:2],
               pool_nodes=(NODE,))
    assert "will not clear" not in timeline_svg(evaluate(slow, Settings()), slow)    # not called: no bracket


def holder(at_s: float, why: str = "NVIDIA_VISIBLE_DEVICES=all", phase: str = "Running") -> Record:
    obj = {"metadata": {"name": "monitor-x", "namespace": "obs", "uid": "h1", "labels": {"app": "monitor"},
                        "ownerReferences": [{"kind": "DaemonSet", "name": "monitor"}]},
           "spec": {"nodeName": NODE, "gpus": 0, "holdsDriver": why}, "status": {"phase": phase}}
    return Record("pods", "MODIFIED", "Pod", "obs", "monitor-x", int(at_s * S), int(at_s * S), obj)


def test_a_driver_managers_crash_loop_names_the_pods_that_hold_the_driver() -> None:
    refused = {"exitCode": 1, "reason": "Error"}
    looping = [driver_pod(10 + 20 * n, init=[waiting("CrashLoopBackOff", name="k8s-driver-manager", restarts=n,
                                                     last=refused)]) for n in (1, 2, 3)]
    cause = stall.terminal([holder(1), *looping], [NODE], since_wall_ns=5 * S)
    assert cause.message == ("exit code 1 (Error) after 3 restarts; pods on the node hold the driver without a GPU "
                             "request: obs/monitor-x (NVIDIA_VISIBLE_DEVICES=all)"), cause.message
    gone = stall.terminal([holder(1), holder(2, phase="Succeeded"), *looping], [NODE], since_wall_ns=5 * S)
    assert "hold the driver" not in gone.message


def test_the_pods_that_hold_the_driver_now_are_listed_for_the_runs_warning() -> None:
    assert stall.holders([holder(1)], NODE) == ["obs/monitor-x (NVIDIA_VISIBLE_DEVICES=all)"]
    assert stall.holders([holder(1)], "other-node") == []
    assert stall.holders([holder(1), holder(2, phase="Succeeded")], NODE) == []


def test_which_pods_hold_the_driver_without_a_gpu_request() -> None:
    from pytest_gpucanary.gpu_operator import holds_driver

    def spec(env: dict | None = None, gpus: int = 0, **extra: object) -> dict:
        container = {"name": "c", "env": [{"name": k, "value": v} for k, v in (env or {}).items()],
                     "resources": {"limits": {"nvidia.com/gpu": gpus}} if gpus else {}}
        return {"containers": [container], **extra}

    assert holds_driver(spec({"NVIDIA_VISIBLE_DEVICES": "all"})) == "NVIDIA_VISIBLE_DEVICES=all"
    assert holds_driver(spec(runtimeClassName="nvidia")) == "runtimeClassName nvidia"
    assert holds_driver(spec({"NVIDIA_VISIBLE_DEVICES": "void"})) == ""
    assert holds_driver(spec({"NVIDIA_VISIBLE_DEVICES": "all"}, gpus=1)) == ""     # pod deletion sees that one
    assert holds_driver(spec()) == ""


def test_a_cause_that_holds_its_time_is_terminal_then_without_waiting_for_another_record() -> None:
    records = pulls((40, "ImagePullBackOff"))
    assert stall.terminal(records, [NODE], since_wall_ns=0, now_wall_ns=99 * S) is None
    cause = stall.terminal(records, [NODE], since_wall_ns=0, now_wall_ns=130 * S)
    assert cause.terminal_wall_ns == 100 * S                  # when it had held PULL_STUCK_S, not when asked
    cleared = [*records, driver_pod(90, containers=[running()])]
    assert stall.terminal(cleared, [NODE], since_wall_ns=0, now_wall_ns=130 * S) is None


def test_the_rung_calls_a_stall_that_had_held_its_time_when_the_run_froze_the_evidence() -> None:
    import dataclasses

    from canned_runs import T0, run, states

    backing_off = [dataclasses.replace(r, received_wall_ns=T0 + r.received_wall_ns)
                   for r in pulls((40, "ErrImagePull"), (41, "ImagePullBackOff"))]   # then nothing new: back-off
    evidence = run(states([(2, "upgrade-required"), (6, "pod-restart-required")], name=NODE) + backing_off,
                   pool_nodes=(NODE,))
    frozen = dataclasses.replace(evidence, finished_wall_ns=T0 + 105 * S)
    verdict = check_rollout(frozen, Settings())
    assert verdict.outcome is Outcome.FAIL and "called at +100s" in verdict.summary, verdict.summary
    early = dataclasses.replace(evidence, finished_wall_ns=T0 + 90 * S)
    assert check_rollout(early, Settings()).outcome is Outcome.INCONCLUSIVE


def hanging(at_s: float, started: bool = False) -> Record:
    return driver_pod(at_s, containers=[{**running(ready=started), "started": started}])


def said(at_s: float, text: str) -> Record:
    cause = Cause(NODE, "driver pod", NOT_STARTED, "", 0, None, "gpu-operator",
                  "nvidia-driver-daemonset-abc", "nvidia-driver-ctr")
    return diagnosis.log_record(cause, text, mono_ns=int(at_s * S), wall_ns=int(at_s * S))


def test_a_driver_container_that_hangs_before_its_startup_probe_passes_is_terminal_when_quiet() -> None:
    records = [hanging(40), said(41, "Installing NVIDIA driver kernel modules...")]
    assert stall.terminal(records, [NODE], since_wall_ns=0, now_wall_ns=220 * S) is None    # quiet 179 s
    cause = stall.terminal(records, [NODE], since_wall_ns=0, now_wall_ns=230 * S)
    assert cause.reason == NOT_STARTED and cause.terminal_wall_ns == 221 * S
    assert cause.line(40) == (f"driver pod gpu-operator/nvidia-driver-daemonset-abc, container nvidia-driver-ctr on "
                              f"{NODE}: NotStarted since +40 s: running, its startup probe has not passed")
    assert stall.terminal([hanging(40)], [NODE], since_wall_ns=0, now_wall_ns=220 * S).terminal_wall_ns == 220 * S


def test_a_start_that_still_prints_keeps_its_time_and_one_that_passes_its_probe_clears() -> None:
    build = [hanging(40), *[said(41 + 60 * n, f"Building kernel module, step {n}") for n in range(6)]]
    assert stall.terminal(build, [NODE], since_wall_ns=0, now_wall_ns=440 * S) is None      # last change at +341 s
    assert stall.terminal(build, [NODE], since_wall_ns=0, now_wall_ns=530 * S).terminal_wall_ns == 521 * S
    assert stall.causes([*build, hanging(400, started=True)], NODE, since_wall_ns=0, now_wall_ns=900 * S) == []


def test_the_rung_quotes_what_a_container_that_never_started_said_last() -> None:
    import dataclasses

    from canned_runs import T0, run, states

    hung = [dataclasses.replace(r, received_wall_ns=T0 + r.received_wall_ns)
            for r in (hanging(40), said(41, "Installing NVIDIA driver kernel modules...\nWaiting for the module"))]
    evidence = run(states([(2, "upgrade-required"), (6, "pod-restart-required")], name=NODE) + hung,
                   pool_nodes=(NODE,))
    verdict = check_rollout(dataclasses.replace(evidence, finished_wall_ns=T0 + 230 * S), Settings())
    assert verdict.outcome is Outcome.FAIL, verdict.summary
    assert "NotStarted since +40 s: running, its startup probe has not passed; its log ends: Waiting for the " \
           "module; it will not clear by itself (called at +221s" in verdict.summary, verdict.summary


def no_sandbox(at_s: float, ready: str = "False") -> Record:
    record = driver_pod(at_s, containers=[waiting("ContainerCreating")])
    record.object["status"]["conditions"] = [{"type": "PodScheduled", "status": "True"},
                                             {"type": "PodReadyToStartContainers", "status": ready}]
    if ready == "True":
        record.object["status"].update(phase="Running", containerStatuses=[running()])
    return record


def test_a_pod_whose_sandbox_never_comes_is_terminal_after_the_stall_time_in_the_kubelets_words() -> None:
    cause = stall.causes([no_sandbox(10)], NODE, since_wall_ns=0)[0]
    assert cause.reason == SANDBOX_NOT_READY and cause.terminal_wall_ns is None
    assert "a volume not mounted, or a runtime or network that refuses it" in cause.message
    event = {"type": "Warning", "reason": "FailedMount",
             "message": 'MountVolume.SetUp failed for volume "config" : configmap "kernel-module-params" not found'}
    said = diagnosis.warning_record(cause, event, mono_ns=50 * S, wall_ns=50 * S)
    records = [no_sandbox(10), said, no_sandbox(200)]
    stuck = stall.terminal(records, [NODE], since_wall_ns=0)
    assert stuck is not None and stuck.terminal_wall_ns == 190 * S, stuck
    assert stuck.message == 'FailedMount: MountVolume.SetUp failed for volume "config" : configmap ' \
                            '"kernel-module-params" not found'
    assert diagnosis.last_warning(records, cause) == stuck.message


def test_a_sandbox_that_comes_late_is_never_terminal() -> None:
    records = [no_sandbox(10), no_sandbox(60), no_sandbox(90, ready="True")]
    assert stall.causes(records, NODE, since_wall_ns=0, now_wall_ns=600 * S) == []
