"""A whole gate, then `cleanup` and `preflight`, through an exec-plugin kubeconfig whose tokens the apiserver
stops accepting after TOKEN_LIFE_S, as real clusters hand them out (aws eks get-token, kubelogin).

The plugin mints a ServiceAccount token bound to a Secret of its own; a reaper deletes each Secret
TOKEN_LIFE_S after it was made, and from then on the apiserver answers 401 to that token. The plugin
says the token lives STATED_LIFE_S, longer than it does (as a revoked token would), so the canary both
asks for a new one at three quarters of the stated life and meets 401s in between, which it must
answer by asking again once. The ServiceAccount holds exactly deploy/'s rules.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml

from testbed.audit import read_log
from testbed.audit_run import CANARY_USER_AGENT, fence
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.errors import NotFound
from pytest_gpucanary.shipped import FIXTURES
from harness import TARGET, gpucanary

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TOKEN_LIFE_S = 60        # the apiserver accepts a token this long
STATED_LIFE_S = 120      # what the plugin says: the canary asks again after 90 s, so 401s come first
HOLDER_LABEL = "gpucanary-tests/exec-token"
RUN = [f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}", f"--gpucanary-driver-version={TARGET}",
       "--gpucanary-pool-provider=kwok", "--gpucanary-probe-interval-s=10", "--gpucanary-upgrade-budget-s=420",
       "--gpucanary-max-p99-s=3", "--gpucanary-baseline-s=10", "--gpucanary-job-duration-s=180",
       "--gpucanary-load-users=4"]

PLUGIN = """#!{python}
import json, os, sys, uuid
from datetime import datetime, timedelta, timezone
from kubernetes import client, config

core = client.CoreV1Api(config.new_client_from_config(os.environ["ADMIN_KUBECONFIG"]))
name = "exec-token-" + uuid.uuid4().hex[:10]
holder = core.create_namespaced_secret("gpucanary", {{"metadata": {{"name": name, "labels": {{"{label}": "1"}}}}}})
token = core.create_namespaced_service_account_token(os.environ["ACCOUNT"], "gpucanary", {{"spec": {{
    "expirationSeconds": 600, "boundObjectRef": {{"apiVersion": "v1", "kind": "Secret", "name": name,
                                                 "uid": holder.metadata.uid}}}}}}).status.token
with open(os.environ["MINTED"], "a") as minted:
    minted.write(token + "\\n")
expires = datetime.now(timezone.utc) + timedelta(seconds={stated})
print(json.dumps({{"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
                  "status": {{"token": token, "expirationTimestamp": expires.strftime("%Y-%m-%dT%H:%M:%SZ")}}}}))
"""


def _reap(kube: Kube, stop: threading.Event) -> None:
    """Delete each token's Secret TOKEN_LIFE_S after it was made: the apiserver then refuses the token."""
    while not stop.wait(2):
        now = datetime.now(timezone.utc)
        for secret in kube.list("v1", "Secret", namespace="gpucanary", label_selector=f"{HOLDER_LABEL}=1"):
            made = datetime.fromisoformat(secret["metadata"]["creationTimestamp"].replace("Z", "+00:00"))
            if (now - made).total_seconds() >= TOKEN_LIFE_S:
                try:
                    kube.delete("v1", "Secret", secret["metadata"]["name"], namespace="gpucanary")
                except NotFound:
                    pass


def _refused(gpucanary_fleet, token: str) -> bool:
    """Whether the apiserver answers 401 to `token` (any request)."""
    import ssl
    import urllib.error
    import urllib.request

    config = yaml.safe_load(gpucanary_fleet.fleet.kubeconfig.read_text())
    cluster = config["clusters"][0]["cluster"]
    context = ssl.create_default_context(cafile=cluster.get("certificate-authority"))
    request = urllib.request.Request(cluster["server"] + "/api", headers={"Authorization": f"Bearer {token}"})
    try:
        urllib.request.urlopen(request, context=context, timeout=10)
    except urllib.error.HTTPError as err:
        return err.code == 401
    return False


def test_a_gate_cleanup_and_preflight_outlive_tokens_that_die_after_a_minute(
        canary_service_account, gpucanary_fleet, kube: Kube, tmp_path: Path) -> None:
    account = "gpucanary-exec"
    canary_service_account(account)                     # the ServiceAccount under deploy/'s rules
    fleet = gpucanary_fleet.fleet
    plugin = tmp_path / "mint-token"
    plugin.write_text(PLUGIN.format(python=sys.executable, label=HOLDER_LABEL, stated=STATED_LIFE_S))
    plugin.chmod(0o755)
    minted = tmp_path / "minted"
    config = yaml.safe_load(fleet.kubeconfig.read_text())
    config["users"] = [{"name": account, "user": {"exec": {
        "apiVersion": "client.authentication.k8s.io/v1", "command": str(plugin), "interactiveMode": "Never",
        "env": [{"name": "ADMIN_KUBECONFIG", "value": str(fleet.kubeconfig)}, {"name": "ACCOUNT", "value": account},
                {"name": "MINTED", "value": str(minted)}]}}}]
    config["contexts"][0]["context"]["user"] = account
    kubeconfig = tmp_path / "exec.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    options = [f"--gpucanary-kubeconfig={kubeconfig}", *RUN, f"--gpucanary-prometheus-url={fleet.prometheus_url}",
               f"--gpucanary-service-url={fleet.service_url('gpucanary-exec-token', 'sched-api')}"]

    stop = threading.Event()
    reaper = threading.Thread(target=_reap, args=(kube, stop), daemon=True)
    reaper.start()
    since = time.time()
    try:
        run = gpucanary("run", *options, "--gpucanary-run-id=exec-token", f"--gpucanary-reports-dir={tmp_path}",
                        env=env, timeout_s=900)
        run_s = time.time() - since
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
        assert "gate PASSED" in run.stdout
        cleaned = gpucanary("cleanup", "--kubeconfig", str(kubeconfig), "--run-id", "exec-token", env=env,
                            timeout_s=300)
        assert cleaned.returncode == 0, cleaned.stdout + cleaned.stderr
        checked = gpucanary("preflight", *options, env=env, timeout_s=120)
        assert checked.returncode == 0, checked.stdout + checked.stderr
    finally:
        stop.set()
        reaper.join(10)

    tokens = minted.read_text().split()
    assert len(tokens) >= run_s / STATED_LIFE_S, f"{len(tokens)} tokens over a {run_s:.0f} s run"
    assert len(tokens) < 4 * run_s / TOKEN_LIFE_S + 10, f"{len(tokens)} tokens: the plugin ran per request"
    assert _refused(gpucanary_fleet, tokens[0]), "the first token still works: nothing here expired"
    fence(fleet)
    records = read_log(fleet.layout.audit_log, user_agent_prefix=CANARY_USER_AGENT, since_s=since)
    refused = [r for r in records if r.code == 401]
    assert refused, "no request met a dead token: the 401 path was not exercised"
    print(f"\nexec credentials: {len(tokens)} tokens over a {run_s:.0f} s gate, {len(refused)} requests answered "
          f"401 and retried with a fresh one")
