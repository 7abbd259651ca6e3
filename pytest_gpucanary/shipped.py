"""Where the files shipped beside the package (fixtures, canaries) live.

From a checkout (and an editable install) they sit at the repository root; an installed wheel
carries them as data files under <scheme data>/share/gpucanary (see pyproject's data-files), which
is sys.prefix in a venv but the user base for `pip install --user`: the wheel's own RECORD says where.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTION = "pytest-gpucanary"
_MARKER = "share/gpucanary/canaries/test_driver_rollout.py"


def _shipped_base() -> Path:
    if (REPO_ROOT / "fixtures").is_dir() and (REPO_ROOT / "canaries").is_dir():
        return REPO_ROOT
    from importlib import metadata

    try:
        files = metadata.distribution(DISTRIBUTION).files or []
    except metadata.PackageNotFoundError:
        files = []
    for entry in files:
        if entry.as_posix().endswith(_MARKER):
            return Path(entry.locate()).resolve().parents[1]
    return Path(sys.prefix) / "share" / "gpucanary"


_BASE = _shipped_base()
FIXTURES = _BASE / "fixtures"
CANARIES = _BASE / "canaries"


@contextmanager
def gate_pytest_args(pytest_args: list[str]) -> Iterator[list[str]]:
    """pytest's arguments for the shipped gate: its own configuration (shipped in the package), rootdir and
    conftest boundary, never the caller's, whatever the current directory; then the caller's arguments."""
    from importlib import resources

    with resources.as_file(resources.files("pytest_gpucanary") / "gate-pytest.ini") as ini:
        # the plugin is imported already (this module is in its package), so pytest cannot rewrite it
        yield [
            "-c",
            str(ini),
            f"--rootdir={CANARIES}",
            f"--confcutdir={CANARIES}",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:locust",
            "-W",
            "ignore::pytest.PytestAssertRewriteWarning",
            str(CANARIES),
            *pytest_args,
        ]
