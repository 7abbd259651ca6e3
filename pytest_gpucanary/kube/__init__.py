"""The only package that imports `kubernetes`; here: the clients, CRUD on plain dicts, eviction, one watch.

Objects cross this boundary as plain dicts; API failures become our own errors (`kube.errors`), raised
`from` the client's, with trimmed messages and never a raw response body. Every wait is `watch_until`
(`kube.waits`) over the one list-then-watch primitive `watch`; nothing here polls. What the canary marks
its objects with is in `kube.ownership`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from kubernetes import config as kube_config
from kubernetes import watch as kube_watch
from kubernetes.client import CoreV1Api, VersionApi
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import ResourceNotFoundError
from urllib3.exceptions import HTTPError

from pytest_gpucanary import __version__
from pytest_gpucanary.config import flag
from pytest_gpucanary.credentials import ExecToken, FileToken
from pytest_gpucanary.errors import ConfigError, EnvError
from pytest_gpucanary.kube.errors import Conflict, Gone, NotFound, Unauthorized, Unavailable, refused, translate
from pytest_gpucanary.kube.waits import Waits, WatchEvent
from pytest_gpucanary.kubeconfig import select

T = TypeVar("T")
PAGE_SIZE = 100  # objects per page where the canary reads one per node (`Kube.each`)
# (connect, read) seconds for every request: the client's default is no timeout at all, so one half-open
# connection would hang a Lease renewal (and let the Lease lapse) or a restore forever
REQUEST_TIMEOUT_S = (10, 60)
WATCH_READ_MARGIN_S = 15  # a watch stream's read timeout: the server's own timeout plus this


def _plain(_client: Any, data: Any) -> Any:
    """The dynamic client's serializer for plain JSON: no ResourceInstance built around every answer only to be
    converted back (on a list of 1,000 driver pods that took 87 MiB more at peak: 268 instead of 181 MiB)."""
    return data


def with_resource_version(body: dict, resource_version: str | None) -> dict:
    """A merge patch that the apiserver applies only to the object at `resource_version` (else 409)."""
    if resource_version is None:
        return body
    return {**body, "metadata": {**body.get("metadata", {}), "resourceVersion": resource_version}}


AS_READ_TRIES = 3  # a 409 on a conditional write: read again and decide again, this often


def patch_as_read(
    kube: Kube,
    api_version: str,
    kind: str,
    name: str,
    decide: Callable[[dict], tuple[dict | None, T]],
    *,
    what: str,
    hint: str = "run `gpucanary cleanup` again",
    read: dict | None = None,
    namespace: str | None = None,
) -> T | None:
    """Read the object (or take `read`, a copy just listed), let `decide` make the patch from what it read, and
    write it only if the object is still as read (its resourceVersion); on a 409 read and decide again.
    `decide` returns (None, result) to write nothing. None when the object is gone; EnvError when it keeps
    changing."""
    for _ in range(AS_READ_TRIES):
        try:
            obj, read = read or kube.get(api_version, kind, name, namespace=namespace), None
        except NotFound:
            return None
        body, result = decide(obj)
        if body is None:
            return result
        try:
            kube.patch(
                api_version, kind, name, body, namespace=namespace, resource_version=obj["metadata"]["resourceVersion"]
            )
            return result
        except Conflict:
            continue  # changed between the read and the write: judge it again
        except NotFound:
            return None
    raise EnvError(f"{what} kept changing between each read and write ({AS_READ_TRIES} tries)", hint=hint)


@dataclass
class Kube(Waits):
    """A connection to one cluster, named by kubeconfig path and context."""

    dynamic: DynamicClient
    token_source: ExecToken | FileToken | None = None  # read again, once, when the apiserver says 401
    token_expires: datetime | None = None  # a static token's end, where it says (a ServiceAccount token)
    # the group versions the server lists, read once and again only when one is asked for that it did not list
    _group_versions: set[str] = field(default_factory=set, repr=False)

    @classmethod
    def connect(
        cls,
        kubeconfig: Path | str | None,
        *,
        context: str | None = None,
        option: str = flag("kubeconfig"),
        user_agent: str | None = None,
    ) -> Kube:
        """`option` is how the caller's command spells the kubeconfig, for the error line; `user_agent`
        defaults to gpucanary/<version>, so the apiserver's audit log tells our requests apart. The
        kubeconfig is checked field by field first (`kubeconfig.select`): one line per mistake."""
        context_option = "--context" if option == "--kubeconfig" else flag("context")
        selected = select(kubeconfig, context=context, option=option, context_option=context_option)
        try:
            api = kube_config.new_client_from_config_dict(selected.config, context=selected.context)
            api.user_agent = user_agent or f"gpucanary/{__version__}"
        except (ConfigException, OSError, TypeError, ValueError, AttributeError, KeyError) as exc:
            why = "".join(c if c.isprintable() else "?" for c in " ".join(str(exc).split()))[:160]
            raise ConfigError(
                f"cannot load kubeconfig {selected.where}: {type(exc).__name__}: {why}",
                hint=f"pass {option} naming a valid kubeconfig",
            ) from None
        if selected.token_source is not None:
            source = selected.token_source
            api.configuration.refresh_api_key_hook = lambda conf: conf.api_key.update(BearerToken=source.bearer())
        try:
            VersionApi(api).get_code(_request_timeout=REQUEST_TIMEOUT_S)  # who we are, and whom we talk to, now
            return cls(DynamicClient(api), selected.token_source, selected.static_token_expiry())
        except (ApiException, HTTPError, OSError) as exc:
            raise refused(exc, selected) from exc

    def _served(self, api_version: str) -> bool:
        """Whether the server lists `api_version`: one GET of /apis where it was not listed before. The dynamic
        client, asked for a kind it does not know, discovers every group version again (some 30 requests), so a
        kind of a group the cluster does not serve (NodeMaintenance, Skyhook, ...) is answered here instead."""
        if api_version == "v1" or api_version in self._group_versions:
            return True
        listed = self._call("discover the served API groups", self.dynamic.request, "GET", "/apis", serializer=_plain)
        self._group_versions.update(v["groupVersion"] for g in listed.get("groups") or [] for v in g["versions"])
        return api_version in self._group_versions

    def _resource(self, api_version: str, kind: str) -> Any:
        if not self._served(api_version):
            raise NotFound(f"the cluster serves no {kind} in {api_version}")
        try:
            return self.dynamic.resources.get(api_version=api_version, kind=kind)
        except ResourceNotFoundError as exc:
            raise NotFound(f"the cluster serves no {kind} in {api_version}") from exc
        except (ApiException, HTTPError, OSError) as exc:  # discovery may go to the server
            raise translate(exc, f"discover {kind} in {api_version}") from exc

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("_request_timeout", REQUEST_TIMEOUT_S)
        try:
            return fn(*args, **kwargs)
        except ApiException as exc:
            if exc.status != 401 or self.token_source is None:
                raise translate(exc, what) from exc
        except (HTTPError, OSError) as exc:
            raise translate(exc, what) from exc
        self.token_source.renew()  # revoked or rotated before its time: the next token, once
        try:
            return fn(*args, **kwargs)
        except (ApiException, HTTPError, OSError) as exc:
            raise translate(exc, what) from exc

    def create(self, manifest: dict) -> dict:
        resource = self._resource(manifest["apiVersion"], manifest["kind"])
        meta = manifest["metadata"]
        what = f"create {manifest['kind']} {meta.get('namespace', '')}/{meta.get('name', meta.get('generateName'))}"
        created = self._call(what, resource.create, body=manifest, namespace=meta.get("namespace"), serializer=_plain)
        return created

    def get(self, api_version: str, kind: str, name: str, *, namespace: str | None = None) -> dict:
        resource = self._resource(api_version, kind)
        return self._call(f"get {kind} {name}", resource.get, name=name, namespace=namespace, serializer=_plain)

    def list(
        self,
        api_version: str,
        kind: str,
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        limit: int | None = None,
    ) -> list[dict]:
        """The matching objects (at most `limit`, where the answer needs one, not one per node)."""
        resource = self._resource(api_version, kind)
        result = self._call(
            f"list {kind}",
            resource.get,
            namespace=namespace,
            label_selector=label_selector,
            field_selector=field_selector,
            limit=limit,
            serializer=_plain,
        )
        return result["items"]

    def each(
        self, api_version: str, kind: str, *, label_selector: str | None = None, page_size: int = PAGE_SIZE
    ) -> Iterator[dict]:
        """Every matching object, read in pages (limit + continue): for reads of one object per node, so the
        client holds one page of them at a time, not the whole cluster's."""
        resource = self._resource(api_version, kind)
        token = None
        while True:
            page = self._call(
                f"list {kind}",
                resource.get,
                label_selector=label_selector,
                limit=page_size,
                _continue=token,
                serializer=_plain,
            )
            yield from page["items"]
            token = page["metadata"].get("continue")
            if not token:
                return

    def delete(
        self, api_version: str, kind: str, name: str, *, namespace: str | None = None, uid: str | None = None
    ) -> None:
        """With `uid` the apiserver deletes only that object, not one made since under the same name (else 409)."""
        resource = self._resource(api_version, kind)
        body: dict = {"propagationPolicy": "Background", **({"preconditions": {"uid": uid}} if uid else {})}
        self._call(f"delete {kind} {name}", resource.delete, name=name, namespace=namespace, body=body)

    def patch(
        self,
        api_version: str,
        kind: str,
        name: str,
        body: dict,
        *,
        namespace: str | None = None,
        status: bool = False,
        resource_version: str | None = None,
    ) -> dict:
        """JSON merge patch (RFC 7386): works for built-in kinds and CRDs alike; `status` patches the
        status subresource. With `resource_version` (the one the caller read) the apiserver applies it
        only to that version of the object, else answers 409 (Conflict)."""
        body = with_resource_version(body, resource_version)
        resource = self._resource(api_version, kind)
        target = resource.subresources["status"] if status else resource
        patched = self._call(
            f"patch {kind} {name}{'/status' if status else ''}",
            self.dynamic.patch,
            target,
            body=body,
            name=name,
            namespace=namespace,
            content_type="application/merge-patch+json",
            serializer=_plain,
        )
        return patched

    def pod_log(
        self, name: str, *, namespace: str, tail_lines: int = 50, container: str | None = None, previous: bool = False
    ) -> str:
        """The last lines a container wrote; `previous`: of its last run, before the restart (a crash loop's)."""
        api = CoreV1Api(self.dynamic.client)
        optional = {"container": container} if container else {}
        return self._call(
            f"read the log of pod {namespace}/{name}",
            api.read_namespaced_pod_log,
            name,
            namespace,
            tail_lines=tail_lines,
            previous=previous,
            **optional,
        )

    def evict(self, name: str, *, namespace: str, grace_s: int | None = None) -> None:
        """Evict a pod through the Eviction API; raises Throttled when a PDB refuses it."""
        body: dict[str, Any] = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
        }
        if grace_s is not None:
            body["deleteOptions"] = {"gracePeriodSeconds": grace_s}
        path = f"/api/v1/namespaces/{namespace}/pods/{name}/eviction"
        self._call(f"evict pod {namespace}/{name}", self.dynamic.request, "post", path, body=body)

    def can_i(
        self, verb: str, resource: str, *, group: str = "", namespace: str | None = None, name: str | None = None
    ) -> bool:
        """Whether the caller may `verb` the resource (plural, `pods/eviction` for a subresource), asked
        of the apiserver's authorizer with a SelfSubjectAccessReview: a read-only question."""
        plural, _, subresource = resource.partition("/")
        attributes = {
            "verb": verb,
            "resource": plural,
            "group": group,
            "subresource": subresource,
            "namespace": namespace or "",
            "name": name or "",
        }
        review = self.create(
            {
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SelfSubjectAccessReview",
                "metadata": {},
                "spec": {"resourceAttributes": attributes},
            }
        )
        return bool(review.get("status", {}).get("allowed"))

    def request_token(self, service_account: str, *, namespace: str, expiration_s: int = 3600) -> str:
        """A bound token of a ServiceAccount (TokenRequest API), e.g. for a kubeconfig that acts as it."""
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": expiration_s},
        }
        path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{service_account}/token"
        answer = self._call(
            f"request a token of {namespace}/{service_account}",
            self.dynamic.request,
            "post",
            path,
            body=body,
            serializer=_plain,
        )
        return answer["status"]["token"]

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
    ) -> Iterator[WatchEvent]:
        """List, then watch from the list's version; re-watch from the newest version when the server
        ends a stream, and relist (yielding a RELISTED event) when that version has expired (410).

        Ends when `stop` is set, checked at every event and stream end (at least every
        `server_timeout_s`), or at `deadline` (time.monotonic()). A connection lost mid-stream also
        relists, so nothing is silently skipped. Every client failure leaves as one of our errors.
        """

        def remaining_s() -> float:
            return math.inf if deadline is None else deadline - time.monotonic()

        resource = self._resource(api_version, kind)
        while not stop.is_set() and remaining_s() > 0:
            listing = self._call(
                f"list {kind}",
                resource.get,
                namespace=namespace,
                label_selector=label_selector,
                field_selector=field_selector,
                serializer=_plain,
            )
            version = listing["metadata"]["resourceVersion"]
            yield WatchEvent("RELISTED", {"items": listing["items"]}, time.monotonic_ns(), time.time_ns())
            try:
                while not stop.is_set() and (left := remaining_s()) > 0:
                    # the client's own stream of plain dicts: the dynamic client's watch would also wrap every
                    # object in a ResourceInstance, CPU spent before the receive time is taken
                    stream = self._call(
                        f"watch {kind}",
                        kube_watch.Watch().stream,
                        resource.get,
                        serialize=False,
                        namespace=namespace,
                        label_selector=label_selector,
                        field_selector=field_selector,
                        resource_version=version,
                        timeout_seconds=(timeout := max(1, math.ceil(min(server_timeout_s, left)))),
                        allow_watch_bookmarks=True,
                        _request_timeout=(REQUEST_TIMEOUT_S[0], timeout + WATCH_READ_MARGIN_S),
                    )
                    for raw in self._guard(f"watch {kind}", stream):  # an ERROR event arrives as ApiException
                        received = (time.monotonic_ns(), time.time_ns())
                        obj = raw["raw_object"]
                        version = obj.get("metadata", {}).get("resourceVersion", version)
                        if raw["type"] != "BOOKMARK":
                            yield WatchEvent(raw["type"], obj, *received)
                        if stop.is_set() or remaining_s() <= 0:
                            return
            except Gone:
                continue

    def _guard(self, what: str, stream: Iterator[dict]) -> Iterator[dict]:
        try:
            yield from stream
        except (ApiException, HTTPError, OSError) as exc:
            error = translate(exc, what)
            if isinstance(error, (Gone, Unavailable, Unauthorized)) or error.status == 0:
                raise Gone(str(error)) from exc  # resume from a fresh list
            raise error from exc
