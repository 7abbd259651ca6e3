"""The checks of the knobs' values: each returns an error text, or None when the value is fine.

`Settings` names one per field (`knob(..., check=...)`); `gpucanary cleanup` and the gate judge a run
id with the same `run_id_rule`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from pytest_gpucanary.errors import ConfigError
from pytest_gpucanary.label_selector import parse_selector

Check = Callable[[Any], "str | None"]


def positive(value: float) -> str | None:
    return None if math.isfinite(value) and value > 0 else "must be a finite number > 0"


def at_least(low: int) -> Check:
    return lambda value: None if value >= low else f"must be at least {low}"


def fraction(value: float) -> str | None:
    return None if math.isfinite(value) and 0 <= value <= 1 else "must be a fraction 0..1"


def one_of(*choices: str) -> Check:
    return lambda value: None if value is None or value in choices else f"must be one of {', '.join(choices)}"


def selector(value: str) -> str | None:
    try:
        parse_selector(value)
    except ConfigError as err:
        return f"is not a label selector ({err})"
    return None


RUN_ID_MAX = 40  # it names the namespace gpucanary-<id> and nodes canary-<id>-<n>, which must stay DNS-1123 labels
_RUN_ID = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_VERSION = re.compile(r"^[0-9][A-Za-z0-9_.-]{0,127}$")  # an image tag that starts with a digit: 580.95.05


def run_id_rule(value: str) -> str | None:
    if len(value) <= RUN_ID_MAX and _RUN_ID.match(value):
        return None
    return (
        f"must be lower-case letters, digits and '-', at most {RUN_ID_MAX} characters, starting and ending alphanumeric"
    )


def version_rule(value: str) -> str | None:
    return None if _VERSION.match(value) else "must be a driver version such as 580.95.05 (an image tag)"


def url_rule(value: str) -> str | None:
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018  raises on a port that is not a number
    except ValueError as err:
        return f"is not a URL ({err})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "must be an http:// or https:// URL with a host"
    return None


_IMAGE = re.compile(r"^[a-z0-9]([a-z0-9._:/-]*[a-z0-9])?(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[0-9a-f]{64})?$")
_REGISTRY = re.compile(r"^[a-z0-9]([a-z0-9._:/-]*[a-z0-9])?$")


def image_rule(value: str) -> str | None:
    return None if _IMAGE.match(value) else "must be an image reference such as registry.example.com/path/name:tag"


def registry_rule(value: str) -> str | None:
    return (
        None
        if _REGISTRY.match(value) and "://" not in value
        else "must be a registry host with an optional path, e.g. mirror.example.com:5000/gpu"
    )


def evictions_rule(value: str) -> str | None:
    return None if value == "gpu" else selector(value)


def xid_list(value: str) -> str | None:
    parts = [p.strip() for p in value.split(",")] if value.strip() else []
    return None if all(p.isdigit() for p in parts) else "must be XID numbers separated by commas, e.g. 13,31,43"
