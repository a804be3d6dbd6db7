"""Trinity's passes, one job per module: liveness, cost_model, plan_window, insert_transfers,
verify (and the timeline simulator the planner scores plans with)."""
