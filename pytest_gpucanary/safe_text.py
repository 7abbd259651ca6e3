"""Text the canary did not write itself, made safe where it writes it: URLs without their credentials, cluster
text (event messages, container logs, names) as one plain line in logs and CI output, escaped in Markdown,
and a container's log lines without what looks like a credential.

A user's URL may carry a password (`https://user:pass@host`) or a token in its query; the receipts, JUnit and
logs a CI system keeps for weeks get `https://***@host/...?token=***`. Cluster text is written by whoever can
create a pod or an event: a newline in it would start a line a CI system reads as its own command
(`::error::`, `##vso[`), an escape sequence would rewrite the terminal, and Markdown would render links and
images in a job summary.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

SECRET_QUERY_KEYS = re.compile(r"token|key|secret|passw|auth|sig|credential", re.IGNORECASE)
REDACTED = "***"
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]+")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?")
_MARKDOWN = re.compile(r"([\\`*\[\]<|~])")  # code, emphasis, links and images, HTML, table cells


def redact_url(url: str) -> str:
    """The URL without a user or password, and with the values of query keys that look like credentials hidden."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return REDACTED
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{REDACTED}@{netloc.rsplit('@', 1)[1]}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, REDACTED if SECRET_QUERY_KEYS.search(k) else v) for k, v in pairs], safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


_SECRET_IN_TEXT = re.compile(
    r"(?i)(bearer\s+|(?:token|secret|passw(?:or)?d|api[_-]?key)[\"']?\s*[:=]\s*[\"']?)"
    r"[^\s\"',;]+"
)
_URL_USER = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@]+@")


def without_secrets(text: str) -> str:
    """A log line with what looks like a credential hidden: a bearer token, `token=`/`password:` values, the
    user part of a URL. A crash-looping container's last lines go to receipts and CI logs."""
    return _URL_USER.sub(rf"\1{REDACTED}@", _SECRET_IN_TEXT.sub(rf"\1{REDACTED}", text))


def one_line(text: object) -> str:
    """Cluster text as one plain line: escape sequences dropped, every control character and line break a space."""
    return " ".join(_CONTROL.sub(" ", _ANSI.sub("", str(text))).split())


def markdown(text: object) -> str:
    """Cluster text in a Markdown receipt: one line, with every character Markdown gives a meaning escaped."""
    return _MARKDOWN.sub(r"\\\1", one_line(text))
