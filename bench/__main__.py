"""``python -m bench``: the CPU benchmark suite (planner time, peak against budget)."""

from . import peak_vs_budget, plan_7b, planner_time

if __name__ == "__main__":
    planner_time.main([])
    plan_7b.main([])
    peak_vs_budget.main(["--inner", "inductor"])
    peak_vs_budget.main(["--inner", "eager"])
