"""A CPU fault-finding executor for multi-stream graphs (a test tool, not the product runtime).

:func:`run_interleaved` executes a stream-annotated FX graph (``node.meta["trinity_stream"]``,
``trinity::record_event`` / ``wait_event`` nodes, as ``passes/assign_streams.py`` writes them) by
really interleaving its streams in a random order that CUDA could produce:

* the host issues the nodes in program order; each stream runs the nodes issued to it in that
  order; at every step a random one of {the host issues the next node, a stream runs its next
  node} happens, so a stream may lag arbitrarily far behind the host and behind other streams;
* a ``wait_event`` cannot run before the matching ``record_event`` has run (events respected);
* a node that reads a value its producer (on another stream) has not computed yet reads a
  buffer full of NaN (all bits set: -1 for integers): a not-yet-written buffer;
* a buffer freed in program order (its last use, ``keep`` arguments included) is poisoned the
  same way as soon as its allocating stream runs a later node (the caching allocator may hand
  that memory to it): a reader on another stream that is not ordered before the free reads NaN;
* views launch nothing: a view is taken from its base whenever a node reads it (so it sees the
  base's data as it is at that moment); ``set_stream`` is skipped;
* the output is read on stream 0 when stream 0 reaches it: a side stream not joined by then
  leaves NaN in the results;
* the copies (``trinity::evict`` / ``prefetch``) run through the transfer runtime as they are:
  with its :class:`~offload_compiler.runtime.transfer.FaultInjection` mode they are deferred to
  their waits.

So any missing event shows as NaN in the results for some seed; a correct graph gives exactly the
values of sequential execution, for every seed. Graph inputs are copied before they can be poisoned
(inputs that are returned or mutated are used as they are, and are never poisoned).

The backend runs multi-stream graphs with it when ``fault_injection`` is set, ``num_streams > 1``
and ``inner="eager"`` (:func:`interleaved_compiler`).
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from typing import Any

import torch
import torch.fx as fx

__all__ = ["run_interleaved", "interleaved_compiler", "poison_"]


def poison_(t: torch.Tensor) -> None:
    """Set every byte of ``t``'s whole storage to 0xFF (NaN for floats, -1 for integers)."""
    storage = t.untyped_storage()
    if storage.nbytes():
        torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,)).fill_(0xFF)


def _unwritten(val: Any) -> Any:
    """A poisoned stand-in for a value that is not computed yet (from its fake ``meta["val"]``)."""
    if isinstance(val, torch.Tensor):
        from ..graph_pair import hint_int

        t = torch.empty_strided(
            tuple(hint_int(s) for s in val.shape),
            tuple(hint_int(s) for s in val.stride()),
            dtype=val.dtype,
            device=val.device if val.device.type != "meta" else "cpu",
        )
        poison_(t)
        return t
    if isinstance(val, (tuple, list)):
        return type(val)(_unwritten(v) for v in val)
    return val


