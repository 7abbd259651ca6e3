"""The kubeconfig a command was given: checked field by field before the first request.

`select()` reads the file(s) the way kubectl does (KUBECONFIG may list several; the first of each name
wins), picks the context and checks what it names: each mistake is one line naming the field, a
`ConfigError` (exit 4) for what the file says, an `EnvError` (exit 6) for what the file points at that
did not work (a plugin not installed, or one that ran and failed). What comes back is a one-context
kubeconfig with absolute paths and, for an exec user, the plugin replaced by the token it answered;
the token sources that keep it fresh (`ExecToken`, `FileToken`) are in `credentials`.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import os
import shutil
import ssl
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from pytest_gpucanary.credentials import ExecSpec, ExecToken, FileToken, cert_and_key, token_expiry
from pytest_gpucanary.errors import ConfigError, EnvError

EXEC_API_VERSIONS = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1")
# auth-provider plugins the Python client still runs; kubectl removed gcp and azure in 1.26
AUTH_PROVIDERS = ("oidc",)


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
        cert_and_key(cert, key, what, hint)
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
