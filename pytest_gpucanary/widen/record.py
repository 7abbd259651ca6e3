"""The sweep's record in the cluster: a ConfigMap in the canary's namespace named for the change it rolls out
(`state.configmap_name`), read when a sweep starts and written at each step, only over a record of the same
sweep.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pytest_gpucanary.canary import publish
from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.kube import Kube, patch_as_read
from pytest_gpucanary.kube.errors import Conflict, NotFound
from pytest_gpucanary.kube.ownership import OWNER, OWNER_LABEL
from pytest_gpucanary.receipt.verdict import VerdictKey
from pytest_gpucanary.widen import state
from pytest_gpucanary.widen.state import Sweep

CONFIGMAP = ("v1", "ConfigMap")


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
