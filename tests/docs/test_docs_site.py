"""The documentation site builds with warnings as errors, its options table is every knob under its one name,
and README.md stays what a newcomer reads first."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from pytest_gpucanary.config import KNOBS
from pytest_gpucanary.policy.lint import RULES

ROOT = Path(__file__).resolve().parents[2]


def test_the_site_builds_strict_and_its_options_page_lists_every_knob(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    options = (tmp_path / "options" / "index.html").read_text()
    missing = [k.flag for k in KNOBS if f"<code>{k.flag}</code>" not in options or f"<code>{k.env}</code>" not in options]
    assert missing == []
    assert [r.code for r in RULES if f"<code>{r.code}</code>" not in options] == []
    assert "NVIDIA/gpu-operator #2570" in options
    assert "Changes" in (tmp_path / "changelog" / "index.html").read_text()


def test_the_readme_is_short_and_every_page_it_names_exists() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) < 10_000
    named = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert [path for path in named if not path.startswith("http") and not (ROOT / path).exists()] == []
    assert "## Simulated" in readme and "## Simulated" in (ROOT / "docs" / "fleet.md").read_text()
