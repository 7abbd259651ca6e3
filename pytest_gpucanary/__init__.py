"""pytest-gpucanary: canary a GPU Operator driver upgrade policy on a disposable node pool."""

__version__ = "0.1.0"
