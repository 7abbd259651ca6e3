"""`gpucanary widen`: the rollout after a passing canary, in waves, each judged on its live nodes.

Every node the change reaches is held on its old driver by the operator's skip label before the change is
written; a wave is released by dropping its holds, and judged while the operator upgrades it and for a soak
time after: the nodes' upgrade states, their driver pods, and every pod that is not a GPU pod removed from
them. A failed wave halts the rollout with every later node still held. The sweep's state lives in a
ConfigMap, so a killed `widen` resumes (`--resume`) or is undone (`gpucanary cleanup`).
"""
