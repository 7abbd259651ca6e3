"""`FakeKube`: an in-memory stand-in for the Kubernetes apiserver, behind the surface of `kube.Kube`.

It stands in for the apiserver's storage and watch cache, not for any controller: objects are kept by
(apiVersion, kind) and (namespace, name); `create` stamps uid, resourceVersion, creationTimestamp and
generation; `patch` is a JSON merge patch (RFC 7386) that bumps generation when the spec changes and, given a
resourceVersion, answers 409 unless the object is still at it, as the apiserver does; `watch` lists, then streams every later change made through the double from any
thread. Nothing here reconciles anything: a test that wants the GPU Operator or the kubelet to have
acted writes that state itself. Faults are data (`fail`, `fail_watch`) and surface as the product's
own errors from `pytest_gpucanary.kube.errors`. A crash is data too (`crash_after_write`): the store as it
stood right after a write, as a process killed at that instant leaves the apiserver. The waits (`watch_until`, `wait_for`, `wait_gone`) are the
real ones from `Kube`, running over this `watch`.
"""

from __future__ import annotations

import copy
import itertools
import threading
import time
import uuid
from datetime import datetime, timezone
from typing import Iterator

from pytest_gpucanary.kube import PAGE_SIZE, Kube, with_resource_version
from pytest_gpucanary.kube.errors import Conflict, KubeError, NotFound
from pytest_gpucanary.kube.waits import WatchEvent
from pytest_gpucanary.label_selector import parse_selector

Key = tuple[str | None, str]         # (namespace, name); namespace None for cluster-scoped kinds
TICK_S = 0.05                        # how often a waiting watch looks at `stop` (the real one: every stream end)


