"""The sweep: hold every node the change reaches, write the change, release and judge one wave at a time.

Containment is the canary run's (policy/apply.py): the holds and the change go through the same writes, each
conditional on what was read, each undo saved on the object it undoes under the sweep's run id, and a Lease
says the sweep lives. A failed wave halts with every later node held; `--rollback` then restores the policy
object (the failed wave's nodes go back to the old driver under the operator's own policy) and releases
the holds once the driver DaemonSet is back at the old version, exactly as `gpucanary cleanup` would for a
sweep that died. A sweep that passes every wave keeps the change and drops its saved copies.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pytest_gpucanary.canary import apply as upgrade
from pytest_gpucanary.canary import lease, publish
from pytest_gpucanary.canary.cleanup import RunLeftovers, leftovers
from pytest_gpucanary.canary.metrics import MetricsError, Prometheus
from pytest_gpucanary.canary.pool import Pool
from pytest_gpucanary.canary.pool.restore import SAVED_STATE_ANNOTATION
from pytest_gpucanary.cluster import ClusterInfo, discover, operator_release
from pytest_gpucanary.config import Settings
from pytest_gpucanary.errors import ConfigError, EnvError, GpucanaryError
from pytest_gpucanary.gpu_operator import (
    CLUSTER_POLICY,
    DRIVER_COMPONENT_SELECTOR,
    DRIVER_OWNER_LABEL,
    NVIDIADRIVER,
    SKIP_LABEL,
    UPGRADE_FAILED,
    driver_node_selector,
)
from pytest_gpucanary.kube import Kube, patch_as_read
from pytest_gpucanary.kube.errors import Conflict, NotFound
from pytest_gpucanary.kube.ownership import OWNER, OWNER_LABEL, saved_run
from pytest_gpucanary.receipt.verdict import VerdictKey
from pytest_gpucanary.widen import plan, state
from pytest_gpucanary.widen.probes import StartProbes
from pytest_gpucanary.widen.slo import Slo, SloLook
from pytest_gpucanary.widen.state import FAILED, PASSED, PENDING, ROLLING, SOAKING, Sweep, Wave
from pytest_gpucanary.widen.watch import NodeSeen, PodWatch, nodes_seen, wait_and_judge

CONFIGMAP = ("v1", "ConfigMap")


class Refused(GpucanaryError):
    """The verdict does not let the rollout start: exit 1, nothing written."""


@dataclass(frozen=True)
class WidenOptions:
    upgrade_policy: dict
    target: str
    strategy: plan.Strategy
    soak_s: float = 300.0
    wave_budget_s: float = 1800.0
    max_age_s: float = 24 * 3600.0
    nvidiadriver: str | None = None
    resume: bool = False
    rollback: bool = False
    settings: Settings = Settings()
    slos: tuple[Slo, ...] = ()
    prometheus: Prometheus | None = None  # where the SLOs are read


def widen(
    kube: Kube,
    opts: WidenOptions,
    *,
    report: Callable[[str], None] = print,
    on_sweep: Callable[[Sweep], None] = lambda sweep: None,
) -> Sweep:
    """Run (or resume) the sweep to its end: every wave passed (status done), or one failed (halted, or
    rolled back). `on_sweep` sees the record each time it is written."""
    key = VerdictKey.of(opts.upgrade_policy, opts.target, operator_release(kube))
    found = publish.read(kube, key)
    if why := publish.refusal(found, key, max_age_s=opts.max_age_s):
        raise Refused(why)
    assert found is not None
    for slo in opts.slos:  # an SLO that cannot be read now would hold every wave: say so before any write
        assert opts.prometheus is not None, "SLOs are given with a Prometheus"
        try:
            opts.prometheus.query(slo.query)
        except MetricsError as err:
            raise EnvError(
                f"SLO `{slo}` cannot be read: {err}", hint="check the query and the Prometheus URL"
            ) from None
    cluster = discover(kube)
    before = read(kube, key)
    # what an earlier sweep of this change that did not finish still has in the cluster: read once
    left = (
        leftovers(kube, [], only=before.run_id).get(before.run_id)
        if before is not None and before.status not in (state.DONE, state.ROLLED_BACK)
        else None
    )
    if opts.resume:
        sweep, run_lease = _resume(kube, before, left, report)
    else:
        _refuse_earlier(before, left)
        sweep, run_lease = _start(kube, cluster, opts, key, found.run_id, report)
    pods = PodWatch(kube, opts.settings).start()
    probes = StartProbes(kube, opts.settings, sweep.run_id, pods)
    try:  # the probes first: a sweep that cannot measure customer starts never starts
        probes.start()
        save(kube, sweep, on_sweep, replaces=before.run_id if before and not opts.resume else None)
    except BaseException:
        probes.stop()
        pods.stop()
        if opts.resume:
            run_lease.stop()
        else:  # nothing of the sweep is in the cluster yet but its Lease (and the lock)
            lease.release_cluster_lock(kube, sweep.run_id)
            run_lease.release()
        raise
    try:
        applied = _applied(cluster, sweep, left if opts.resume else None)
        try:
            _apply(kube, cluster, opts, sweep, applied, report)
        except GpucanaryError:
            report("widen: the change could not be written whole; putting back what was")
            upgrade.restore(kube, applied, report=report)
            sweep.status, sweep.ended_wall_ns = state.ROLLED_BACK, time.time_ns()
            save(kube, sweep, on_sweep)
            lease.release_cluster_lock(kube, sweep.run_id)
            run_lease.release()
            raise
        failure = _waves(kube, cluster, opts, sweep, pods, probes, report, on_sweep)
        if failure:
            sweep.status = state.HALTED
            report(f"widen: halted: {failure}; {_held(sweep)} nodes stay on driver {sweep.prior_version}")
            if opts.rollback:
                _roll_back(kube, cluster, sweep, applied, report)
        else:
            for kind, name in applied.saved:
                _forget_saved_spec(kube, kind, name, sweep.run_id)
            sweep.status = state.DONE
            report(f"widen: every wave passed: {len(sweep.nodes())} nodes on driver {opts.target}")
        sweep.ended_wall_ns = time.time_ns()
        save(kube, sweep, on_sweep)
    except BaseException:
        run_lease.stop()  # killed: the holds stay; --resume or `gpucanary cleanup` takes it from here
        raise
    finally:
        probes.stop()
        pods.stop()
    if sweep.status == state.HALTED:
        run_lease.stop()
        report(f"widen: `gpucanary cleanup --run-id {sweep.run_id}` rolls the sweep back and releases the holds")
    else:
        lease.release_cluster_lock(kube, sweep.run_id)
        run_lease.release()
    return sweep


def read(kube: Kube, key: VerdictKey) -> Sweep | None:
    try:
        found = kube.get(*CONFIGMAP, state.configmap_name(key), namespace=publish.NAMESPACE)
    except NotFound:
        return None
    try:
        return Sweep.from_data(found.get("data") or {})
    except (ValueError, KeyError, TypeError):
        raise EnvError(
            f"ConfigMap {publish.NAMESPACE}/{state.configmap_name(key)} holds no sweep gpucanary can read",
            hint="look at it, and delete it if no sweep is under way",
        ) from None


def save(
    kube: Kube, sweep: Sweep, on_sweep: Callable[[Sweep], None] = lambda sweep: None, *, replaces: str | None = None
) -> None:
    """Write the record, only over a record of the same sweep (a sweep never takes over another's record), or of
    `replaces`, an earlier sweep of the change judged finished. `on_sweep` sees it once it is in the cluster."""
    name = state.configmap_name(sweep.key)
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name,
            "namespace": publish.NAMESPACE,
            "labels": {OWNER_LABEL: OWNER, "gpucanary.io/widen": sweep.status},
        },
        "data": sweep.data(),
    }
    try:
        kube.create(body)
        on_sweep(sweep)
        return
    except Conflict:
        pass

    def decide(current: dict) -> tuple[dict, bool]:
        if (current.get("data") or {}).get("run-id") not in (None, sweep.run_id, replaces):
            raise EnvError(
                f"ConfigMap {publish.NAMESPACE}/{name} now records sweep {current['data']['run-id']}, "
                f"not {sweep.run_id}",
                hint="two sweeps of one change cannot run at once",
            )
        return {"metadata": {"labels": body["metadata"]["labels"]}, "data": body["data"]}, True

    patch_as_read(
        kube, *CONFIGMAP, name, decide, what=f"ConfigMap {publish.NAMESPACE}/{name}", namespace=publish.NAMESPACE
    )
    on_sweep(sweep)


def _refuse_earlier(before: Sweep | None, left: RunLeftovers | None) -> None:
    """A sweep of the same change that did not finish, with its holds or its change still in the cluster."""
    if before is not None and left is not None:
        how = "--resume it" if before.status == state.RUNNING else "roll it back"
        raise EnvError(
            f"sweep {before.run_id} of this change is {before.status}, its holds and change still in the cluster",
            hint=f"{how}, or run `gpucanary cleanup --run-id {before.run_id}`",
        )


def _resume(
    kube: Kube, before: Sweep | None, left: RunLeftovers | None, report: Callable[[str], None]
) -> tuple[Sweep, lease.RunLease]:
    if before is None or before.status != state.RUNNING or any(w.outcome == FAILED for w in before.waves):
        raise ConfigError(
            "--resume: no sweep of this change is under way"
            + (f" (sweep {before.run_id} is {before.status})" if before else ""),
            hint="start one without --resume",
        )
    if left is None or not left.specs:
        raise ConfigError(
            f"--resume: sweep {before.run_id}'s change is no longer in the cluster (rolled back by "
            "`gpucanary cleanup`?)",
            hint="start a new sweep without --resume",
        )
    dead, live = lease.observe(kube, {before.run_id}, report=report)
    if before.run_id in live:
        raise EnvError(
            f"sweep {before.run_id} is alive: its Lease is renewed by {live[before.run_id].holder}",
            hint="let it run; resume only a sweep whose process is gone",
        )
    run_lease = lease.RunLease(kube, before.run_id, say=report).take_over(dead[before.run_id])
    report(
        f"widen: resuming sweep {before.run_id} at wave {(before.current() or 0) + 1}/{len(before.waves)}; pods "
        "removed while no widen ran are not seen"
    )
    return before, run_lease


def _start(
    kube: Kube,
    cluster: ClusterInfo,
    opts: WidenOptions,
    key: VerdictKey,
    verdict_run: str,
    report: Callable[[str], None],
) -> tuple[Sweep, lease.RunLease]:
    target, prior, nodes = _target(kube, cluster, opts.nvidiadriver, report)
    if prior == opts.target:
        raise ConfigError(
            f"{target[1]} {target[2]} is at driver {opts.target} already: nothing to widen",
            hint="widen a change the canary proved and the fleet does not run yet",
        )
    if not nodes:
        raise EnvError(
            f"{target[1]} {target[2]} reaches no node that gpucanary may roll out to",
            hint="look at the nodes' skip labels and canary pools",
        )
    waves = [Wave(nodes=w) for w in plan.waves(nodes, opts.strategy)]
    run_id = f"widen-{secrets.token_hex(4)}"
    sweep = Sweep(
        run_id, key, target, prior, str(opts.strategy), opts.soak_s, waves, verdict_run, started_wall_ns=time.time_ns()
    )
    report(
        f"widen: sweep {run_id}: {target[1]} {target[2]} from driver {prior} to {opts.target}, "
        f"{len(nodes)} nodes in {len(waves)} waves ({opts.strategy}, soak {opts.soak_s:g} s), "
        f"on the verdict of canary run {verdict_run}"
    )
    run_lease = lease.RunLease(kube, run_id, say=report).acquire()  # the first write: every later one has an owner
    try:
        if cluster.writes_cluster_policy:
            lease.take_cluster_lock(kube, run_id)
    except BaseException:
        run_lease.release()
        raise
    return sweep, run_lease


# A sweep moves an NVIDIADriver only when an administrator set this label to "true" on it; deploy/admission.yaml
# lets the sweep's own ServiceAccount (deploy/rbac-widen.yaml), and no other of the canary's, change such a one.
WIDEN_ELIGIBLE_LABEL = "gpucanary.io/widen-eligible"


def _target(
    kube: Kube, cluster: ClusterInfo, name: str | None, report: Callable[[str], None]
) -> tuple[tuple[str, str, str], str, list[str]]:
    """What carries the version (the NVIDIADriver, or the ClusterPolicy), the version it is at, and its nodes
    less those held by someone else or carved out as a canary pool."""
    if cluster.nvidiadriver_mode:
        drivers = {
            d["metadata"]["name"]: d
            for d in kube.list(*NVIDIADRIVER)
            if (d["metadata"].get("labels") or {}).get(OWNER_LABEL) != OWNER
        }
        if name is None and len(drivers) != 1:
            raise ConfigError(
                f"the cluster has {len(drivers)} NVIDIADrivers: name the one to widen",
                hint=f"--nvidiadriver NAME, one of: {', '.join(sorted(drivers)) or '(none)'}",
            )
        name = name or next(iter(drivers))
        if name not in drivers:
            raise ConfigError(
                f"no NVIDIADriver {name} (other than canary pools') in the cluster",
                hint=f"one of: {', '.join(sorted(drivers)) or '(none)'}",
            )
        driver = drivers[name]
        if (driver["metadata"].get("labels") or {}).get(WIDEN_ELIGIBLE_LABEL) != "true":
            raise ConfigError(
                f"NVIDIADriver {name} is not marked for gpucanary widen (no {WIDEN_ELIGIBLE_LABEL}=true)",
                hint=f"an administrator marks the NVIDIADrivers a sweep may roll out: kubectl label "
                f"nvidiadriver {name} {WIDEN_ELIGIBLE_LABEL}=true",
            )
        nodes = list(kube.each("v1", "Node", label_selector=f"{DRIVER_OWNER_LABEL}={name}")) or list(
            kube.each("v1", "Node", label_selector=driver_node_selector(driver))
        )
        target, prior = (*NVIDIADRIVER, name), str(driver["spec"].get("version") or "")
    else:
        policy = kube.get(*CLUSTER_POLICY, cluster.cluster_policy)
        nodes = [{"metadata": n["metadata"]} for n in upgrade.driver_nodes(kube).values()]
        target = (*CLUSTER_POLICY, cluster.cluster_policy)
        prior = str(((policy.get("spec") or {}).get("driver") or {}).get("version") or "")
    ours = []
    for node in nodes:
        meta = node["metadata"]
        if (meta.get("labels") or {}).get(SKIP_LABEL) == "true":
            report(f"widen: node {meta['name']} is held by someone else (its skip label): left out of the sweep")
        elif SAVED_STATE_ANNOTATION in (meta.get("annotations") or {}):
            report(f"widen: node {meta['name']} is a canary run's pool: left out of the sweep")
        else:
            ours.append(meta["name"])
    return target, prior, ours


def _applied(cluster: ClusterInfo, sweep: Sweep, left: RunLeftovers | None) -> upgrade.AppliedUpgrade:
    """What the sweep changed, as the canary's restore reads it: rebuilt from the sweep's record and what its
    run id marks in the cluster (`left`, on a resume), so a resumed sweep undoes what the killed one wrote."""
    applied = upgrade.AppliedUpgrade(
        run_id=sweep.run_id, operator_namespace=cluster.operator_namespace, prior_version=sweep.prior_version
    )
    if cluster.nvidiadriver_mode:
        applied.nvidiadriver = sweep.target[2]
    else:
        applied.cluster_policy = cluster.cluster_policy
    if left is not None:
        applied.saved = list(left.specs)
        applied.skipped_nodes = [node["metadata"]["name"] for node in left.holds]
    return applied


def _apply(
    kube: Kube,
    cluster: ClusterInfo,
    opts: WidenOptions,
    sweep: Sweep,
    applied: upgrade.AppliedUpgrade,
    report: Callable[[str], None],
) -> None:
    """Every node held first, then the change: no node can start on the new driver before its wave. Again on a
    resume, writing only what the killed sweep had not (a second saved copy would save the change itself):
    before v26.7 an NVIDIADriver's change is two writes, the ClusterPolicy's policy and then its version."""
    for name in sweep.nodes():
        if not any(w.outcome != PENDING and name in w.nodes for w in sweep.waves):
            upgrade.hold_back(kube, kube.get("v1", "Node", name), applied, sweep.run_id)
    _, kind, name = sweep.target
    if kind == NVIDIADRIVER[1] and (NVIDIADRIVER, name) not in applied.saved:
        pool = Pool(nodes=tuple(sweep.nodes()), driver=name, driver_from=sweep.prior_version)
        write = upgrade.apply_nvidiadriver if applied.saved else upgrade.apply
        write(kube, cluster, pool, opts.upgrade_policy, driver_to=opts.target, run_id=sweep.run_id, applied=applied)
    elif kind != NVIDIADRIVER[1] and not applied.saved:
        upgrade.apply_cluster_policy(
            kube, cluster, {"upgradePolicy": opts.upgrade_policy, "version": opts.target}, applied, sweep.run_id
        )
    else:
        return
    report(
        f"widen: {len(applied.skipped_nodes)} nodes held on driver {sweep.prior_version}; wrote {applied.describe()}"
    )


def _waves(
    kube: Kube,
    cluster: ClusterInfo,
    opts: WidenOptions,
    sweep: Sweep,
    pods: PodWatch,
    probes: StartProbes,
    report: Callable[[str], None],
    on_sweep: Callable[[Sweep], None],
) -> str:
    """Each wave in turn from the first not passed; the failure that halts the sweep, or ""."""
    slos = SloLook(opts.prometheus, opts.slos)
    while (index := sweep.current()) is not None:
        wave = sweep.waves[index]
        if wave.outcome == PENDING:
            _take_joined(kube, cluster, sweep, index, report)
        where = f"wave {index + 1}/{len(sweep.waves)}"
        pods.watch_nodes(wave.nodes)
        if wave.outcome == PENDING:
            wave.outcome, wave.started_wall_ns = ROLLING, time.time_ns()
            save(kube, sweep, on_sweep)  # before the holds go: a resume never releases a wave twice
            for node in wave.nodes:
                release_hold(kube, node, sweep.run_id)
            report(f"widen: {where}: released {', '.join(wave.nodes)}")
        elif wave.outcome == ROLLING and (late := [n for n in wave.nodes if release_hold(kube, n, sweep.run_id)]):
            report(f"widen: {where}: released {', '.join(late)}, which the killed sweep had not")
        progress = _Progress(where, report, target=opts.target, budget_s=opts.wave_budget_s, soak_s=sweep.soak_s)
        held = [node for later in sweep.waves[index + 1 :] for node in later.nodes]

        def customers(final: bool = False, wave: Wave = wave) -> str:
            failure, wave.probes = probes.look(wave.started_wall_ns, final=final)
            return failure

        def record(seen: dict[str, NodeSeen], found: list, wave: Wave = wave, progress: _Progress = progress) -> None:
            now = time.time_ns()
            for node, node_seen in seen.items():
                states = wave.states.setdefault(node, [])
                if not states or states[-1][1] != node_seen.state:
                    states.append((now, node_seen.state))
            wave.disruptions.extend(found)
            progress.show(wave, seen, found)

        if wave.outcome == ROLLING:
            left_s = opts.wave_budget_s - (time.time_ns() - wave.started_wall_ns) / 1e9
            failure = wait_and_judge(
                kube,
                pods,
                slos,
                wave.nodes,
                cluster.operator_namespace,
                target=opts.target,
                seconds=max(0.0, left_s),
                soaking=False,
                record=record,
                customers=customers,
                held=held,
            )
            if failure == "timeout":
                failure = f"{where}: not every node upgraded within {opts.wave_budget_s:g} s: " + ", ".join(
                    f"{n} {s[-1][1] if s else '?'}" for n, s in sorted(wave.states.items())
                )
            if failure:
                return _fail(kube, sweep, wave, where, failure, on_sweep)
            wave.outcome, wave.done_wall_ns = SOAKING, time.time_ns()
            save(kube, sweep, on_sweep)
            report(f"widen: {where}: every node on driver {opts.target}; soaking {sweep.soak_s:g} s")
        left_s = sweep.soak_s - (time.time_ns() - wave.done_wall_ns) / 1e9
        failure = wait_and_judge(
            kube,
            pods,
            slos,
            wave.nodes,
            cluster.operator_namespace,
            target=opts.target,
            seconds=max(0.0, left_s),
            soaking=True,
            record=record,
            customers=customers,
            held=held,
        ) or customers(final=True)
        if failure:
            return _fail(kube, sweep, wave, where, failure, on_sweep)
        wave.outcome, wave.ended_wall_ns = PASSED, time.time_ns()
        pods.watch_nodes([])
        save(kube, sweep, on_sweep)
        gpu_pods = sum(1 for d in wave.disruptions if d.gpus)
        others = len(wave.disruptions) - gpu_pods  # allowed by a selector rule, else the wave failed
        report(
            f"widen: {where} passed: {len(wave.nodes)} node{'' if len(wave.nodes) == 1 else 's'}, "
            f"{gpu_pods} GPU pod{'' if gpu_pods == 1 else 's'} and {others} other pod{'' if others == 1 else 's'} "
            f"removed; {wave.probes}"
        )
    return ""


def _fail(kube: Kube, sweep: Sweep, wave: Wave, where: str, failure: str, on_sweep: Callable[[Sweep], None]) -> str:
    wave.outcome, wave.ended_wall_ns, wave.signal = FAILED, time.time_ns(), failure
    sweep.status = state.HALTED  # in the same write: a failed wave is never resumed
    save(kube, sweep, on_sweep)
    return f"{where}: {failure}" if not failure.startswith(where) else failure


class _Progress:
    """One line when what the wave waits on changes, and one every 30 s while it does not."""

    def __init__(
        self, where: str, report: Callable[[str], None], *, target: str, budget_s: float, soak_s: float
    ) -> None:
        self.where, self.report, self.said, self.at = where, report, "", 0.0
        self.target, self.budget_s, self.soak_s = target, budget_s, soak_s

    def show(self, wave: Wave, seen: dict[str, NodeSeen], found: list) -> None:
        for d in found:
            self.report(f"widen: {self.where}: {d.line()}" + ("" if d.allowed else " (not an allowed eviction)"))
        text = ", ".join(
            f"{node} " + (now.trouble(self.target) or f"serving on {now.driver}") for node, now in sorted(seen.items())
        )
        if text != self.said or time.monotonic() - self.at >= 30:
            started = wave.done_wall_ns or wave.started_wall_ns
            phase, limit = ("soak", self.soak_s) if wave.done_wall_ns else ("rolling", self.budget_s)
            self.report(f"widen: {self.where} {phase} {(time.time_ns() - started) / 1e9:.0f}/{limit:g} s: {text}")
            self.said, self.at = text, time.monotonic()


def _take_joined(kube: Kube, cluster: ClusterInfo, sweep: Sweep, index: int, report: Callable[[str], None]) -> None:
    """A node the change reaches that joined since the sweep started gets its first driver pod from the driver
    DaemonSet's current template, which is the target version: the skip label holds an upgrade, not a first
    install. It is judged with the wave about to start."""
    _, _, nodes = _target(kube, cluster, sweep.target[2] if cluster.nvidiadriver_mode else None, lambda line: None)
    if joined := sorted(set(nodes) - set(sweep.nodes())):
        sweep.waves[index].nodes.extend(joined)
        report(
            f"widen: {', '.join(joined)} joined, on the target driver from its first install: judged in wave "
            f"{index + 1}"
        )


def release_hold(kube: Kube, node: str, run_id: str) -> bool:
    """Let the operator upgrade a held node: the skip label and the run's note of it go; its upgrade state stays
    (upgrade-required, which the operator takes from there). False when the run holds nothing there."""

    def decide(obj: dict) -> tuple[dict | None, bool]:
        if saved_run(obj, upgrade.SKIP_SET_ANNOTATION) != run_id:
            return None, False
        labels = {SKIP_LABEL: None} if (obj["metadata"].get("labels") or {}).get(SKIP_LABEL) == "true" else {}
        return {"metadata": {"labels": labels, "annotations": {upgrade.SKIP_SET_ANNOTATION: None}}}, True

    return bool(patch_as_read(kube, "v1", "Node", node, decide, what=f"node {node}'s hold"))


def _forget_saved_spec(kube: Kube, kind: tuple[str, str], name: str, run_id: str) -> None:
    """The change is the fleet's state now: the run's saved copy of what it replaced goes."""

    def decide(obj: dict) -> tuple[dict | None, bool]:
        if saved_run(obj, upgrade.SAVED_SPEC_ANNOTATION) != run_id:
            return None, False
        return {"metadata": {"annotations": {upgrade.SAVED_SPEC_ANNOTATION: None}}}, True

    patch_as_read(kube, *kind, name, decide, what=f"{kind[1]} {name}")


def _roll_back(
    kube: Kube,
    cluster: ClusterInfo,
    sweep: Sweep,
    applied: upgrade.AppliedUpgrade,
    report: Callable[[str], None],
) -> None:
    failed = next(w for w in sweep.waves if w.outcome == FAILED)
    upgraded = [n for w in sweep.waves if w.outcome in (PASSED, FAILED, ROLLING, SOAKING) for n in w.nodes]
    upgrade.restore(kube, applied, report=report)
    sweep.status = state.ROLLED_BACK
    sweep.rollback = (
        f"{sweep.target[1]} {sweep.target[2]} restored to driver {sweep.prior_version} and its earlier "
        f"upgradePolicy; the operator takes {', '.join(upgraded)} (the failed wave: "
        f"{', '.join(failed.nodes)}) back to {sweep.prior_version} under that policy; every held node "
        f"released once the driver DaemonSet was back at {sweep.prior_version}"
    )
    # k8s-operator-libs (ProcessUpgradeFailedNodes) moves an upgrade-failed node on only once its driver pod
    # matches the DaemonSet again: one whose pod the failed upgrade had already replaced waits for a person
    stuck = [
        node
        for node, now in nodes_seen(kube, failed.nodes, cluster.operator_namespace).items()
        if now.state == UPGRADE_FAILED and now.driver == sweep.key.target
    ]
    for node in stuck:
        sweep.rollback += (
            f"; {node} stays {UPGRADE_FAILED} and cordoned, its driver pod at {sweep.key.target}: "
            f"`kubectl delete pod -n {cluster.operator_namespace} -l {DRIVER_COMPONENT_SELECTOR} "
            f"--field-selector spec.nodeName={node}` lets the DaemonSet make one at {sweep.prior_version}"
        )
    report(f"widen: rolled back: {sweep.rollback}")


def _held(sweep: Sweep) -> int:
    return sum(len(w.nodes) for w in sweep.waves if w.outcome == PENDING)
