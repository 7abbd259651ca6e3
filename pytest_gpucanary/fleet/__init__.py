"""The local GPU fleet (the embedded default and the test bed)."""

from pytest_gpucanary.fleet.fleet import Fleet

__all__ = ["Fleet"]
