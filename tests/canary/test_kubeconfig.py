"""The kubeconfig check: each mistake is one line naming the field, exit 4 for what the file says and 6 for
what it points at that did not work; an exec plugin's token is asked for again before it gets old and
after a 401."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml

from pytest_gpucanary.credentials import ExecToken, redact
from pytest_gpucanary.errors import ConfigError, EnvError
from pytest_gpucanary.kubeconfig import select


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA, a client certificate with its key, and a second key that does not belong to it."""
    d = tmp_path_factory.mktemp("pki")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "ca.key",
            "-out", "ca.crt", "-days", "1", "-subj", "/CN=test-ca")
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "client.key",
            "-out", "client.csr", "-subj", "/CN=canary")
    openssl("x509", "-req", "-in", "client.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "client.crt", "-days", "1")
    openssl("genpkey", "-algorithm", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", "other.key")
    return {name: d / name for name in ("ca.crt", "client.crt", "client.key", "other.key")}


def kubeconfig(tmp_path: Path, *, cluster: dict | None = None, user: dict | None = None,
               context: dict | None = None, current: str = "canary") -> Path:
    doc = {"apiVersion": "v1", "kind": "Config", "current-context": current,
           "clusters": [{"name": "gpu", "cluster": {"server": "https://gpu.example:6443", **(cluster or {})}}],
           "users": [{"name": "ci", "user": user if user is not None else {"token": "abc"}}],
           "contexts": [{"name": "canary", "context": context or {"cluster": "gpu", "user": "ci"}}]}
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(doc))
    return path


def plugin(tmp_path: Path, body: str) -> str:
    """An exec credential plugin: a Python script with `body`, returning its path."""
    path = tmp_path / "credential-plugin"
    path.write_text(f"#!{sys.executable}\nimport json, os, sys\n{body}\n")
    path.chmod(0o755)
    return str(path)


def credential(token: str = "tok-1", *, expires_in_s: float | None = 900, api: str = "v1") -> str:
    status: dict = {"token": token}
    if expires_in_s is not None:
        status["expirationTimestamp"] = (datetime.now(timezone.utc) + timedelta(seconds=expires_in_s)).isoformat()
    return json.dumps({"apiVersion": f"client.authentication.k8s.io/{api}", "kind": "ExecCredential",
                       "status": status})


def exec_user(command: str, **extra: object) -> dict:
    return {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": command, **extra}}


def refused(path: Path | str | None, error: type = ConfigError, *, context: str | None = None) -> str:
    with pytest.raises(error) as caught:
        select(path, context=context, option="--kubeconfig", context_option="--context")
    line = str(caught.value)
    assert "\n" not in line and type(caught.value) is error
    return line


def test_a_good_kubeconfig_becomes_one_context_with_absolute_paths(tmp_path: Path, pki: dict[str, Path]) -> None:
    (tmp_path / "certs").mkdir()
    for name in ("ca.crt", "client.crt", "client.key"):
        (tmp_path / "certs" / name).write_bytes(pki[name].read_bytes())
    path = kubeconfig(tmp_path, cluster={"certificate-authority": "certs/ca.crt"},
                      user={"client-certificate": "certs/client.crt", "client-key": "certs/client.key"})
    selected = select(path, context=None, option="--kubeconfig")
    assert (selected.context, selected.cluster_name, selected.user_name) == ("canary", "gpu", "ci")
    cluster = selected.config["clusters"][0]["cluster"]
    assert cluster["certificate-authority"] == str(tmp_path / "certs" / "ca.crt")
    assert selected.config["users"][0]["user"]["client-key"] == str(tmp_path / "certs" / "client.key")


def test_kubeconfig_lists_merge_the_kubectl_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = kubeconfig(tmp_path)
    second = tmp_path / "second"
    second.write_text(yaml.safe_dump({"contexts": [{"name": "other", "context": {"cluster": "gpu", "user": "ci"}}],
                                      "current-context": "other"}))
    monkeypatch.setenv("KUBECONFIG", f"{tmp_path / 'missing'}:{first}:{second}")
    assert select(None, context=None, option="--kubeconfig").context == "canary"     # the first current-context
    assert select(None, context="other", option="--kubeconfig").server == "https://gpu.example:6443"


@pytest.mark.parametrize("change, words", [
    ({"context": "prod"}, "context 'prod' not found; pass --context with one of: canary"),
    ({"current": ""}, "no current-context is set; pass --context (contexts: canary)"),
    ({"ctx": {"cluster": "elsewhere", "user": "ci"}}, "context 'canary': cluster 'elsewhere' not found"),
    ({"ctx": {"cluster": "gpu", "user": "nobody"}}, "context 'canary': user 'nobody' not found"),
    ({"cluster": {"server": ""}}, "cluster 'gpu': server is missing"),
    ({"cluster": {"server": "gpu.example:6443"}}, "cluster 'gpu': server 'gpu.example:6443' is not an https:// URL"),
    ({"cluster": {"server": "http://10.0.0.1:8080"}}, "is plain http to another host"),
    ({"cluster": {"certificate-authority": "/nonexistent/ca.crt"}}, "certificate-authority /nonexistent/ca.crt: "
                                                                    "no such file"),
    ({"cluster": {"certificate-authority-data": "not base64!"}}, "certificate-authority-data is not base64"),
    ({"cluster": {"certificate-authority-data": base64.b64encode(b"hello").decode()}},
     "certificate-authority is not a PEM certificate"),
    ({"cluster": {"proxy-url": "corp-proxy:3128"}}, "proxy-url 'corp-proxy:3128' is not"),
    ({"user": {"tokenFile": "/nonexistent/token"}}, "user 'ci': tokenFile /nonexistent/token: no such file"),
    ({"user": {"auth-provider": {"name": "gcp"}}}, "auth-provider 'gcp' is not supported"),
    ({"user": {"exec": {"command": "aws"}}}, "exec.apiVersion '' is not one of"),
    ({"user": {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "x",
                        "interactiveMode": "Always"}}}, "interactiveMode Always needs a terminal"),
])
def test_each_mistake_in_the_file_is_one_line_naming_the_field(tmp_path: Path, change: dict, words: str) -> None:
    path = kubeconfig(tmp_path, cluster=change.get("cluster"), user=change.get("user"), context=change.get("ctx"),
                      current=change.get("current", "canary"))
    line = refused(path, context=change.get("context"))
    assert words in line and str(path) in line, line


def test_files_that_are_no_kubeconfig(tmp_path: Path) -> None:
    assert "no such file" in refused(tmp_path / "absent")
    (tmp_path / "list").write_text("[1, 2]\n")
    assert "not a kubeconfig (a YAML list)" in refused(tmp_path / "list")
    (tmp_path / "broken").write_text("clusters: [\n")
    assert "not YAML at line" in refused(tmp_path / "broken")


def test_certificates_that_do_not_fit(tmp_path: Path, pki: dict[str, Path]) -> None:
    path = kubeconfig(tmp_path, user={"client-certificate": str(pki["client.crt"]), "client-key": str(pki["other.key"])})
    assert "client-certificate and client-key do not belong together" in refused(path)
    path = kubeconfig(tmp_path, user={"client-certificate": str(pki["client.crt"])})
    assert "client-certificate without client-key" in refused(path)
    path = kubeconfig(tmp_path, cluster={"certificate-authority": str(pki["ca.crt"]), "insecure-skip-tls-verify": True})
    assert "together with insecure-skip-tls-verify" in refused(path)


def test_an_exec_plugin_that_is_not_installed_is_the_environment(tmp_path: Path) -> None:
    path = kubeconfig(tmp_path, user=exec_user("aws-iam-authenticator-not-here", installHint="brew install it"))
    line = refused(path, EnvError)
    assert "exec plugin 'aws-iam-authenticator-not-here' is not installed here (not on PATH); brew install it" in line


@pytest.mark.parametrize("body, words", [
    ("sys.stderr.write('error: SSO session expired, token=eyJhbGciOi.eyJzdWIi.c2ln\\n'); sys.exit(3)",
     "exited 3: error: SSO session expired, [redacted]"),
    ("print('hello')", "answered no valid ExecCredential: not JSON"),
    ("print(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1', 'kind': 'ExecCredential', 'status': {}}))",
     "status has neither token nor clientCertificateData"),
    (f"print({credential(api='v1beta1')!r})", "apiVersion 'client.authentication.k8s.io/v1beta1', asked for"),
])
def test_a_plugin_that_ran_and_failed_is_the_environment_with_its_words(tmp_path: Path, body: str, words: str) -> None:
    path = kubeconfig(tmp_path, user=exec_user(plugin(tmp_path, body)))
    line = refused(path, EnvError)
    assert words in line and "eyJ" not in line, line


def test_a_plugin_is_given_its_env_and_the_exec_info_and_its_token_replaces_it(tmp_path: Path) -> None:
    seen = tmp_path / "seen.json"
    command = plugin(tmp_path, f"open({str(seen)!r}, 'w').write(json.dumps([os.environ['REGION'], "
                               f"json.loads(os.environ['KUBERNETES_EXEC_INFO'])]))\nprint({credential()!r})")
    path = kubeconfig(tmp_path, user=exec_user(command, env=[{"name": "REGION", "value": "eu-1"}],
                                               provideClusterInfo=True))
    selected = select(path, context=None, option="--kubeconfig")
    assert selected.config["users"][0]["user"] == {"token": "tok-1"}
    region, info = json.loads(seen.read_text())
    assert region == "eu-1" and info["spec"]["interactive"] is False
    assert info["spec"]["cluster"]["server"] == "https://gpu.example:6443"


class Plugin:
    """A stand-in for subprocess.run that answers numbered tokens with a given lifetime."""

    def __init__(self, lifetime_s: float) -> None:
        self.lifetime_s, self.calls = lifetime_s, 0

    def __call__(self, *args: object, **kwargs: object) -> subprocess.CompletedProcess:
        self.calls += 1
        return subprocess.CompletedProcess([], 0, credential(f"tok-{self.calls}", expires_in_s=self.lifetime_s), "")


def test_the_token_is_asked_for_again_once_three_quarters_of_its_life_are_gone(tmp_path: Path) -> None:
    from pytest_gpucanary.credentials import ExecSpec

    spec = ExecSpec(Path("/bin/true"), (), {}, "client.authentication.k8s.io/v1", False)
    answering = Plugin(lifetime_s=3600)
    token = ExecToken(spec, "user 'ci'", {}, run=answering)
    assert token.bearer() == token.bearer() == "Bearer tok-1" and answering.calls == 1
    assert token.bearer(force=True) == "Bearer tok-2"          # after a 401
    short = Plugin(lifetime_s=0)                               # no life at all: every use asks again
    token = ExecToken(spec, "user 'ci'", {}, run=short)
    assert [token.bearer() for _ in range(3)] == ["Bearer tok-1", "Bearer tok-2", "Bearer tok-3"]


def test_redact_keeps_the_words_and_drops_the_secrets() -> None:
    text = 'failed: Bearer abc.def token="s3cr3t" password: hunter2 jwt eyJhbGciOiJ.eyJzdWIiOi.sig done'
    assert redact(text) == "failed: [redacted] [redacted] [redacted] jwt [redacted] done"


def test_a_401_asks_the_plugin_once_more_and_retries_once() -> None:
    from kubernetes.client.exceptions import ApiException

    from pytest_gpucanary.credentials import ExecSpec
    from pytest_gpucanary.kube import Kube
    from pytest_gpucanary.kube.errors import Unauthorized

    token = ExecToken(ExecSpec(Path("/bin/true"), (), {}, "client.authentication.k8s.io/v1", False), "user 'ci'", {},
                      run=Plugin(lifetime_s=3600))
    kube = Kube(dynamic=None, token_source=token)
    sent: list[str] = []

    def revoked_once(**kwargs: object) -> str:
        sent.append(token.bearer())
        if len(sent) == 1:
            raise ApiException(status=401, reason="Unauthorized")
        return "answer"

    assert kube._call("get Node", revoked_once) == "answer" and sent == ["Bearer tok-1", "Bearer tok-2"]

    def never(**kwargs: object) -> str:
        raise ApiException(status=401, reason="Unauthorized")

    with pytest.raises(Unauthorized, match="get Node: 401"):
        kube._call("get Node", never)


def _jwt(exp: datetime) -> str:
    def part(doc: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(doc).encode()).decode().rstrip("=")
    return f"{part({'alg': 'RS256'})}.{part({'exp': int(exp.timestamp()), 'sub': 'system:serviceaccount:x:y'})}.sig"


def test_a_static_token_that_ends_before_a_run_could_is_a_preflight_problem(tmp_path: Path) -> None:
    from pytest_gpucanary.canary.preflight import token_life_problem
    from pytest_gpucanary.config import Settings
    from pytest_gpucanary.kube import Kube

    longest_s = Settings().longest_run_s()
    assert longest_s == 600 + 30 + 2 * 1200 + 600                        # the defaults: about 60 min
    soon = datetime.now(timezone.utc) + timedelta(minutes=30, seconds=30)
    selected = select(kubeconfig(tmp_path, user={"token": _jwt(soon)}), context=None, option="--kubeconfig")
    assert abs((selected.static_token_expiry() - soon).total_seconds()) < 1
    problem = token_life_problem(Kube(None, token_expires=selected.static_token_expiry()), longest_s)
    assert problem.startswith("the kubeconfig's token expires in 30 min, before a run with these options may end "
                              "(up to 61 min)"), problem
    later = datetime.now(timezone.utc) + timedelta(hours=2)
    assert token_life_problem(Kube(None, token_expires=later), longest_s) == ""
    assert select(kubeconfig(tmp_path, user={"token": "opaque"}), context=None,
                  option="--kubeconfig").static_token_expiry() is None


def test_a_token_file_is_read_again_after_a_401_and_each_minute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_gpucanary.credentials import FileToken

    (tmp_path / "token").write_text("first\n")
    selected = select(kubeconfig(tmp_path, user={"tokenFile": "token"}), context=None, option="--kubeconfig")
    source = selected.token_source
    assert isinstance(source, FileToken) and selected.config["users"][0]["user"] == {"token": "first"}
    assert source.bearer() == "Bearer first"
    (tmp_path / "token").write_text("rotated\n")            # the kubelet rotated the projected token
    assert source.bearer() == "Bearer first"                 # within the minute: the cached one
    source.renew()                                           # a 401
    assert source.bearer() == "Bearer rotated"
    (tmp_path / "token").write_text("")                      # caught mid-rotation
    monkeypatch.setattr(FileToken, "REREAD_S", 0)
    assert source.bearer() == "Bearer rotated"
    (tmp_path / "empty").write_text("\n")
    assert "tokenFile" in refused(kubeconfig(tmp_path, user={"tokenFile": "empty"}))
