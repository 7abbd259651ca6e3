"""The kubeconfig a command was given: checked field by field before the first request, and its exec
plugin's token kept fresh for as long as the command runs.

`select()` reads the file(s) the way kubectl does (KUBECONFIG may list several; the first of each name
wins), picks the context and checks what it names: each mistake is one line naming the field, a
`ConfigError` (exit 4) for what the file says, an `EnvError` (exit 6) for what the file points at that
did not work (a plugin not installed, or one that ran and failed). What comes back is a one-context
kubeconfig with absolute paths and, for an exec user, the plugin replaced by the token it answered;
`ExecToken` asks the plugin again once three quarters of that token's life are gone, and at once
after the apiserver said 401 (a token revoked before its time); `FileToken` reads a tokenFile again
each minute and after a 401.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import json
import math
import os
import re
import shutil
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
from urllib.parse import urlsplit

import yaml

from pytest_gpucanary.errors import ConfigError, EnvError

EXEC_API_VERSIONS = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1")
EXEC_TIMEOUT_S = 60
# auth-provider plugins the Python client still runs; kubectl removed gcp and azure in 1.26
AUTH_PROVIDERS = ("oidc",)
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


@dataclass(frozen=True)
class Selected:
    """The context a command will use: its names, and the kubeconfig reduced to it."""

    where: str  # the file(s), as the error lines name them
    context: str
    cluster_name: str
    user_name: str
    server: str
    config: dict  # a one-context kubeconfig: absolute paths; an exec user as its token
    token_source: ExecToken | FileToken | None = None  # a token read again as it ages and after a 401

    def static_token_expiry(self) -> datetime | None:
        """When the user's fixed token stops working, where it says (a plugin's or a file's is read again)."""
        token = self.config["users"][0]["user"].get("token")
        return token_expiry(token) if token and self.token_source is None else None


def default_paths() -> list[Path]:
    listed = [p for p in os.environ.get("KUBECONFIG", "").split(os.pathsep) if p]
    return [Path(p) for p in listed] or [Path.home() / ".kube" / "config"]


def _load(paths: list[Path], where: str, hint: str) -> list[tuple[Path, dict]]:
    loaded = []
    for path in paths:
        try:
            text = path.read_text()
        except FileNotFoundError:
            if len(paths) > 1:
                continue  # kubectl skips a missing entry of KUBECONFIG
            raise ConfigError(f"kubeconfig {path}: no such file", hint=hint) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"kubeconfig {path}: cannot read it ({type(exc).__name__})", hint=hint) from None
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f" at line {mark.line + 1}" if mark else ""
            raise ConfigError(f"kubeconfig {path}: not YAML{at}", hint=hint) from None
        if doc is None:
            continue
        if not isinstance(doc, dict):
            raise ConfigError(f"kubeconfig {path}: not a kubeconfig (a YAML {type(doc).__name__})", hint=hint)
        loaded.append((path, doc))
    if not loaded:
        raise ConfigError(f"kubeconfig {where}: empty", hint=hint)
    return loaded


def _named(docs: list[tuple[Path, dict]], section: str) -> dict[str, tuple[Path, dict]]:
    """name -> (file, body) over every file; the first of a name wins, as in kubectl."""
    entries: dict[str, tuple[Path, dict]] = {}
    key = section[:-1]  # clusters -> cluster
    for path, doc in docs:
        for entry in doc.get(section) or []:
            if isinstance(entry, dict) and isinstance(entry.get("name"), str):
                body = entry.get(key)
                entries.setdefault(entry["name"], (path, body if isinstance(body, dict) else {}))
    return entries


