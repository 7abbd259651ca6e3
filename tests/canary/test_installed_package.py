"""The gate as installed, not as checked out: the wheelhouse of ci/wheelhouse.sh (the package's wheel and
every dependency's) installed with no index, as the CI templates install from a wheel directory, into a
fresh venv and with `pip install --user` into a throwaway HOME. The canaries, fixtures and the gate's own
pytest configuration are found through the installed distribution: collection from a directory holding a
hostile pytest.ini and conftest.py (no fleet needed), and `gpucanary preflight` then a whole `gpucanary run`
from an empty directory as a ServiceAccount bound to exactly deploy/'s rules (so a rule the run needs and
deploy/ lacks fails it).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from harness import TARGET, fast, gpucanary

from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.errors import Conflict
from pytest_gpucanary.policy.parse import load_policy
from pytest_gpucanary.receipt.verdict import policy_digest
from pytest_gpucanary.shipped import FIXTURES, REPO_ROOT

pytestmark = [pytest.mark.e2e]    # the installs take about 30 s: the wheelhouse (from pip's cache) and two installs

REQUIREMENT = f"pytest-gpucanary=={metadata.version('pytest-gpucanary')}"
POLICY = f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}"   # the caller's own file
# the fast settings of the other whole-gate tests; fewer simulated users, as two gates share 2 cores
FAST = [*fast(), "--gpucanary-load-users=4"]


@dataclass(frozen=True)
class Installed:
    """One installation: its interpreter, its console script and the environment it is found in."""
    python: Path
    script: Path
    env: dict[str, str]

    def gpucanary(self, *args: str, cwd: Path, timeout_s: float = 900) -> subprocess.CompletedProcess[str]:
        return gpucanary(*args, program=[str(self.script)], base=self.env, unbuffered=False, cwd=cwd,
                         timeout_s=timeout_s)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PYTEST", "VIRTUAL_ENV"))}
    return {**env, **extra}


def pip_install(python: Path, wheelhouse: Path, *args: str, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-index",
                    "--find-links", str(wheelhouse), *args, REQUIREMENT], check=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheelhouse")
    subprocess.run(["bash", str(REPO_ROOT / "ci" / "wheelhouse.sh"), str(out)], check=True, timeout=600,
                   env={**os.environ, "PYTHON": sys.executable}, stdout=subprocess.DEVNULL)
    return out


@pytest.fixture(scope="module")
def venv_install(wheelhouse: Path, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    env = clean_env()
    pip_install(venv / "bin" / "python", wheelhouse, env=env)
    return Installed(venv / "bin" / "python", venv / "bin" / "gpucanary", env)


@pytest.fixture(scope="module")
def user_install(wheelhouse: Path, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    home = tmp_path_factory.mktemp("home")
    env = clean_env(HOME=str(home), PYTHONUSERBASE=str(home / ".local"))
    venv = tmp_path_factory.mktemp("system-like")   # a venv with system site packages lets --user installs through
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    pip_install(venv / "bin" / "python", wheelhouse, "--user", env=env)
    return Installed(venv / "bin" / "python", home / ".local" / "bin" / "gpucanary", env)


def hostile_directory(path: Path) -> Path:
    path.mkdir()
    (path / "pytest.ini").write_text("[pytest]\naddopts = --no-such-option\n")
    (path / "conftest.py").write_text("raise RuntimeError('the caller conftest was imported')\n")
    return path


@pytest.mark.parametrize("install", ["venv_install", "user_install"])
def test_the_installed_gate_collects_from_a_hostile_directory(install: str, request: pytest.FixtureRequest,
                                                              tmp_path: Path) -> None:
    installed: Installed = request.getfixturevalue(install)
    cwd = hostile_directory(tmp_path / "hostile")
    find = subprocess.run([str(installed.python), "-c", "from pytest_gpucanary.shipped import FIXTURES, CANARIES; "
                                                        "print(FIXTURES); print(CANARIES)"],
                          capture_output=True, text=True, cwd=cwd, env=installed.env, check=True)
    fixtures, canaries = find.stdout.split()
    assert not fixtures.startswith(str(REPO_ROOT)) and not canaries.startswith(str(REPO_ROOT)), find.stdout
    result = installed.gpucanary("run", "--collect-only", "-q", f"--gpucanary-policy={fixtures}/policies/default.yaml",
                                 f"--gpucanary-driver-version={TARGET}", cwd=cwd, timeout_s=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "5 tests collected" in result.stdout
    assert not (cwd / ".pytest_cache").exists()


def gate(installed: Installed, *options: str, run_id: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`gpucanary preflight`, which must find nothing, then `gpucanary run` with the same options."""
    preflight = installed.gpucanary("preflight", *options, cwd=cwd, timeout_s=60)
    assert preflight.returncode == 0, preflight.stdout + preflight.stderr
    assert json.loads(preflight.stdout)["problems"] == []
    return installed.gpucanary("run", *options, f"--gpucanary-run-id={run_id}", cwd=cwd)


