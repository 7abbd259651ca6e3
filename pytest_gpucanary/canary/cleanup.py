"""Finish the restore of runs that could not, found by label and annotation, also after a crash or kill.

Cleanup is the run's own restore (`run.py`), in the same order and with the same waits, per run:
its workload namespaces go; the policy objects it saved come back, each field only while it still
holds what the run wrote; its held-back nodes are released once the driver DaemonSet is back at their
version (and the ClusterPolicy at it); its carved nodes are given back once they run their original
driver; what it created goes; its Lease goes last. Every write acts only on an annotation or label
naming that run, at the resourceVersion just read. A wait that runs out leaves the holds in place
(holding is the safe state) and is reported; one bad object is reported and skipped.

A run is touched only when it is dead the leader-election way (its Lease did not move for a whole
duration, watched here, see `lease.observe`), and only after this cleanup took its Lease over by
compare-and-swap: a second cleanup, or the run itself, loses the swap and is left alone.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from pytest_gpucanary.canary import apply as upgrade
from pytest_gpucanary.canary import lease
from pytest_gpucanary.canary.pool.restore import SAVED_STATE_ANNOTATION, carved_driver, give_back
from pytest_gpucanary.checks import run_id_rule
from pytest_gpucanary.errors import EnvError, GpucanaryError
from pytest_gpucanary.gpu_operator import CLUSTER_POLICY, NVIDIADRIVER
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.errors import Conflict, NotFound
from pytest_gpucanary.kube.ownership import OWNER_LABEL, RUN_ID_LABEL, saved_run

NAMESPACE_GONE_TIMEOUT_S = 180
CLEANUP_HOLDER = "cleanup/"  # the holder identity a cleanup writes into a Lease it took over, before host/pid

T = TypeVar("T")


@dataclass
class RunLeftovers:
    """What one run left on the cluster, by kind of undo."""

    specs: list[tuple[tuple[str, str], str]] = field(default_factory=list)
    holds: list[dict] = field(default_factory=list)
    carved: list[dict] = field(default_factory=list)
    owned: list[tuple[tuple[str, str], dict]] = field(default_factory=list)


@dataclass
class CleanupResult:
    restored: int = 0
    problems: list[str] = field(default_factory=list)  # each one line: what is still held or left, and why


def leftovers(kube: Kube, problems: list[str], *, only: str | None = None) -> dict[str, RunLeftovers]:
    """Every run's leftovers (only `only`'s, when given). An annotation naming no run is one line in `problems`."""
    runs: dict[str, RunLeftovers] = {}

    def of(obj: dict, annotation: str) -> RunLeftovers | None:
        run = saved_run(obj, annotation)
        if run is None or (only is not None and run != only):
            return None
        if run_id_rule(run) is not None:
            problems.append(
                f"{obj.get('kind', 'object')} {obj['metadata']['name']}: {annotation} names no canary "
                "run; left as it is"
            )
            return None
        return runs.setdefault(run, RunLeftovers())

    for kind in (NVIDIADRIVER, CLUSTER_POLICY):  # NVIDIADriver first: the order the run restores in
        for obj in _list(kube, *kind):
            if found := of(obj, upgrade.SAVED_SPEC_ANNOTATION):
                found.specs.append((kind, obj["metadata"]["name"]))
    for node in kube.each("v1", "Node"):
        node = {"kind": "Node", "metadata": node["metadata"]}
        if found := of(node, upgrade.SKIP_SET_ANNOTATION):
            found.holds.append(node)
        if found := of(node, SAVED_STATE_ANNOTATION):
            found.carved.append(node)
    selector = f"{OWNER_LABEL}=gpucanary" + (f",{RUN_ID_LABEL}={only}" if only else "")
    for kind in (NVIDIADRIVER, ("v1", "Node"), ("v1", "Namespace")):
        for obj in _list(kube, *kind, label_selector=selector):
            run = (obj["metadata"].get("labels") or {}).get(RUN_ID_LABEL, "")
            if obj["metadata"].get("deletionTimestamp"):
                continue  # on its way out (a namespace terminating): nothing left to do for it
            if run_id_rule(run) is None:
                runs.setdefault(run, RunLeftovers()).owned.append((kind, obj))
    return runs


def cleanup(
    kube: Kube,
    *,
    run_id: str | None = None,
    force: bool = False,
    wait_s: float = 1200.0,
    report: Callable[[str], None] = print,
    sleep: Callable[[float], None] = time.sleep,
) -> CleanupResult:
    """Without a run id: every dead run, leaving alone (and naming) the live ones. With one: that run only; a
    live one is refused (EnvError) unless `force`. `wait_s` bounds each wait for a node's original driver."""
    result = CleanupResult()
    found = leftovers(kube, result.problems, only=run_id)
    if run_id is not None:
        found.setdefault(run_id, RunLeftovers())
    dead: dict[str, lease.LeaseSeen | None]
    live: dict[str, lease.LeaseSeen]
    if force and run_id is not None:
        dead, live = {run_id: lease.read(kube, run_id)}, {}
    else:
        dead, live = lease.observe(kube, set(found), sleep=sleep, report=report)
    for run, seen in live.items():
        if seen.holder.startswith(CLEANUP_HOLDER):
            report(f"left run {run} alone: another cleanup ({seen.holder}) took it over")
        elif run == run_id:
            raise EnvError(
                f"run {run} is alive: its Lease (held by {seen.holder}) was renewed while cleanup watched",
                hint="let it finish and restore itself, or pass --force if its process is surely gone",
            )
        else:
            report(f"left live run {run} alone (held by {seen.holder})")
    holder = f"{CLEANUP_HOLDER}{lease.identity()}"
    for run in sorted(dead):
        if not _nothing_left(found[run]) or dead[run] is not None:
            if not lease.take_over(kube, run, dead[run], holder):
                report(f"left run {run} alone: another cleanup or the run itself took its Lease first")
                continue
            _clean_run(kube, run, found[run], result, wait_s=wait_s, report=report)
    for line in result.problems:
        report(line)
    return result