def select(
    kubeconfig: Path | str | None, *, context: str | None, option: str, context_option: str = "--gpucanary-context"
) -> Selected:
    """The context `context` (else current-context) of `kubeconfig` (else $KUBECONFIG, else
    ~/.kube/config), checked; an exec plugin has answered once when this returns."""
    paths = [Path(kubeconfig).expanduser()] if kubeconfig else default_paths()
    where = os.pathsep.join(str(p) for p in paths)
    hint = f"pass {option} naming a valid kubeconfig"
    docs = _load(paths, where, hint)
    contexts, clusters, users = (_named(docs, s) for s in ("contexts", "clusters", "users"))
    name = context or next((d["current-context"] for _, d in docs if d.get("current-context")), "")
    if not name:
        raise ConfigError(
            f"kubeconfig {where}: no current-context is set",
            hint=f"pass {context_option} (contexts: {', '.join(contexts) or 'none'})",
        )
    if name not in contexts:
        raise ConfigError(
            f"kubeconfig {where}: context {name!r} not found",
            hint=f"pass {context_option} with one of: {', '.join(contexts) or '(none in the file)'}",
        )
    _, ctx = contexts[name]
    cluster_name, user_name = str(ctx.get("cluster") or ""), str(ctx.get("user") or "")
    if cluster_name not in clusters:
        raise ConfigError(f"kubeconfig {where}: context {name!r}: cluster {cluster_name!r} not found", hint=hint)
    if user_name and user_name not in users:
        raise ConfigError(f"kubeconfig {where}: context {name!r}: user {user_name!r} not found", hint=hint)
    cluster_file, cluster = clusters[cluster_name]
    user_file, user = users[user_name] if user_name else (cluster_file, {})
    cluster = _checked_cluster(
        dict(cluster), f"kubeconfig {where}: cluster {cluster_name!r}", cluster_file.parent, hint
    )
    user, token_source = _checked_user(
        dict(user), f"kubeconfig {where}: user {user_name!r}", user_file.parent, hint, cluster
    )
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": name,
        "contexts": [{"name": name, "context": {"cluster": cluster_name, "user": user_name}}],
        "clusters": [{"name": cluster_name, "cluster": cluster}],
        "users": [{"name": user_name, "user": user}],
    }
    return Selected(where, name, cluster_name, user_name, cluster["server"], config, token_source)


def _file(base: Path, value: Any, what: str, hint: str) -> Path:
    path = Path(str(value)).expanduser()
    path = path if path.is_absolute() else base / path
    if not path.is_file():
        raise ConfigError(f"{what} {path}: no such file", hint=hint)
    return path.resolve()


