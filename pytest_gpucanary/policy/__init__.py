"""Upgrade policies: parse and validate (`parse`), lint and diff (`lint`), apply to a pool and restore (`apply`)."""
