"""Label selectors (the Kubernetes string form), parsed client-side.

`parse_selector` turns `a=b,c in (x,y),!d` into the requirements a set of labels must all meet, as the
apiserver would: the allowed-evictions rule, the pool selector's check and the test double's filters use it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from functools import lru_cache

from pytest_gpucanary.errors import ConfigError

_REQUIREMENT = re.compile(
    r"""^\s*(?:
    (?P<not>!)\s*(?P<nkey>[\w./-]+) |
    (?P<skey>[\w./-]+)\s*(?P<sop>in|notin)\s*\((?P<values>[^()]*)\) |
    (?P<key>[\w./-]+)\s*(?P<op>==|!=|=)\s*(?P<value>[\w./-]*) |
    (?P<ekey>[\w./-]+)
    )\s*$""",
    re.X,
)


@lru_cache(maxsize=64)
def parse_selector(text: str) -> tuple[Callable[[Mapping[str, str]], bool], ...]:
    """`a=b`, `a==b`, `a!=b`, `a in (x,y)`, `a notin (x,y)`, `a`, `!a`, joined by commas; all must hold."""
    parts = re.split(r",(?![^()]*\))", text)
    requirements = []
    for part in parts:
        m = _REQUIREMENT.match(part)
        if not part.strip() or not m:
            raise ConfigError(
                f"bad label selector {text!r} at {part.strip()!r}",
                hint="use key=value, key!=value, key in (a,b), key notin (a,b), key or !key",
            )
        requirements.append(_requirement(m))
    return tuple(requirements)


def _requirement(m: re.Match[str]) -> Callable[[Mapping[str, str]], bool]:
    if m["nkey"]:
        nkey = m["nkey"]
        return lambda labels: nkey not in labels
    if m["ekey"]:
        ekey = m["ekey"]
        return lambda labels: ekey in labels
    if m["skey"]:
        skey = m["skey"]
        values = frozenset(v.strip() for v in m["values"].split(",") if v.strip())
        if m["sop"] == "in":
            return lambda labels: labels.get(skey) in values
        return lambda labels: labels.get(skey) not in values  # absent key matches, as in Kubernetes
    key, value = m["key"], m["value"]
    if m["op"] == "!=":
        return lambda labels: labels.get(key) != value
    return lambda labels: labels.get(key) == value