def merge_patch(target: object, patch: object) -> object:
    """RFC 7386: null deletes a key, objects merge recursively, everything else (lists too) replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    merged = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = merge_patch(merged.get(key), value)
    return merged


def _field(obj: dict, path: str) -> str:
    value: object = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "" if value is None else str(value)


def matcher(namespace: str | None, label_selector: str | None, field_selector: str | None):
    """The server-side filter of a list or watch: namespace, label selector, `path=value` field selector."""
    labels_ok = parse_selector(label_selector) if label_selector else ()
    fields = [part.split("=", 1) for part in field_selector.split(",")] if field_selector else []

    def match(obj: dict) -> bool:
        meta = obj["metadata"]
        return ((namespace is None or meta.get("namespace") == namespace)
                and all(req(meta.get("labels", {})) for req in labels_ok)
                and all(_field(obj, path) == value for path, value in fields))
    return match


class Crashed(BaseException):
    """The process 'died' right after a write: nothing of the run's own after it may reach the cluster.
    A BaseException, as nothing in the product may catch it; its unwinding only drains the run's
    threads, and the cluster it leaves is `FakeKube.at_crash`, taken before it was raised."""


class FakeKube:
    """The apiserver's objects and watch stream in memory; the same verbs as `kube.Kube`, thread-safe."""

    watch_until = Kube.watch_until
    wait_for = Kube.wait_for
    wait_gone = Kube.wait_gone
    token_expires = None          # the credentials a test's runs use never end

    def __init__(self) -> None:
        self._store: dict[tuple[str, str], dict[Key, dict]] = {}
        # every write and scripted event: (apiVersion, kind, type, old, new, scripted); watches read it on
        self._changes: list[tuple[str, str, str, dict | None, dict | None, bool]] = []
        self._cond = threading.Condition()
        self._versions = itertools.count(1)
        self._faults: dict[tuple[str, str], list[KubeError]] = {}
        self._watch_faults: dict[str, list[tuple[KubeError, bool]]] = {}
        self.writes: list[tuple[str, str, str | None, str]] = []   # counted writes: (verb, kind, namespace, name)
        self.denied: set[tuple[str, str]] = set()                 # (verb, resource) access reviews refuse
        self.at_crash: dict | None = None
        self._crash_after: int | None = None
        self._crash_thread: threading.Thread | None = None

    @classmethod
    def holding(cls, objects: dict[tuple[str, str, str | None, str], dict]) -> FakeKube:
        """A store holding exactly `objects` (as `objects()` returns them), metadata untouched."""
        fake = cls()
        for (api, kind, namespace, name), obj in objects.items():
            fake._store.setdefault((api, kind), {})[(namespace, name)] = copy.deepcopy(obj)
        return fake

    # --- faults, as data ------------------------------------------------------------------------------
    def can_i(self, verb: str, resource: str, *, group: str = "", namespace: str | None = None,
              name: str | None = None) -> bool:
        """The double's caller may do anything but what `deny` named (a SelfSubjectAccessReview's answer)."""
        return (verb, resource) not in self.denied

    def deny(self, verb: str, resource: str) -> None:
        self.denied.add((verb, resource))

    def fail(self, verb: str, kind: str, error: KubeError) -> None:
        """The next `verb` (create, get, list, delete, patch, evict) on `kind` raises `error`."""
        self._faults.setdefault((verb, kind), []).append(error)

    def fail_watch(self, kind: str, error: KubeError, *, before_relist: bool = False) -> None:
        """The next watch of `kind` raises `error` after its RELISTED (the stream broke), or instead of
        it (the list failed)."""
        self._watch_faults.setdefault(kind, []).append((error, before_relist))

    def emit(self, api_version: str, kind: str, type_: str, obj: dict) -> None:
        """Send a scripted event to the watches of `kind` as is (matching filters), leaving the store alone:
        what a server may send that no write here produces (a late event for an object already gone)."""
        with self._cond:
            self._changes.append((api_version, kind, type_, None, copy.deepcopy(obj), True))
            self._cond.notify_all()

    def crash_after_write(self, count: int, *, thread: threading.Thread | None = None) -> None:
        """Right after the `count`-th successful write made from `thread` (default: the main thread, so the
        count is deterministic while background threads write too), keep the store as `at_crash` and raise
        `Crashed` in the writer. The dead thread's later calls raise `Crashed` too (its unwinding must not
        reach the cluster, nor wait on it); other threads go on until the run stops them."""
        self._crash_after, self._crash_thread = count, thread or threading.main_thread()

    def _wrote(self, verb: str, kind: str, namespace: str | None, name: str) -> None:
        if threading.current_thread() is not (self._crash_thread or threading.main_thread()):
            return
        self.writes.append((verb, kind, namespace, name))
        if self._crash_after is not None and len(self.writes) == self._crash_after:
            self.at_crash = self.objects()
            raise Crashed(f"after write {len(self.writes)}: {verb} {kind} {name}")

    def _fault(self, verb: str, kind: str) -> None:
        if self.at_crash is not None and threading.current_thread() is self._crash_thread:
            raise Crashed(f"{verb} {kind} from a dead process")
        if queue := self._faults.get((verb, kind)):
            raise queue.pop(0)

    # --- the Kube surface -------------------------------------------------------------------------------
    def create(self, manifest: dict) -> dict:
        api, kind, meta = manifest["apiVersion"], manifest["kind"], manifest.get("metadata", {})
        self._fault("create", kind)
        obj = copy.deepcopy(manifest)
        name = meta.get("name") or meta["generateName"] + uuid.uuid4().hex[:5]
        with self._cond:
            objects = self._store.setdefault((api, kind), {})
            if (meta.get("namespace"), name) in objects:
                raise Conflict(f"create {kind} {name}: 409 already exists")
            obj["metadata"] = {**obj["metadata"], "name": name, "uid": str(uuid.uuid4()), "generation": 1,
                               "creationTimestamp": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
            self._write(api, kind, "ADDED", None, obj)
        self._wrote("create", kind, meta.get("namespace"), name)
        return copy.deepcopy(obj)

    def get(self, api_version: str, kind: str, name: str, *, namespace: str | None = None) -> dict:
        self._fault("get", kind)
        with self._cond:
            return copy.deepcopy(self._find(api_version, kind, name, namespace))

    def list(self, api_version: str, kind: str, *, namespace: str | None = None, label_selector: str | None = None,
             field_selector: str | None = None, limit: int | None = None) -> list[dict]:
        self._fault("list", kind)
        match = matcher(namespace, label_selector, field_selector)
        with self._cond:
            found = [copy.deepcopy(o) for _, o in sorted(self._store.get((api_version, kind), {}).items(),
                                                         key=lambda item: (item[0][0] or "", item[0][1])) if match(o)]
        return found[:limit] if limit else found

    def each(self, api_version: str, kind: str, *, label_selector: str | None = None,
             page_size: int = PAGE_SIZE) -> Iterator[dict]:
        """The same objects as `list`: the store is read at once, so paging would change nothing here."""
        yield from self.list(api_version, kind, label_selector=label_selector)

    def delete(self, api_version: str, kind: str, name: str, *, namespace: str | None = None,
               uid: str | None = None) -> None:
        self._fault("delete", kind)
        with self._cond:
            old = self._find(api_version, kind, name, namespace)
            if uid and old["metadata"].get("uid") != uid:
                raise Conflict(f"delete {kind} {name}: 409 Precondition failed: UID in precondition: {uid}")
            self._write(api_version, kind, "DELETED", old, None)
            if kind == "Namespace":   # the namespace controller empties it; here at once
                for (api, other), objects in list(self._store.items()):
                    for key in [k for k in objects if k[0] == name]:
                        self._write(api, other, "DELETED", objects[key], None)
        self._wrote("delete", kind, namespace, name)

    def patch(self, api_version: str, kind: str, name: str, body: dict, *, namespace: str | None = None,
              status: bool = False, resource_version: str | None = None) -> dict:
        self._fault("patch", kind)
        body = with_resource_version(body, resource_version)
        with self._cond:
            old = self._find(api_version, kind, name, namespace)
            wanted = body.get("metadata", {}).get("resourceVersion")
            if wanted is not None and wanted != old["metadata"].get("resourceVersion"):
                raise Conflict(f"patch {kind} {name}: 409 the object has been modified")
            new = merge_patch(old, body)
            new["metadata"] = {**new["metadata"], "name": old["metadata"]["name"], "uid": old["metadata"]["uid"]}
            for key in ("labels", "annotations"):     # empty maps are omitted, as ObjectMeta serializes them
                if new["metadata"].get(key) == {}:
                    del new["metadata"][key]
            if new.get("spec") != old.get("spec"):
                new["metadata"]["generation"] = old["metadata"].get("generation", 0) + 1
            self._write(api_version, kind, "MODIFIED", old, new)
        self._wrote("patch", kind, namespace, name)
        return copy.deepcopy(new)

    def evict(self, name: str, *, namespace: str, grace_s: int | None = None) -> None:
        """No PodDisruptionBudgets here: a refusal is `fail("evict", "Pod", Throttled(...))`."""
        self._fault("evict", "Pod")
        self.delete("v1", "Pod", name, namespace=namespace)

    def watch(self, api_version: str, kind: str, *, stop: threading.Event, namespace: str | None = None,
              label_selector: str | None = None, field_selector: str | None = None,
              server_timeout_s: int = 60, deadline: float | None = None) -> Iterator[WatchEvent]:
        """RELISTED with the matching objects, then each later change as the server would send it: an object
        that starts matching arrives as ADDED, one that stops matching as DELETED. Ends on `stop` or
        `deadline` (time.monotonic())."""
        self._fault("watch", kind)
        faults = self._watch_faults.get(kind)
        error, before_relist = faults.pop(0) if faults else (None, False)
        if error is not None and before_relist:
            raise error
        match = matcher(namespace, label_selector, field_selector)
        with self._cond:
            seen = len(self._changes)
            items = self.list(api_version, kind, namespace=namespace, label_selector=label_selector,
                              field_selector=field_selector)
        yield _event("RELISTED", {"items": items})
        if error is not None:
            raise error
        while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
            with self._cond:
                if seen == len(self._changes):
                    left_s = TICK_S if deadline is None else deadline - time.monotonic()
                    self._cond.wait(max(0.0, min(TICK_S, left_s)))
                changes, seen = self._changes[seen:], len(self._changes)
            for api, kind_, type_, old, new, scripted in changes:
                if (api, kind_) != (api_version, kind):
                    continue
                was, now = old is not None and match(old), new is not None and match(new)
                if scripted and now:
                    yield _event(type_, new)
                elif now:
                    yield _event("MODIFIED" if was and type_ != "ADDED" else "ADDED", new)
                elif was:
                    yield _event("DELETED", old)

    # --- store ------------------------------------------------------------------------------------------
    def objects(self) -> dict[tuple[str, str, str | None, str], dict]:
        """Every stored object by (apiVersion, kind, namespace, name): what a test compares."""
        with self._cond:
            return {(api, kind, ns, name): copy.deepcopy(obj) for (api, kind), objs in self._store.items()
                    for (ns, name), obj in objs.items()}

    def _find(self, api_version: str, kind: str, name: str, namespace: str | None) -> dict:
        try:
            return self._store[(api_version, kind)][(namespace, name)]
        except KeyError:
            raise NotFound(f"get {kind} {name}: 404 not found") from None

    def _write(self, api: str, kind: str, type_: str, old: dict | None, new: dict | None) -> None:
        objects = self._store.setdefault((api, kind), {})
        key = ((new or old)["metadata"].get("namespace"), (new or old)["metadata"]["name"])
        if new is None:
            del objects[key]
        else:
            new["metadata"]["resourceVersion"] = str(next(self._versions))
            objects[key] = copy.deepcopy(new)
        self._changes.append((api, kind, type_, copy.deepcopy(old), copy.deepcopy(new), False))
        self._cond.notify_all()


def _event(type_: str, obj: dict) -> WatchEvent:
    return WatchEvent(type_, obj, time.monotonic_ns(), time.time_ns())
