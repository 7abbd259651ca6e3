"""The checkpoint-aware sweep planner: model, plan, compare, inventory, report (and its pytest fixtures)."""
