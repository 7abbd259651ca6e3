"""The errors of API calls: the apiserver's failures, by HTTP status, as our own exceptions.

Every failure of the client leaves `Kube` as one of these, raised `from` the client's (`translate`), with a
trimmed message and never a raw response body; a failure of the first request is put in words a user acts
on (`refused`): refused credentials, a certificate the client does not trust, a server that does not answer.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import ConnectTimeoutError, NewConnectionError, ProxyError, SSLError

from pytest_gpucanary.errors import EnvError, GpucanaryError

if TYPE_CHECKING:
    from pytest_gpucanary.kubeconfig import Selected


class KubeError(GpucanaryError):
    """An API call failed."""

    status = 0


class NotFound(KubeError):
    status = 404


class Forbidden(KubeError):
    """403: RBAC, or an admission policy (deploy/admission.yaml), refused the request."""

    status = 403


class Conflict(KubeError):
    status = 409


class Gone(KubeError):
    status = 410


class Throttled(KubeError):
    """429: a PodDisruptionBudget refused an eviction, or the server asked us to slow down."""

    status = 429


class Unavailable(KubeError):
    """The apiserver could not be reached or answered 5xx."""


class Unauthorized(KubeError):
    """401: the apiserver did not accept the credentials (expired, revoked, or never valid)."""

    status = 401


_BY_STATUS = {cls.status: cls for cls in (Unauthorized, Forbidden, NotFound, Conflict, Gone, Throttled)}


def _message(exc: ApiException) -> str:
    try:
        return str(json.loads(exc.body or "").get("message", exc.reason))[:256]
    except (TypeError, ValueError, AttributeError):
        return str(exc.reason)[:256]


def refused(exc: Exception, selected: Selected) -> GpucanaryError:
    """The first request's failure in words a user acts on: refused credentials, a certificate the client
    does not trust, a server that does not answer; never a bare MaxRetryError."""
    where = f"the apiserver {selected.server} (context {selected.context!r})"
    if isinstance(exc, ApiException) and exc.status == 401:
        return EnvError(
            f"{where} refused the credentials of user {selected.user_name!r} (401 Unauthorized)",
            hint="they are expired, revoked or for another cluster: refresh the kubeconfig",
        )
    reason = getattr(exc, "reason", None) or exc
    if isinstance(reason, SSLError) or "CERTIFICATE_VERIFY_FAILED" in str(reason):
        why = "certificate verify failed" if "CERTIFICATE_VERIFY_FAILED" in str(reason) else "handshake failed"
        return EnvError(
            f"TLS with {where}: {why}",
            hint=f"check certificate-authority (and tls-server-name) of cluster {selected.cluster_name!r}",
        )
    if isinstance(reason, (NewConnectionError, ConnectTimeoutError, ProxyError)):
        return EnvError(
            f"cannot reach {where}: {type(reason).__name__}: "
            + " ".join(str(getattr(reason, "reason", None) or reason).split()[-6:])[:160],
            hint="is the server address right, and is it reachable from here?",
        )
    return translate(exc, f"connecting to {where}")


def translate(exc: Exception, what: str) -> KubeError:
    if isinstance(exc, ApiException):
        status = exc.status or 0
        cls = _BY_STATUS.get(status, Unavailable if status >= 500 else KubeError)
        error = cls(f"{what}: {status} {_message(exc)}")
    else:
        error = Unavailable(f"{what}: cannot reach the apiserver ({type(exc).__name__})")
    return error