def run_interleaved(gm: fx.GraphModule, args: list, seed: int) -> Any:
    """Run ``gm`` on ``args`` in one random valid interleaving of its streams (see the module
    docstring); returns what the graph's output returns.

    Raises:
        ValueError: when the number of arguments does not match the graph's placeholders.
        RuntimeError: when no node can run (a wait whose event is never recorded).
    """
    from ..ir.meta import STREAM_KEY
    from ..ir.ops import RECORD_EVENT, SET_STREAM, TRANSFER_OPS, WAIT_EVENT
    from ..passes.storage_access import GraphAccess

    rng = random.Random(seed)
    access = GraphAccess.of(gm.graph, ignore=())
    nodes = [n for n in access.nodes if not (n.op == "call_function" and n.target is SET_STREAM)]
    pos = {n: i for i, n in enumerate(access.nodes)}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != len(args):
        raise ValueError(f"run_interleaved: the graph takes {len(placeholders)} inputs, got {len(args)}")

    # Where each node runs.
    stream: dict[fx.Node, int] = {}
    for n in nodes:
        if n.op == "placeholder":
            stream[n] = 0
        elif n.op == "call_function" and n.target in (RECORD_EVENT, WAIT_EVENT):
            stream[n] = n.args[3]
        elif n in access.views:
            src = next((m for m in n.all_input_nodes if m in stream), None)
            stream[n] = stream[src] if src is not None else 0
        elif n.op == "output":
            stream[n] = 0
        else:
            stream[n] = n.meta.get(STREAM_KEY, 0)

    # Inputs: copies that may be poisoned, unless returned or mutated by the graph.
    keep_as_is = set(access.escapes)
    for n in nodes:
        if n.op == "call_function" and n not in access.views:
            keep_as_is |= {k for k in access.writes.get(n, ()) if access.allocator.get(k) is not n}
        if n.op == "call_function" and n.target in TRANSFER_OPS:
            # The transfer runtime keeps what its copies touch alive itself (its own fault
            # injection covers those); this executor checks the compute streams.
            keep_as_is |= set(access.reads.get(n, ())) | set(access.writes.get(n, ()))
    env: dict[fx.Node, Any] = {}
    for ph, value in zip(placeholders, args):
        keys = set(access.writes.get(ph, ()))
        if isinstance(value, torch.Tensor) and not (keys & keep_as_is):
            try:
                copy = torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device=value.device)
                copy.copy_(value)
                value = copy
            except RuntimeError:  # overlapping strides: leave as is
                pass
        env[ph] = value

    # Frees: at the host issue of a buffer's last use, to be poisoned when its allocating stream
    # runs any later node.
    frees_at: dict[int, list] = {}
    for k, p in access.last_use.items():
        if k not in access.escapes and k not in keep_as_is:
            frees_at.setdefault(p, []).append(k)
    alloc_stream = {k: stream.get(a, 0) for k, a in access.allocator.items()}
    freed: dict[int, list] = {}  # stream -> [(position, buffer)]

    # The nodes whose values live on each buffer: once every buffer a value lives on is freed
    # and poisoned, the executor drops the value too (the allocator would reuse that memory), so
    # its memory use follows the graph's frees; a later read of it gets a poisoned stand-in.
    from ..ir.alias import node_storages

    own = {n: set(node_storages(n)) for n in nodes if n.op == "call_function" and n not in access.views}
    values_on: dict = {}
    for n, keys in own.items():
        for k in keys:
            values_on.setdefault(k, []).append(n)
    dead: set = set()

    def poison_freed(s: int, p: int) -> None:
        rest = []
        for fp, k in freed.get(s, []):
            if fp < p:
                holder = access.holder.get(k)
                value = env.get(holder) if holder is not None and holder not in access.views else None
                if value is None and holder is not None and holder in access.views:
                    value = lookup(holder)
                if isinstance(value, torch.Tensor):
                    poison_(value)
                dead.add(k)
                for m in values_on.get(k, ()):
                    if own[m] <= dead:
                        env.pop(m, None)
            else:
                rest.append((fp, k))
        freed[s] = rest

    def lookup(m: fx.Node) -> Any:
        if m in access.views:
            return m.target(*fx.node.map_arg(m.args, lookup), **fx.node.map_arg(m.kwargs, lookup))
        if m in env:
            return env[m]
        return _unwritten(m.meta.get("val"))

    fired: set = set()
    queues: dict[int, deque] = {}
    issue = deque(n for n in nodes if n.op != "placeholder")
    result: list = []

    def runnable(s: int) -> bool:
        q = queues.get(s)
        if not q:
            return False
        head = q[0]
        return not (head.op == "call_function" and head.target is WAIT_EVENT and head.args[2] not in fired)

    try:
        while issue or any(queues.values()):
            actions = (["host"] if issue else []) + [s for s in queues if runnable(s)]
            if not actions:
                raise RuntimeError("run_interleaved: deadlock (a wait_event whose event is never recorded)")
            act = rng.choice(actions)
            if act == "host":
                n = issue.popleft()
                if n not in access.views:
                    queues.setdefault(stream[n], deque()).append(n)
                for k in frees_at.get(pos[n], ()):
                    freed.setdefault(alloc_stream.get(k, 0), []).append((pos[n], k))
                continue
            n = queues[act].popleft()
            if n.op == "call_function" and n.target is RECORD_EVENT:
                fired.add(n.args[2])
                continue
            if n.op == "call_function" and n.target is WAIT_EVENT:
                continue
            if n not in access.views:
                poison_freed(act, pos[n])
            if n.op == "output":
                result.append(fx.node.map_arg(n.args[0], lookup))
                continue
            args_ = fx.node.map_arg(n.args, lookup)
            kwargs = fx.node.map_arg(n.kwargs, lookup)
            if n.op == "call_function":
                env[n] = n.target(*args_, **kwargs)
            elif n.op == "get_attr":
                target = gm
                for part in n.target.split("."):
                    target = getattr(target, part)
                env[n] = target
            else:
                raise ValueError(f"run_interleaved: cannot run {n.op} node {n.name!r}")
    finally:
        # ``lookup`` refers to itself (a reference cycle through its closure): without this every
        # node's value would stay alive after the run until the garbage collector ran.
        env.clear()
        freed.clear()
    return result[0]


def interleaved_compiler(seed: int):
    """An AOTAutograd compiler (like ``boxed_nop``) that runs graphs with side streams under
    :func:`run_interleaved`, with seed ``seed``, ``seed + 1``, ... on successive calls; graphs on
    one stream run as plain FX code."""
    counter = itertools.count()

    def compile_graph(gm: fx.GraphModule, example_inputs):
        from torch._dynamo.backends.debugging import boxed_nop

        from ..passes.happens_before import has_streams

        if not has_streams(gm):
            return boxed_nop(gm, example_inputs)

        def run(args):
            values = list(args)
            args.clear()
            return run_interleaved(gm, values, seed + next(counter))

        run._boxed_call = True
        return run

    return compile_graph
