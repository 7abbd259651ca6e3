"""mkdocs hooks: the options page's table is made from `Settings` at every build, so it cannot drift from the
code; the repository's CHANGELOG.md is the site's changes page."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

from pytest_gpucanary.config import KNOBS

MARKER = "<!-- the options table, made from pytest_gpucanary.config.Settings -->"
OPTIONS_PAGE = "options.md"
CHANGELOG = Path(__file__).resolve().parents[1] / "CHANGELOG.md"


def options_table() -> str:
    rows = ["| option | environment | default | meaning |", "|---|---|---|---|"]
    for knob in KNOBS:
        default = "" if knob.default is None else f"`{knob.default}`"
        rows.append(f"| `{knob.flag}` | `{knob.env}` | {default} | {knob.help.replace('|', chr(92) + '|')} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if page.file.src_uri != OPTIONS_PAGE:
        return markdown
    if MARKER not in markdown:
        raise PluginError(f"docs/{OPTIONS_PAGE} lost the line the options table goes in: {MARKER}")
    return markdown.replace(MARKER, options_table())


def on_files(files: Files, config: Any, **kwargs: Any) -> Files:
    files.append(File.generated(config, "changelog.md", abs_src_path=str(CHANGELOG)))
    return files
