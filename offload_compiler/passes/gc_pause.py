"""Python's cyclic garbage collector paused for the length of an analysis.

The analyses allocate many small, short-lived objects (dicts, lists, tuples) while the traced
graphs keep millions of objects alive; each generation-0 overflow then walks every tracked object.
None of what an analysis makes is cyclic garbage that must be freed before it ends. Measured at
48 layers of the demo GPT on H100 figures (2-core CPU, torch 2.13): the four liveness analyses of
a compile took 2.76 s with the collector on and 1.25 s paused (with the storage-key lookups of
this change); the joint planner's model building took 2.8 s with it, 0.17 s without
(:func:`.plan_recompute.plan_joint`).

Paused around single analyses only, not around the whole rewrite pipeline: a pause over every
pass lets the rewrites' cyclic garbage (graph copies, whose nodes and users refer to each other)
pile up, and the fresh memory it takes cost page faults; in a process that compiles several
times (``python -m bench.planner_time``) that made the planner slower (median 6.2 s at 48 layers
against 4.0 s).
"""

from __future__ import annotations

import contextlib
import gc

__all__ = ["paused_gc"]


@contextlib.contextmanager
def paused_gc():
    """Pause the cyclic collector inside the ``with`` block and restore its state after (it stays
    off if it was off: pauses nest). Reference counting still frees everything that is not in a
    cycle at once; cycles made inside are collected at the next collection after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