@pytest.mark.slow
def test_each_install_passes_a_whole_gate_from_an_empty_directory_under_the_shipped_rules(
        venv_install: Installed, user_install: Installed, canary_service_account, gpucanary_fleet, kube: Kube,
        pushgateway: str, tmp_path: Path) -> None:
    kubeconfig = canary_service_account("gpucanary")
    sa = Kube.connect(kubeconfig)
    assert not sa.can_i("list", "secrets") and not sa.can_i("create", "clusterrolebindings",
                                                            group="rbac.authorization.k8s.io")
    fleet = gpucanary_fleet.fleet
    installs = {"wheel-venv": venv_install, "wheel-user": user_install}
    # both at once, each on its own pool: operator v26.7 reads each pool's policy from its own NVIDIADriver
    with ThreadPoolExecutor(len(installs)) as pool:
        futures = {}
        for run_id, installed in installs.items():
            (tmp_path / run_id).mkdir()
            futures[run_id] = pool.submit(
                gate, installed, f"--gpucanary-kubeconfig={kubeconfig}", "--gpucanary-pool-provider=kwok", POLICY,
                f"--gpucanary-driver-version={TARGET}", *FAST, f"--gpucanary-prometheus-url={fleet.prometheus_url}",
                f"--gpucanary-service-url={fleet.service_url(f'gpucanary-{run_id}', 'sched-api')}",
                f"--gpucanary-pushgateway-url={pushgateway}", run_id=run_id, cwd=tmp_path / run_id)
    for run_id, future in futures.items():
        result = future.result()
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
        lines = result.stdout.splitlines()
        section = [line.strip("= ") for line in lines].index("gpucanary launch receipt")
        summary = [line for line in lines[section + 1:] if line][:6]   # one line a stage, then the gate's
        assert [line.split()[:2] for line in summary[:5]] == [
            ["pass", "rollout:"], ["pass", "device:"], ["skipped", "network:"], ["pass", "scheduler:"],
            ["pass", "application:"]], summary
        assert f"GPU job gpucanary-{run_id}/gpu-train completed at +" in summary[4]
        assert summary[5] == f"gate PASSED; first failed stage: none; receipt: reports/{run_id}/receipt.html"
        assert (tmp_path / run_id / "reports" / run_id / "receipt.html").is_file()
        # both gates prove one key: each records its verdict unless the other finished later and did
        assert ("verdict recorded in ConfigMap gpucanary/gpucanary-verdict-" in result.stdout
                or "verdict not recorded: ConfigMap gpucanary/gpucanary-verdict-" in result.stdout), result.stdout[-3000:]
        assert "verdict pushed to the Pushgateway at http://127.0.0.1:" in result.stdout
    # what a CD pipeline asks before it widens the rollout, with the canary's own rules
    verdict_args = (f"--gpucanary-kubeconfig={kubeconfig}", POLICY, f"--gpucanary-driver-version={TARGET}")
    proceed = venv_install.gpucanary("verdict", *verdict_args, cwd=tmp_path, timeout_s=120)
    assert proceed.returncode == 0, proceed.stdout + proceed.stderr
    assert json.loads(proceed.stdout)["run_id"] in installs and proceed.stderr.startswith("gpucanary: proceed: run ")
    stale = venv_install.gpucanary("verdict", *verdict_args, "--max-age-h=0.0001", cwd=tmp_path, timeout_s=120)
    assert stale.returncode == 1 and "h old, older than 0.0001 h" in stale.stderr, stale.stderr
    digest = policy_digest(load_policy(FIXTURES / "policies" / "default.yaml").to_cr())
    with urllib.request.urlopen(f"{pushgateway}/metrics", timeout=5) as answer:
        pushed = [line for line in answer.read().decode().splitlines()
                  if line.startswith("gpucanary_verdict_passed{") and f'policy_digest="{digest}"' in line
                  and f'target="{TARGET}"' in line]
    assert len(pushed) == 1 and pushed[0].endswith(" 1"), pushed    # one group per key: the last push
    # the Argo CD PreSync hook's read-only identity is enough to read it
    reader = verdict_reader_kubeconfig(kube, gpucanary_fleet.fleet.kubeconfig, tmp_path)
    hook = venv_install.gpucanary("verdict", f"--gpucanary-kubeconfig={reader}", *verdict_args[1:], cwd=tmp_path,
                                  timeout_s=120)
    assert hook.returncode == 0 and hook.stderr.startswith("gpucanary: proceed: run "), hook.stdout + hook.stderr
    # both runs took their namespaces with them
    assert not [n["metadata"]["name"] for n in kube.list("v1", "Namespace")
                if n["metadata"]["name"].startswith(tuple(f"gpucanary-{r}" for r in installs))
                and not n["metadata"].get("deletionTimestamp")]


def verdict_reader_kubeconfig(kube: Kube, admin_kubeconfig: Path, tmp_path: Path) -> Path:
    """A kubeconfig acting as ci/templates/argocd-presync-verdict.yaml's ServiceAccount, bound to its rules."""
    for doc in yaml.safe_load_all((REPO_ROOT / "ci" / "templates" / "argocd-presync-verdict.yaml").read_text()):
        if doc["kind"] != "Job":
            with contextlib.suppress(Conflict):
                kube.create(doc)
    config = yaml.safe_load(admin_kubeconfig.read_text())
    config["users"] = [{"name": "reader", "user": {"token": kube.request_token("gpucanary-verdict-reader",
                                                                               namespace="gpucanary")}}]
    config["contexts"][0]["context"]["user"] = "reader"
    path = tmp_path / "verdict-reader.kubeconfig"
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path
