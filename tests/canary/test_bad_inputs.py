"""Every bad input is refused before the cluster is touched: one line, once, the right exit code, no
traceback, and not one request to the apiserver under the canary's user agent (from the audit log).

4 is the caller's input, 6 the environment. Each case runs the real `gpucanary` command against the
session's fleet, so a refusal that came too late would show up as requests in the log.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from testbed.audit import read_log
from testbed.audit_run import CANARY_USER_AGENT, fence
from pytest_gpucanary.shipped import FIXTURES
from harness import KEEP_FLEET, TARGET, gpucanary, session_fleet_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GOOD = [f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}", f"--gpucanary-driver-version={TARGET}"]
INVENTORY = FIXTURES / "sweep" / "inventory.yaml"


def files(tmp: Path) -> dict[str, Path]:
    """Bad files, each wrong in one way."""
    made = {
        "not-yaml.yaml": "apiVersion: nvidia.com/v1\nkind: ClusterPolicy\nspec:\n  driver: [unclosed\n",
        "duplicate.yaml": (FIXTURES / "policies" / "default.yaml").read_text() + "kind: ClusterPolicy\n",
        "no-auto.yaml": "driver:\n  upgradePolicy:\n    autoUpgrade: false\n",
        "configmap.yaml": "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n",
        "job-without-template.yaml": "apiVersion: batch/v1\nkind: Job\nmetadata: {name: x}\nspec: {}\n",
        "broken.py": "from locust import HttpUser\ndef (:\n",
        "a-file": "",
        "kubeconfig-list": "[1, 2]\n",
        "kubeconfig-unreachable": ("apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: "
                                   "'https://127.0.0.1:9'}\nusers:\n- name: u\n  user: {token: x}\ncontexts:\n- name: c\n"
                                   "  context: {cluster: c, user: u}\ncurrent-context: c\n"),
        "inventory-nan.yaml": INVENTORY.read_text().replace("restore_s: 63 ", "restore_s: .nan "),
        **{f"kubeconfig-{name}": yaml.safe_dump(_kubeconfig(*mistake)) for name, mistake in KUBECONFIG_MISTAKES.items()},
    }
    paths = {name: tmp / name for name in made}
    for name, text in made.items():
        paths[name].write_text(text)
    for name, data in {"binary": os.urandom(400) + b"\xff\xfe", "non-utf8.yaml": b"\xff\xfe\x00driver: x\n"}.items():
        paths[name] = tmp / name
        paths[name].write_bytes(data)
    return paths


# kubeconfig mistakes, each with its exit code: 4 for what the file says, 6 for what it points at
KUBECONFIG_MISTAKES = {
    "server-not-a-url": ({"server": "gpu.example:6443"}, 4),
    "ca-not-a-certificate": ({"certificate-authority-data": "aGVsbG8="}, 4),
    "context-unknown": ({"context": "production"}, 4),
    "plugin-not-installed": ({"user": {"exec": {"apiVersion": "client.authentication.k8s.io/v1",
                                                "command": "aws-not-installed", "args": ["eks", "get-token"]}}}, 6),
    "plugin-fails": ({"user": {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "sh",
                                        "args": ["-c", "echo 'error: the SSO session has expired' >&2; exit 1"]}}}, 6),
}


def _kubeconfig(change: dict, code: int) -> dict:
    cluster = {"server": change.get("server", "https://127.0.0.1:9")}
    if "certificate-authority-data" in change:
        cluster["certificate-authority-data"] = change["certificate-authority-data"]
    return {"apiVersion": "v1", "kind": "Config", "current-context": change.get("context", "c"),
            "clusters": [{"name": "c", "cluster": cluster}], "users": [{"name": "u", "user": change.get("user", {"token": "x"})}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}


def kubeconfig_cases(f: dict[str, Path]) -> list[tuple[str, list[str], int, dict[str, str]]]:
    """Each kubeconfig mistake through every command that takes a kubeconfig."""
    policy = str(FIXTURES / "policies" / "default.yaml")
    made = []
    for name, (_, code) in KUBECONFIG_MISTAKES.items():
        path = str(f[f"kubeconfig-{name}"])
        made += [(f"run-kubeconfig-{name}", ["run", *GOOD, f"--gpucanary-kubeconfig={path}"], code, {}),
                 (f"preflight-kubeconfig-{name}", ["preflight", *GOOD, f"--gpucanary-kubeconfig={path}"], code, {}),
                 (f"cleanup-kubeconfig-{name}", ["cleanup", "--kubeconfig", path], code, {}),
                 (f"gate-kubeconfig-{name}", ["gate", "--base", policy, "--head", policy, GOOD[1],
                                              f"--gpucanary-kubeconfig={path}"], code, {})]
    return made


def cases(f: dict[str, Path]) -> list[tuple[str, list[str], int, dict[str, str]]]:
    """(id, arguments, exit code, extra environment)."""
    run = [("run", *GOOD)]
    return [*kubeconfig_cases(f),
        ("run-no-policy", ["run", f"--gpucanary-driver-version={TARGET}"], 4, {}),
        ("run-no-version", ["run", GOOD[0]], 4, {}),
        ("run-missing-policy", ["run", "--gpucanary-policy=/nonexistent.yaml", GOOD[1]], 4, {}),
        ("run-policy-not-yaml", ["run", f"--gpucanary-policy={f['not-yaml.yaml']}", GOOD[1]], 4, {}),
        ("run-policy-duplicate-key", ["run", f"--gpucanary-policy={f['duplicate.yaml']}", GOOD[1]], 4, {}),
        ("run-policy-not-utf8", ["run", f"--gpucanary-policy={f['non-utf8.yaml']}", GOOD[1]], 4, {}),
        ("run-policy-binary", ["run", f"--gpucanary-policy={f['binary']}", GOOD[1]], 4, {}),
        ("run-auto-upgrade-off", ["run", f"--gpucanary-policy={f['no-auto.yaml']}", GOOD[1]], 4, {}),
        ("run-version-not-a-tag", ["run", GOOD[0], "--gpucanary-driver-version=latest!!"], 4, {}),
        *[(f"run-{name}", [*run[0], arg], 4, {}) for name, arg in [
            ("run-id-slash", "--gpucanary-run-id=a/b"), ("run-id-upper", "--gpucanary-run-id=ABC"),
            ("run-id-long", "--gpucanary-run-id=" + "a" * 50), ("probe-interval-nan", "--gpucanary-probe-interval-s=nan"),
            ("budget-inf", "--gpucanary-upgrade-budget-s=inf"), ("baseline-zero", "--gpucanary-baseline-s=0"),
            ("error-ratio-over-1", "--gpucanary-max-error-ratio=1.5"), ("error-ratio-nan", "--gpucanary-max-error-ratio=nan"),
            ("p99-negative", "--gpucanary-max-p99-s=-1"), ("pool-size-0", "--gpucanary-pool-size=0"),
            ("pool-size-word", "--gpucanary-pool-size=two"), ("load-users-negative", "--gpucanary-load-users=-1"),
            ("min-phase-requests-0", "--gpucanary-min-phase-requests=0"),
            ("evictions-unparseable", "--gpucanary-allowed-evictions=app in a"),
            ("pool-selector-unparseable", "--gpucanary-pool-selector==x"), ("pool-provider-unknown",
                                                                           "--gpucanary-pool-provider=cloud"),
            ("service-url-malformed", "--gpucanary-service-url=htp:/x"),
            ("prometheus-url-bad-port", "--gpucanary-prometheus-url=http://h:port"),
            ("gpu-job-missing", "--gpucanary-gpu-job=/nonexistent.yaml"),
            ("collective-probe-missing", "--gpucanary-collective-probe=/nonexistent.yaml"),
            ("collective-probe-no-pod", f"--gpucanary-collective-probe={f['configmap.yaml']}"),
            ("busbw-ratio-over-1", "--gpucanary-min-busbw-ratio=1.5"),
            ("gpu-job-no-job", f"--gpucanary-gpu-job={f['configmap.yaml']}"),
            ("service-not-yaml", f"--gpucanary-service={f['not-yaml.yaml']}"),
            ("probe-without-template", f"--gpucanary-probe={f['job-without-template.yaml']}"),
            ("locustfile-missing", "--gpucanary-locustfile=/nonexistent.py"),
            ("locustfile-syntax", f"--gpucanary-locustfile={f['broken.py']}"),
            ("reports-dir-is-a-file", f"--gpucanary-reports-dir={f['a-file']}"),
            ("kubeconfig-binary", f"--gpucanary-kubeconfig={f['binary']}"),
            ("kubeconfig-not-utf8", f"--gpucanary-kubeconfig={f['non-utf8.yaml']}"),
            ("kubeconfig-a-list", f"--gpucanary-kubeconfig={f['kubeconfig-list']}"),
            ("kubeconfig-missing", "--gpucanary-kubeconfig=/nonexistent-kubeconfig")]],
        ("run-env-negative", list(run[0]), 4, {"GPUCANARY_PROBE_INTERVAL_S": "-1"}),
        ("run-kubeconfig-unreachable", [*run[0], f"--gpucanary-kubeconfig={f['kubeconfig-unreachable']}"], 6, {}),
        ("lint-missing", ["lint", "/nonexistent.yaml"], 4, {}),
        ("lint-not-yaml", ["lint", str(f["not-yaml.yaml"])], 4, {}),
        ("lint-duplicate-key", ["lint", str(f["duplicate.yaml"])], 4, {}),
        ("lint-against-missing", ["lint", str(FIXTURES / "policies" / "default.yaml"), "--against", "/nonexistent"],
         4, {}),
        ("plan-sweep-no-inventory", ["plan-sweep", "--change", f"driver={TARGET}"], 4, {}),
        ("plan-sweep-nan-restore", ["plan-sweep", "--inventory", str(f["inventory-nan.yaml"])], 4, {}),
        ("plan-sweep-unavailable-150", ["plan-sweep", "--inventory", str(INVENTORY), "--max-unavailable", "150%"], 4,
         {}),
        ("plan-sweep-not-utf8", ["plan-sweep", "--inventory", str(f["non-utf8.yaml"])], 4, {}),
        ("plan-sweep-parallel-word", ["plan-sweep", "--inventory", str(INVENTORY), "--max-parallel", "x"], 4, {}),
        ("cleanup-kubeconfig-binary", ["cleanup", "--kubeconfig", str(f["binary"])], 4, {}),
        ("cleanup-kubeconfig-not-utf8", ["cleanup", "--kubeconfig", str(f["non-utf8.yaml"])], 4, {}),
        ("cleanup-run-id-slash", ["cleanup", "--run-id", "a/b"], 4, {}),
        ("fleet-up-zero-nodes", ["fleet", "up", "--gpu-nodes", "0"], 4, {}),
        ("fleet-up-too-many-nodes", ["fleet", "up", "--gpu-nodes", "100000"], 4, {}),
        ("fleet-status-port-base-word", ["fleet", "status"], 4, {"GPUCANARY_FLEET_PORT_BASE": "abc"}),
    ]


def error_lines(output: str) -> list[str]:
    """The lines that say what went wrong (the CLI's, pytest's usage error, or the session's stop)."""
    return [line for line in output.splitlines() if "gpucanary: " in line]


def test_every_bad_input_is_one_line_the_right_code_and_no_request(gpucanary_fleet, tmp_path: Path) -> None:
    table = cases(files(tmp_path))
    assert len(table) >= 40
    env = {**KEEP_FLEET, **session_fleet_env(gpucanary_fleet)}
    windows, problems = [], []
    for name, args, code, extra in table:
        reports = ["--gpucanary-reports-dir=" + str(tmp_path / "reports")] if args[0] == "run" and not any(
            a.startswith("--gpucanary-reports-dir") for a in args) else []
        since = time.time()
        done = gpucanary(*args, *reports, env={**env, **extra}, unbuffered=False, timeout_s=120)
        windows.append((name, since, time.time()))
        output = done.stdout + done.stderr
        lines = error_lines(output)
        if done.returncode != code or len(lines) != 1 or "Traceback" in output:
            problems.append(f"{name}: exit {done.returncode} (want {code}), {len(lines)} error lines: "
                            f"{lines[:3] or output[-400:]}")
    assert not problems, "\n".join(problems)
    fence(gpucanary_fleet.fleet)
    records = read_log(gpucanary_fleet.fleet.layout.audit_log, user_agent_prefix=CANARY_USER_AGENT,
                       since_s=windows[0][1], until_s=windows[-1][2])
    touched = sorted({name for name, since, until in windows for r in records
                      if since <= r.received_s <= until})
    assert not touched, f"requests made by refused inputs: {touched}"


def test_a_server_certificate_or_token_the_other_side_refuses_is_one_line_naming_it(
        gpucanary_fleet, tmp_path: Path) -> None:
    """Found on the first request: exit 6, and words that point at the field, not at the network."""
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-keyout", "other-ca.key", "-out", "other-ca.crt", "-days", "1", "-subj", "/CN=another-ca"],
                   cwd=tmp_path, check=True, capture_output=True)
    config = yaml.safe_load(gpucanary_fleet.fleet.kubeconfig.read_text())
    wrong_ca, bad_token = yaml.safe_load(yaml.safe_dump(config)), yaml.safe_load(yaml.safe_dump(config))
    wrong_ca["clusters"][0]["cluster"]["certificate-authority"] = str(tmp_path / "other-ca.crt")
    bad_token["users"][0]["user"] = {"token": "not-a-token-this-cluster-issued"}
    want = {"wrong-ca": "certificate verify failed; check certificate-authority (and tls-server-name) of cluster",
            "bad-token": "refused the credentials of user 'gpucanary-admin' (401 Unauthorized)"}
    problems = []
    for name, doc in (("wrong-ca", wrong_ca), ("bad-token", bad_token)):
        path = tmp_path / f"{name}.kubeconfig"
        path.write_text(yaml.safe_dump(doc))
        for args in (["preflight", *GOOD, f"--gpucanary-kubeconfig={path}"], ["cleanup", "--kubeconfig", str(path)]):
            done = gpucanary(*args, unbuffered=False, timeout_s=120)
            lines = error_lines(done.stdout + done.stderr)
            if done.returncode != 6 or len(lines) != 1 or want[name] not in lines[0]:
                problems.append(f"{name} {args[0]}: exit {done.returncode}: {lines or done.stderr[-400:]}")
    assert not problems, "\n".join(problems)
