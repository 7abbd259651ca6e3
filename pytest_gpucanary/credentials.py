"""The credentials a command's kubeconfig user hands the apiserver, kept fresh for as long as the command runs.

`ExecToken` is an exec plugin's token: asked for again once three quarters of its life are gone, and at
once after the apiserver said 401 (a token revoked before its time); `FileToken` reads a tokenFile again
each minute and after a 401. Also the checks both kinds of client certificate share (`cert_and_key`),
what a token says about its own end (`token_expiry`) and `redact`, so that nothing a plugin or a cluster
says leaks a secret into an error line.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pytest_gpucanary.errors import ConfigError, EnvError

EXEC_TIMEOUT_S = 60
_SECRET = re.compile(
    r"(eyJ[\w-]{4,}\.[\w-]{4,}\.[\w-]*|(?i:bearer)\s+\S+|"
    r"(?i:token|password|secret)[\"']?\s*[:=]\s*[\"']?[^\s\"',}]+[\"']?)"
)


def redact(text: str) -> str:
    """Text from a credential plugin or a cluster, without what looks like a token, a password or a key."""
    return _SECRET.sub("[redacted]", text)


def _one_line(text: str, limit: int = 240) -> str:
    return redact(" ".join("".join(c if c.isprintable() else " " for c in text).split()))[:limit]


def token_expiry(token: str) -> datetime | None:
    """The `exp` claim of a JWT (a ServiceAccount token), read without verifying; None for other tokens."""
    parts = token.split(".")
    if len(parts) != 3:
        return None
    try:
        claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
        return datetime.fromtimestamp(int(claims["exp"]), UTC)
    except (ValueError, KeyError, TypeError, OverflowError):
        return None


def cert_and_key(cert: bytes, key: bytes, what: str, hint: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cert_path, key_path = Path(tmp, "cert"), Path(tmp, "key")
        cert_path.write_bytes(cert)
        key_path.write_bytes(key)
        key_path.chmod(0o600)
        try:
            ssl.create_default_context().load_cert_chain(str(cert_path), str(key_path))
        except ssl.SSLError as exc:
            why = "do not belong together" if "MISMATCH" in str(exc).upper() else "are not a PEM certificate and key"
            raise ConfigError(f"{what}: client-certificate and client-key {why}", hint=hint) from None


@dataclass(frozen=True)
class ExecSpec:
    command: Path
    args: tuple[str, ...]
    env: dict[str, str]
    api_version: str
    provide_cluster_info: bool


@dataclass(frozen=True)
class Answer:
    token: str = ""
    cert: bytes | None = None
    key: bytes | None = None
    expires: datetime | None = None
    issued: datetime = field(default_factory=lambda: datetime.now(UTC))

    def stale(self, now: datetime) -> bool:
        """Three quarters of its life gone: a 15-minute EKS token is asked for again after 11 min 15 s."""
        return self.expires is not None and now >= self.issued + (self.expires - self.issued) * 3 / 4


class ExecToken:
    """An exec plugin's token, asked for again when it is getting old or the apiserver refused it."""

    def __init__(
        self, spec: ExecSpec, what: str, cluster: dict, run: Callable[..., subprocess.CompletedProcess] = subprocess.run
    ) -> None:
        self.spec, self.what, self.cluster, self._run = spec, what, cluster, run
        self._answer: Answer | None = None
        self._lock = threading.Lock()

    def answer(self, *, force: bool = False) -> Answer:
        with self._lock:
            if force or self._answer is None or self._answer.stale(datetime.now(UTC)):
                self._answer = self._ask()
            return self._answer

    def bearer(self, *, force: bool = False) -> str:
        return f"Bearer {self.answer(force=force).token}"

    def renew(self) -> None:
        self.answer(force=True)

    def _ask(self) -> Answer:
        info: dict[str, Any] = {"interactive": False}
        if self.spec.provide_cluster_info:
            info["cluster"] = {
                k: v
                for k, v in self.cluster.items()
                if k
                in ("server", "certificate-authority-data", "tls-server-name", "insecure-skip-tls-verify", "proxy-url")
            }
        env = {
            **os.environ,
            **self.spec.env,
            "KUBERNETES_EXEC_INFO": json.dumps(
                {"apiVersion": self.spec.api_version, "kind": "ExecCredential", "spec": info}
            ),
        }
        name = self.spec.command.name
        try:
            done = self._run(
                [str(self.spec.command), *self.spec.args],
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=EXEC_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            raise EnvError(
                f"{self.what}: exec plugin {name} gave no answer within {EXEC_TIMEOUT_S} s",
                hint="run it by hand to see what it waits for",
            ) from None
        except OSError as exc:
            raise EnvError(f"{self.what}: exec plugin {name} could not start ({exc.strerror})") from None
        if done.returncode != 0:
            said = _one_line((done.stderr or "").strip().splitlines()[-1] if (done.stderr or "").strip() else "")
            raise EnvError(
                f"{self.what}: exec plugin {name} exited {done.returncode}"
                + (f": {said}" if said else " and said nothing on stderr")
            )
        return self._parse(done.stdout, name)

    def _parse(self, out: str, name: str) -> Answer:
        def bad(why: str) -> EnvError:
            return EnvError(f"{self.what}: exec plugin {name} answered no valid ExecCredential: {why}")

        try:
            doc = json.loads(out)
        except ValueError:
            raise bad("not JSON") from None
        if not isinstance(doc, dict) or doc.get("kind") != "ExecCredential":
            raise bad("kind is not ExecCredential")
        if doc.get("apiVersion") != self.spec.api_version:
            raise bad(f"apiVersion {doc.get('apiVersion')!r}, asked for {self.spec.api_version}")
        status = doc["status"] if isinstance(doc.get("status"), dict) else {}
        expires = None
        if status.get("expirationTimestamp"):
            try:
                expires = datetime.fromisoformat(str(status["expirationTimestamp"]).replace("Z", "+00:00"))
            except ValueError:
                raise bad("expirationTimestamp is not an RFC 3339 time") from None
            if expires.tzinfo is None:
                raise bad("expirationTimestamp has no time zone")
        if status.get("token"):
            return Answer(token=str(status["token"]), expires=expires)
        if status.get("clientCertificateData") and status.get("clientKeyData"):
            cert, key = str(status["clientCertificateData"]).encode(), str(status["clientKeyData"]).encode()
            cert_and_key(cert, key, f"{self.what}: exec plugin {name}'s answer", "check the plugin")
            return Answer(cert=cert, key=key, expires=expires)
        raise bad("status has neither token nor clientCertificateData and clientKeyData")


class FileToken:
    """A tokenFile, read again each minute and after a 401, as client-go does: a projected ServiceAccount
    token (CI in a pod) is rotated by the kubelet while the run goes on."""

    REREAD_S = 60

    def __init__(self, path: Path) -> None:
        self.path = path
        self._token, self._read_at = "", -math.inf
        self._lock = threading.Lock()

    def read(self) -> str:
        try:
            return self.path.read_text(errors="replace").strip()
        except OSError:
            return ""

    def bearer(self, *, force: bool = False) -> str:
        with self._lock:
            if force or time.monotonic() - self._read_at >= self.REREAD_S:
                self._token = self.read() or self._token  # a file caught mid-rotation keeps the last one
                self._read_at = time.monotonic()
            return f"Bearer {self._token}"

    def renew(self) -> None:
        self.bearer(force=True)
