"""Size guard: a plan made for one set of dynamic sizes is only reused for sizes up to those.

With dynamic shapes (``dynamic=True``, or Dynamo's automatic dynamic after a second size), the
graph pair is planned once, at the sizes it was traced with (the shape environment's hints),
while the compiled code runs at any size. Device bytes grow with the sizes, so at a larger batch
the same plan would exceed the budget. This pass adds, through the shape environment, a guard
``s <= hint`` for every size symbol that the pair's buffer sizes depend on: Dynamo checks it
before each call, and a larger size recompiles, which plans again at that size (a percentage
budget is resolved again there). Smaller sizes reuse the plan: every buffer's size is a
polynomial with non-negative coefficients in the sizes, so no step's live bytes grow when a size
shrinks.

Nothing is guarded without a budget (``budget_bytes is None``): the plan then does not depend on
sizes. Reads ``Buffer.size_expr`` from liveness; writes no ``node.meta``; adds guards to the
shape environment of the graphs' fake mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from ..graph_pair import GraphPair, fake_mode_of
from .liveness import Liveness

__all__ = ["SizeGuards", "guard_planned_sizes"]


@dataclass(frozen=True)
class SizeGuards:
    """The guards added: ``(symbol name, largest size the plan holds for)`` per size symbol."""

    bounds: tuple[tuple[str, int], ...]


def guard_planned_sizes(pair: GraphPair, liveness: Liveness, budget_bytes: int | None) -> SizeGuards:
    """Guard every size symbol of ``liveness``'s buffers to at most its planning hint.

    Args:
        pair: the planned graph pair (its fake mode's shape environment receives the guards).
        liveness: the analysis the plan was made from (symbolic ``size_expr`` per buffer).
        budget_bytes: the resolved budget; ``None`` adds no guard.

    Returns:
        The bounds added (empty for static shapes or without a budget).
    """
    if budget_bytes is None:
        return SizeGuards(())
    symbols: set[sympy.Symbol] = set()
    for b in liveness.buffers:
        symbols |= {s for s in b.size_expr.free_symbols if isinstance(s, sympy.Symbol)}
    if not symbols:
        return SizeGuards(())
    mode = fake_mode_of(pair.forward, pair.backward)
    shape_env = getattr(mode, "shape_env", None)
    if shape_env is None:
        return SizeGuards(())
    # torch >= 2.13 calls the hints backed_var_to_val (var_to_val is deprecated there); 2.11 has
    # only var_to_val.
    hints = getattr(shape_env, "backed_var_to_val", None)
    if hints is None:
        hints = shape_env.var_to_val
    bounds = []
    for s in sorted(symbols, key=lambda s: s.name):
        hint = hints.get(s)
        if hint is None:  # an unbacked size (data-dependent): no hint to bound it by
            continue
        shape_env.evaluate_expr(sympy.Le(s, hint))
        bounds.append((s.name, int(hint)))
    return SizeGuards(tuple(bounds))
