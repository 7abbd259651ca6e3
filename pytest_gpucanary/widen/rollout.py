"""The sweep: hold every node the change reaches, write the change, release and judge one wave at a time.

Containment is the canary run's (canary/apply.py): the holds and the change go through the same writes, each
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

from pytest_gpucanary.canary import apply as upgrade
from pytest_gpucanary.canary import lease, publish
from pytest_gpucanary.canary.cleanup import RunLeftovers, leftovers
from pytest_gpucanary.canary.metrics import MetricsError
from pytest_gpucanary.cluster import ClusterInfo, discover, operator_release
from pytest_gpucanary.errors import ConfigError, EnvError, GpucanaryError
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.receipt.verdict import VerdictKey
from pytest_gpucanary.widen import change, plan, scope, state
from pytest_gpucanary.widen.change import release_hold
from pytest_gpucanary.widen.options import WidenOptions
from pytest_gpucanary.widen.probes import StartProbes
from pytest_gpucanary.widen.record import read, save
from pytest_gpucanary.widen.slo import SloLook
from pytest_gpucanary.widen.state import FAILED, PASSED, PENDING, ROLLING, SOAKING, Sweep, Wave
from pytest_gpucanary.widen.watch import NodeSeen, PodWatch, wait_and_judge


class Refused(GpucanaryError):
    """The verdict does not let the rollout start: exit 1, nothing written."""


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
        applied = change.applied(cluster, sweep, left if opts.resume else None)
        try:
            change.apply(kube, cluster, opts, sweep, applied, report)
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
                change.roll_back(kube, cluster, sweep, applied, report)
        else:
            for kind, name in applied.saved:
                change.forget_saved_spec(kube, kind, name, sweep.run_id)
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
    target, prior, nodes = scope.target(kube, cluster, opts.nvidiadriver, report)
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
            scope.take_joined(kube, cluster, sweep, index, report)
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


def _held(sweep: Sweep) -> int:
    return sum(len(w.nodes) for w in sweep.waves if w.outcome == PENDING)
