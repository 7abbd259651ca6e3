"""What a watch yields (`WatchEvent`) and every wait built on it: `Kube` has these waits, each a
`watch_until` over its one list-then-watch primitive `watch`, so nothing polls (the unit tests' double
borrows them, running over its own `watch`).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

T = TypeVar("T")


class Waits:
    """The waits of `Kube`, over its `watch`."""

    if TYPE_CHECKING:

        def watch(
            self,
            api_version: str,
            kind: str,
            *,
            stop: threading.Event,
            namespace: str | None = None,
            label_selector: str | None = None,
            field_selector: str | None = None,
            server_timeout_s: int = 60,
            deadline: float | None = None,
        ) -> Iterator[WatchEvent]: ...

    def watch_until(
        self,
        api_version: str,
        kind: str,
        done: Callable[[dict[str, dict]], T | None],
        *,
        timeout_s: float,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> T:
        """Watch the matching objects until `done(latest objects by name)` returns something other than None,
        and return that. TimeoutError after `timeout_s`, naming the last state seen. Every wait is this."""
        deadline = time.monotonic() + timeout_s
        latest: dict[str, dict] = {}
        for event in self.watch(
            api_version,
            kind,
            stop=threading.Event(),
            namespace=namespace,
            label_selector=label_selector,
            field_selector=field_selector,
            deadline=deadline,
        ):
            if event.type == "RELISTED":
                latest = {o["metadata"]["name"]: o for o in event.object["items"]}
            elif event.type == "DELETED":
                latest.pop(event.object["metadata"]["name"], None)
            else:
                latest[event.object["metadata"]["name"]] = event.object
            if (result := done(latest)) is not None:
                return result
        last = {name: obj.get("status") for name, obj in latest.items()}
        raise TimeoutError(
            f"{kind} did not reach the expected state within {timeout_s:.0f} s; "
            f"last seen: {json.dumps(last, default=str)[:300]}"
        )

    def wait_for(
        self,
        api_version: str,
        kind: str,
        name: str,
        predicate: Callable[[dict], bool],
        *,
        namespace: str | None = None,
        timeout_s: float = 60.0,
    ) -> dict:
        """Watch one object until `predicate(obj)` holds; returns it."""
        return self.watch_until(
            api_version,
            kind,
            lambda objs: objs[name] if name in objs and predicate(objs[name]) else None,
            timeout_s=timeout_s,
            namespace=namespace,
            field_selector=f"metadata.name={name}",
        )

    def wait_gone(
        self, api_version: str, kind: str, name: str, *, namespace: str | None = None, timeout_s: float = 120.0
    ) -> None:
        """Watch until the object no longer exists (finalizers done)."""
        self.watch_until(
            api_version,
            kind,
            lambda objs: True if name not in objs else None,
            timeout_s=timeout_s,
            namespace=namespace,
            field_selector=f"metadata.name={name}",
        )


@dataclass(frozen=True)
class WatchEvent:
    """One watch event, with the client's receive time on both clocks (ns)."""

    type: str  # ADDED, MODIFIED, DELETED, or RELISTED (object = {"items": [...]})
    object: dict
    received_mono_ns: int
    received_wall_ns: int
