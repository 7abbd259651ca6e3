"""Upgrade policies as data: read and checked (`parse`, `model`), rendered from Helm values (`helm`, `render`),
linted (`lint`) and compared (`diff`). Applying one to a pool is the canary run's (`canary.apply`)."""
