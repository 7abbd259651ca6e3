"""Disposable node pools the canary upgrades: a PoolProvider protocol and its providers."""
