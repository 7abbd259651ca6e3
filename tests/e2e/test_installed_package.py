"""The gate as installed, not as checked out: a wheel built with `pip wheel . --no-deps`, installed into
a fresh venv and with `pip install --user` into a throwaway HOME, run from an empty directory that holds
a hostile pytest.ini and conftest.py. The canaries, fixtures and the gate's own pytest configuration are
found through the installed distribution. (Needs no fleet: collection checks the inputs only.)

The installs take the package alone (--no-deps); its dependencies come from this test's own
environment through a .pth file, so no index is needed.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_gpucanary.config import REPO_ROOT

pytestmark = [pytest.mark.e2e]    # about 5 s: one wheel build (setuptools from the index) and two installs


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out),
                    str(REPO_ROOT)], check=True, timeout=300)
    [built] = out.glob("pytest_gpucanary-*.whl")
    return built


def hostile_directory(path: Path) -> Path:
    path.mkdir()
    (path / "pytest.ini").write_text("[pytest]\naddopts = --no-such-option\n")
    (path / "conftest.py").write_text("raise RuntimeError('the caller conftest was imported')\n")
    return path


def collect(python: Path, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`gpucanary run --collect-only` with the installed package's own policy fixture."""
    find = subprocess.run([str(python), "-c", "from pytest_gpucanary.config import FIXTURES, CANARIES; "
                                              "print(FIXTURES); print(CANARIES)"],
                          capture_output=True, text=True, cwd=cwd, env=env, check=True)
    fixtures, canaries = find.stdout.split()
    assert not fixtures.startswith(str(REPO_ROOT)) and not canaries.startswith(str(REPO_ROOT)), find.stdout
    return subprocess.run([str(python), "-m", "pytest_gpucanary.cli", "run", "--collect-only", "-q",
                           f"--gpucanary-policy={fixtures}/policies/default.yaml", "--gpucanary-driver-version=580.95.05",
                           f"--gpucanary-reports-dir={cwd / 'reports'}"],
                          capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


def assert_isolated(result: subprocess.CompletedProcess[str], cwd: Path) -> None:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "5 tests collected" in result.stdout
    assert not (cwd / ".pytest_cache").exists()


def deps_pth(site_dir: Path) -> None:
    site_dir.mkdir(parents=True, exist_ok=True)
    (site_dir / "gpucanary-test-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PYTEST", "VIRTUAL_ENV"))}
    return {**env, **extra}


def test_a_fresh_venv_runs_the_gate_from_an_empty_directory(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                   check=True, timeout=300)
    [site_dir] = (venv / "lib").glob("python3*/site-packages")
    deps_pth(site_dir)
    cwd = hostile_directory(tmp_path / "empty")
    assert_isolated(collect(python, cwd, clean_env()), cwd)


def test_a_user_install_runs_the_gate_from_an_empty_directory(wheel: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = clean_env(HOME=str(home), PYTHONUSERBASE=str(home / ".local"))
    venv = tmp_path / "system-like"     # a venv with system site packages lets --user installs through
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--user", "--no-deps",
                    str(wheel)], check=True, timeout=300, env=env)
    user_site = subprocess.run([str(python), "-c", "import site; print(site.getusersitepackages())"],
                               capture_output=True, text=True, env=env, check=True).stdout.strip()
    assert user_site.startswith(str(home))
    deps_pth(Path(user_site))
    cwd = hostile_directory(tmp_path / "empty")
    assert_isolated(collect(python, cwd, env), cwd)
