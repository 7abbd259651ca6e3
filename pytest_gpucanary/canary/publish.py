"""A finished run's verdict where a CD pipeline reads it: a ConfigMap in the canary's own namespace, and a
push of its metrics to a Pushgateway; and `gpucanary verdict`'s check of it.

One ConfigMap per key (policy digest, target driver, operator release): the last run to finish for a key
is its verdict, passed or not, so a failing run after a passing one withdraws the pass. A run that ended
without a verdict (an error, a lost lease) leaves the earlier one as it was. Writes are conditional: a run
that finished earlier than the one recorded never replaces it.
"""

from __future__ import annotations

import base64
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.kube import Kube, patch_as_read
from pytest_gpucanary.kube.errors import Conflict, NotFound
from pytest_gpucanary.kube.ownership import OWNER, OWNER_LABEL
from pytest_gpucanary.receipt.verdict import Verdict, VerdictKey
from pytest_gpucanary.safe_text import redact_url

NAMESPACE = "gpucanary"  # deploy/rbac.yaml's, where the canary's ServiceAccount lives
VERDICT_LABEL = "gpucanary.io/verdict"
CONFIGMAP = ("v1", "ConfigMap")
PUSH_JOB = "gpucanary"
PUSH_TIMEOUT_S = 10.0


def _configmap(verdict: Verdict) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": verdict.key.name,
            "namespace": NAMESPACE,
            "labels": {OWNER_LABEL: OWNER, VERDICT_LABEL: "pass" if verdict.passed else "fail"},
        },
        "data": verdict.data(),
    }


def record(kube: Kube, verdict: Verdict) -> bool:
    """Keep the verdict in the cluster; False when a run that finished later already has its verdict there."""
    body = _configmap(verdict)
    try:
        kube.create(body)
        return True
    except Conflict:
        pass  # an earlier run's verdict for the same key

    def decide(current: dict) -> tuple[dict | None, bool]:
        try:
            newer = Verdict.from_data(current.get("data") or {}).finished_wall_ns > verdict.finished_wall_ns
        except (ValueError, KeyError, TypeError):
            newer = False  # not a verdict we can read: ours replaces it
        if newer:
            return None, False
        return {"metadata": {"labels": body["metadata"]["labels"]}, "data": body["data"]}, True

    written = patch_as_read(
        kube,
        *CONFIGMAP,
        verdict.key.name,
        decide,
        what=f"ConfigMap {NAMESPACE}/{verdict.key.name}",
        hint="run again",
        namespace=NAMESPACE,
    )
    return bool(written)


def read(kube: Kube, key: VerdictKey) -> Verdict | None:
    try:
        found = kube.get(*CONFIGMAP, key.name, namespace=NAMESPACE)
    except NotFound:
        return None
    try:
        verdict = Verdict.from_data(found.get("data") or {})
    except (ValueError, KeyError, TypeError):
        raise EnvError(
            f"ConfigMap {NAMESPACE}/{key.name} holds no readable verdict",
            hint="delete it; the next canary run records it again",
        ) from None
    return verdict if verdict.key == key else None  # a 20-hex-digit name shared by two keys: not this one


def refusal(
    verdict: Verdict | None, key: VerdictKey, *, max_age_s: float, now_ns: Callable[[], int] = time.time_ns
) -> str | None:
    """Why the verdict does not let the rollout go on; None when it does (passed, and younger than max_age_s)."""
    if verdict is None:
        return f"no canary verdict for {key.describe()}: run the canary with exactly this policy and target"
    if not verdict.passed:
        return f"the canary failed: {verdict.line()}"
    age_s = (now_ns() - verdict.finished_wall_ns) / 1e9
    if age_s > max_age_s:
        return f"the passing verdict is {age_s / 3600:.1f} h old, older than {max_age_s / 3600:g} h: {verdict.line()}"
    return None


def push(url: str, verdict: Verdict, *, timeout_s: float = PUSH_TIMEOUT_S) -> None:
    """PUT the verdict's metrics to a Pushgateway, in the group of its key (replacing that group's last push)."""
    group = "".join(f"/{name}@base64/{_b64(value)}" for name, value in verdict.key.labels().items())
    request = urllib.request.Request(
        f"{url.rstrip('/')}/metrics/job/{PUSH_JOB}{group}",
        method="PUT",
        data=verdict.exposition().encode(),
        headers={"Content-Type": "text/plain; version=0.0.4"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s):
            return
    except urllib.error.HTTPError as err:
        why = f"HTTP {err.code}: {err.read(200).decode(errors='replace').strip()}"
    except (urllib.error.URLError, OSError, ValueError) as err:
        why = str(getattr(err, "reason", err))[:120]
    raise EnvError(
        f"cannot push the verdict to the Pushgateway at {redact_url(url)} ({why})",
        hint="check the URL; the verdict is in the receipt's verdict.prom too",
    )


def _b64(value: str) -> str:
    """The Pushgateway's base64 form of a grouping label value (the only form that carries '/' or nothing)."""
    return base64.urlsafe_b64encode(value.encode()).decode() or "="