def _data(value: Any, what: str, hint: str) -> bytes:
    try:
        return base64.b64decode(str(value), validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(f"{what} is not base64", hint=hint) from None


def _pem_or_data(body: dict, key: str, base: Path, what: str, hint: str) -> bytes | None:
    """The PEM bytes of `key` (a file path) or `key`-data (base64), paths made absolute in `body`."""
    if body.get(f"{key}-data"):
        return _data(body[f"{key}-data"], f"{what}: {key}-data", hint)
    if body.get(key):
        path = _file(base, body[key], f"{what}: {key}", hint)
        body[key] = str(path)
        return path.read_bytes()
    return None


def _checked_cluster(cluster: dict, what: str, base: Path, hint: str) -> dict:
    server = str(cluster.get("server") or "")
    if not server:
        raise ConfigError(f"{what}: server is missing", hint=hint)
    parts = urlsplit(server)
    if parts.scheme not in ("https", "http") or not parts.hostname:
        raise ConfigError(f"{what}: server {server!r} is not an https:// URL", hint=hint)
    if parts.scheme == "http" and not _loopback(parts.hostname):
        raise ConfigError(
            f"{what}: server {server} is plain http to another host: credentials would cross the network in clear",
            hint="use the cluster's https:// address",
        )
    ca = _pem_or_data(cluster, "certificate-authority", base, what, hint)
    if ca is not None:
        if cluster.get("insecure-skip-tls-verify"):
            raise ConfigError(
                f"{what}: certificate-authority together with insecure-skip-tls-verify (kubectl refuses it too)",
                hint="drop one of them",
            )
        try:
            ssl.create_default_context(cadata=ca.decode("ascii", "replace"))
        except (ssl.SSLError, ValueError):
            raise ConfigError(f"{what}: certificate-authority is not a PEM certificate", hint=hint) from None
    proxy = str(cluster.get("proxy-url") or "")
    if proxy and urlsplit(proxy).scheme not in ("http", "https", "socks5"):
        raise ConfigError(f"{what}: proxy-url {proxy!r} is not an http(s):// or socks5:// URL", hint=hint)
    return cluster


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _checked_user(
    user: dict, what: str, base: Path, hint: str, cluster: dict
) -> tuple[dict, ExecToken | FileToken | None]:
    cert = _pem_or_data(user, "client-certificate", base, what, hint)
    key = _pem_or_data(user, "client-key", base, what, hint)
    if (cert is None) != (key is None):
        raise ConfigError(f"{what}: client-certificate without client-key (or the other way round)", hint=hint)
    if cert is not None and key is not None:
        _cert_and_key(cert, key, what, hint)
    if user.get("tokenFile") and "exec" not in user:
        path = _file(base, user.pop("tokenFile"), f"{what}: tokenFile", hint)
        source = FileToken(path)
        if not source.read():
            raise ConfigError(f"{what}: tokenFile {path} is empty", hint=hint)
        return {**user, "token": source.read()}, source
    provider = (user.get("auth-provider") or {}).get("name") if isinstance(user.get("auth-provider"), dict) else None
    if user.get("auth-provider") and provider not in AUTH_PROVIDERS:
        raise ConfigError(
            f"{what}: auth-provider {provider!r} is not supported (kubectl removed it in 1.26)",
            hint="use the provider's exec credential plugin (gke-gcloud-auth-plugin, kubelogin)",
        )
    if "exec" not in user:
        return user, None
    token = ExecToken(_checked_exec(user["exec"], what, base, hint), what, cluster)
    answer = token.answer()
    if answer.cert is not None:  # a plugin that answers with a client certificate: used as it answered
        user = {
            "client-certificate-data": base64.b64encode(answer.cert).decode(),
            "client-key-data": base64.b64encode(answer.key or b"").decode(),
        }
        return user, None
    return {"token": answer.token}, token


def _cert_and_key(cert: bytes, key: bytes, what: str, hint: str) -> None:
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


def _checked_exec(spec: Any, what: str, base: Path, hint: str) -> ExecSpec:
    if not isinstance(spec, dict) or not spec.get("command"):
        raise ConfigError(f"{what}: exec.command is missing", hint=hint)
    api_version = str(spec.get("apiVersion") or "")
    if api_version not in EXEC_API_VERSIONS:
        raise ConfigError(
            f"{what}: exec.apiVersion {api_version!r} is not one of {', '.join(EXEC_API_VERSIONS)}", hint=hint
        )
    if spec.get("interactiveMode") == "Always":
        raise ConfigError(
            f"{what}: exec.interactiveMode Always needs a terminal, and CI has none",
            hint="use a non-interactive login for CI (a service principal or workload identity)",
        )
    command = str(spec["command"])
    found: str | None
    if "/" in command:  # kubectl: a relative path is relative to the kubeconfig's folder
        found = str(base / command) if not Path(command).is_absolute() else command
        found = found if os.access(found, os.X_OK) else None
    else:
        found = shutil.which(command)
    if not found:
        install = " ".join(str(spec.get("installHint") or "").split())[:200]
        raise EnvError(
            f"{what}: exec plugin {command!r} is not installed here (not on PATH)",
            hint=install or "install it on the machine that runs the canary",
        )
    env = {str(e.get("name")): str(e.get("value", "")) for e in spec.get("env") or [] if isinstance(e, dict)}
    return ExecSpec(
        Path(found),
        tuple(str(a) for a in spec.get("args") or []),
        env,
        api_version,
        bool(spec.get("provideClusterInfo")),
    )


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
            _cert_and_key(cert, key, f"{self.what}: exec plugin {name}'s answer", "check the plugin")
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
