"""Set-up waits of the fleet that scale to 1,000 nodes: one list-then-watch, constant work per event.

`fleet up` must see every node Ready and the operator's pods Ready on every GPU node. Polling
`kubectl get -o json` of thousands of pods every 2 s costs seconds of CPU per poll at that size;
one watch that keeps, per object, which wanted keys it satisfies costs a dictionary update per
event. Used only while the fleet starts, never by the canary.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterable

from pytest_gpucanary.kube import Kube

Progress = Callable[[str], None]
PROGRESS_EVERY_S = 15.0


def wait_all(
    kube: Kube,
    api_version: str,
    kind: str,
    *,
    wanted: set[Hashable],
    satisfies: Callable[[dict], Iterable[Hashable]],
    timeout_s: float,
    progress: Progress,
    what: str,
    namespace: str | None = None,
    label_selector: str | None = None,
) -> None:
    """Watch until the objects together satisfy every key in `wanted`; TimeoutError names what is missing.

    `satisfies(obj)` returns the keys one object satisfies now (empty while it is not ready).
    """
    stop = threading.Event()
    timer = threading.Timer(timeout_s, stop.set)
    timer.start()
    by_name: dict[str, frozenset[Hashable]] = {}
    count: dict[Hashable, int] = {}
    missing = set(wanted)
    last_report = time.monotonic()

    def put(name: str, keys: frozenset[Hashable]) -> None:
        for key in by_name.pop(name, frozenset()):
            count[key] -= 1
            if count[key] == 0 and key in wanted:
                missing.add(key)
        if keys:
            by_name[name] = keys
            for key in keys:
                count[key] = count.get(key, 0) + 1
                missing.discard(key)

    try:
        for event in kube.watch(api_version, kind, stop=stop, namespace=namespace, label_selector=label_selector):
            if event.type == "RELISTED":
                by_name.clear()
                count.clear()
                missing.update(wanted)
                for obj in event.object["items"]:
                    put(obj["metadata"]["name"], frozenset(satisfies(obj)))
            else:
                name = event.object["metadata"]["name"]
                put(name, frozenset() if event.type == "DELETED" else frozenset(satisfies(event.object)))
            if not missing:
                return
            if time.monotonic() - last_report > PROGRESS_EVERY_S:
                progress(
                    f"fleet: waiting for {what}: {len(missing)} of {len(wanted)} missing, e.g. "
                    f"{', '.join(map(str, sorted(missing, key=str)[:3]))}"
                )
                last_report = time.monotonic()
    finally:
        timer.cancel()
    raise TimeoutError(
        f"{what}: {len(missing)} of {len(wanted)} still missing after {timeout_s:.0f} s, e.g. "
        f"{', '.join(map(str, sorted(missing, key=str)[:5]))}"
    )
