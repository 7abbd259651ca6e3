"""mkdocs hooks: the options page's tables are made from `Settings` and the lint rules, the fleet page's from the
fleet's settings, at every build, so they cannot drift from the code; a benchmark's last output (docs/figures/)
stands where a page says `<!-- figure: NAME -->`; the repository's CHANGELOG.md is the site's changes page."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

from pytest_gpucanary.config import KNOBS
from pytest_gpucanary.fleet.layout import FLEET_KNOBS
from pytest_gpucanary.policy.lint import RULES

MARKER = "<!-- the options table, made from pytest_gpucanary.config.Settings -->"
RULES_MARKER = "<!-- the lint rules table, made from pytest_gpucanary.policy.lint.RULES -->"
FLEET_MARKER = "<!-- the fleet's settings table, made from pytest_gpucanary.fleet.layout.FleetSettings -->"
OPTIONS_PAGE = "options.md"
FLEET_PAGE = "fleet.md"
CHANGELOG = Path(__file__).resolve().parents[1] / "CHANGELOG.md"
FIGURES = Path(__file__).resolve().parents[1] / "docs" / "figures"
BENCH = Path(__file__).resolve().parents[1] / "tests" / "bench"
FIGURE = re.compile(r"<!-- figure: ([a-z_]+) -->")


def options_table() -> str:
    rows = ["| option | environment | default | meaning |", "|---|---|---|---|"]
    for knob in KNOBS:
        default = "" if knob.default is None else f"`{knob.default}`"
        rows.append(f"| `{knob.flag}` | `{knob.env}` | {default} | {knob.help.replace('|', chr(92) + '|')} |")
    return "\n".join(rows)


def fleet_table() -> str:
    rows = ["| environment | default | meaning |", "|---|---|---|"]
    for knob in FLEET_KNOBS:
        default = "" if knob.default is None else f"`{knob.default}`"
        rows.append(f"| `{knob.env}` | {default} | {knob.help.replace('|', chr(92) + '|')} |")
    return "\n".join(rows)


def rules_table() -> str:
    rows = ["| rule | reads | source |", "|---|---|---|"]
    rows += [f"| `{rule.code}` | {', '.join(f'`{k}`' for k in rule.knobs)} | {rule.source} |" for rule in RULES]
    return "\n".join(rows)


TABLES = {OPTIONS_PAGE: ((MARKER, options_table), (RULES_MARKER, rules_table)), FLEET_PAGE: ((FLEET_MARKER, fleet_table),)}


def figure(found: re.Match[str]) -> str:
    """A benchmark's last output, as docs/figures/<name>.txt keeps it (tests/bench/figures.py writes it)."""
    name = found.group(1)
    if not (BENCH / f"{name}.py").is_file():
        raise PluginError(f"<!-- figure: {name} --> names no tests/bench/{name}.py")
    kept = FIGURES / f"{name}.txt"
    if not kept.is_file():
        return f"*`tests/bench/{name}.py` has not been run since the benchmarks keep their output.*"
    return "```text\n" + kept.read_text().rstrip() + "\n```"


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    markdown = FIGURE.sub(figure, markdown)
    for marker, table in TABLES.get(page.file.src_uri, ()):
        if marker not in markdown:
            raise PluginError(f"docs/{page.file.src_uri} lost the line a table goes in: {marker}")
        markdown = markdown.replace(marker, table())
    return markdown


def on_files(files: Files, config: Any, **kwargs: Any) -> Files:
    files.append(File.generated(config, "changelog.md", abs_src_path=str(CHANGELOG)))
    return files