def _nothing_left(left: RunLeftovers) -> bool:
    return not (left.specs or left.holds or left.carved or left.owned)


def _clean_run(
    kube: Kube, run: str, left: RunLeftovers, result: CleanupResult, *, wait_s: float, report: Callable[[str], None]
) -> None:
    problems_before = len(result.problems)

    def attempt(what: str, step: Callable[[], T]) -> T | bool:
        """The step's answer, or False (and a problem line) when it failed: one object never stops the rest."""
        try:
            return step()
        except (GpucanaryError, TimeoutError) as err:
            result.problems.append(f"run {run}: {what}: {err}")
            return False

    owner, lock = lease.namespace_of(run), lease.CLUSTER_LOCK_NAMESPACE
    workload_namespaces = [
        obj["metadata"]["name"]
        for (_, kind), obj in left.owned
        if kind == "Namespace" and obj["metadata"]["name"] not in (owner, lock)
    ]
    for name in workload_namespaces:  # the canary's pods go before the original policy is back (see run.py)
        result.restored += bool(attempt(f"namespace {name}", functools.partial(_delete_and_wait, kube, name, report)))
    for spec_kind, name in left.specs:
        if line := attempt(
            f"{spec_kind[1]} {name}", functools.partial(upgrade.restore_saved_spec, kube, spec_kind, name, run)
        ):
            report(str(line))
            result.restored += 1
    if left.holds:
        result.restored += int(
            attempt(f"{len(left.holds)} held nodes stay held", lambda: _release_holds(kube, run, left.holds, report))
        )
    for node in left.carved:
        name = node["metadata"]["name"]
        if attempt(
            f"node {name} stays the run's",
            functools.partial(give_back, kube, name, run, carved_driver(node), timeout_s=wait_s, report=report),
        ):
            report(f"gave node {name} back")
            result.restored += 1
    for (api_version, kind), obj in left.owned:
        meta = obj["metadata"]
        if kind == "Node" and SAVED_STATE_ANNOTATION in (meta.get("annotations") or {}):
            continue  # a carved-out node is given back, never deleted
        if kind == "Namespace" and meta["name"] in (owner, lock, *workload_namespaces):
            continue  # gone already, or (the Lease, the lock) goes last
        delete = functools.partial(_delete, kube, api_version, kind, meta["name"], uid=meta.get("uid"))
        if attempt(f"delete {kind} {meta['name']}", delete):
            report(f"deleted {kind} {meta['name']}")
            result.restored += 1
    if len(result.problems) > problems_before:
        result.problems.append(
            f"run {run}: left held; run `gpucanary cleanup --run-id {run}` again once the above is resolved"
        )
        return
    lease.release_cluster_lock(kube, run)
    lease.release(kube, run)
    still = leftovers(kube, [], only=run)
    if _nothing_left(still.get(run, RunLeftovers())):
        report(f"run {run}: nothing of it is left on the cluster")
    else:
        result.problems.append(f"run {run}: objects of it appeared again while it was cleaned up; run cleanup again")


def _release_holds(kube: Kube, run: str, holds: list[dict], report: Callable[[str], None]) -> int:
    saved = upgrade.saved_json(holds[0], upgrade.SKIP_SET_ANNOTATION)
    policies = _list(kube, *CLUSTER_POLICY)
    version = saved.get("version") or ""
    if not version:
        raise EnvError("the holds name no driver version to wait for", hint="release them by hand")
    # holds written before they named their owner are ClusterPolicy mode's
    cluster_policy = (
        saved["cluster_policy"]
        if "cluster_policy" in saved
        else (policies[0]["metadata"]["name"] if policies else None)
    )
    return upgrade.release_holds(
        kube,
        run,
        [n["metadata"]["name"] for n in holds],
        version,
        saved.get("namespace") or None,
        cluster_policy=cluster_policy,
        nvidiadriver=saved.get("nvidiadriver"),
        report=report,
    )


def _delete(kube: Kube, api_version: str, kind: str, name: str, *, uid: str | None = None) -> bool:
    """Delete the object (the one listed, by `uid`); False when it is gone or was replaced since."""
    try:
        kube.delete(api_version, kind, name, uid=uid)
        return True
    except (NotFound, Conflict):
        return False


def _delete_and_wait(kube: Kube, name: str, report: Callable[[str], None]) -> bool:
    if not _delete(kube, "v1", "Namespace", name):
        return False
    report(f"deleted Namespace {name}")
    try:
        kube.wait_gone("v1", "Namespace", name, timeout_s=NAMESPACE_GONE_TIMEOUT_S)
    except TimeoutError:
        report(f"namespace {name} is not gone after {NAMESPACE_GONE_TIMEOUT_S} s; restoring the policy anyway")
    return True


def _list(kube: Kube, api_version: str, kind: str, *, label_selector: str | None = None) -> list[dict]:
    try:
        return kube.list(api_version, kind, label_selector=label_selector)
    except NotFound:  # the cluster serves no such kind (no NVIDIADriver CRD)
        return []
