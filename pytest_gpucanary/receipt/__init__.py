"""The launch receipt: JSON, Markdown, HTML (with an offline timeline picture), a stage JUnit file and the
verdict as Prometheus metrics.

Draws what the ladder computed, never judges: every renderer takes the `LadderResult` and the run's
`RunEvidence`. Times are client wall-clock times; offsets are seconds from the upgrade start.
"""

from __future__ import annotations

from pathlib import Path

from pytest_gpucanary.config import flag
from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.ladder import LadderResult, RunEvidence
from pytest_gpucanary.receipt.html import render_html
from pytest_gpucanary.receipt.json import render_json
from pytest_gpucanary.receipt.junit import render_stage_junit
from pytest_gpucanary.receipt.markdown import render_markdown
from pytest_gpucanary.receipt.verdict import METRICS_FILE, render_metrics

FILES = {
    "json": "receipt.json",
    "markdown": "receipt.md",
    "html": "receipt.html",
    "junit": "stages.junit.xml",
    "metrics": METRICS_FILE,
}
RENDERERS = {
    "json": render_json,
    "markdown": render_markdown,
    "html": render_html,
    "junit": render_stage_junit,
    "metrics": render_metrics,
}


def write_receipt(report_dir: Path, result: LadderResult, evidence: RunEvidence) -> dict[str, Path]:
    """Write the receipt files into `report_dir`; returns their paths by format."""
    paths = {key: Path(report_dir) / name for key, name in FILES.items()}
    try:
        Path(report_dir).mkdir(parents=True, exist_ok=True)
        for key, render in RENDERERS.items():
            paths[key].write_text(render(result, evidence), encoding="utf-8")
    except OSError as err:
        raise EnvError(
            f"cannot write the receipt into {str(report_dir)!r}: {err.strerror}",
            hint=f"point {flag('reports_dir')} at a writable directory",
        ) from err
    return paths
