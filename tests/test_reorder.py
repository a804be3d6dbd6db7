"""Reorder: a node that frees more than it allocates moves right after its latest input; nodes
that must not move stay; the results do not change.

Graphs are traced with ``make_fx`` on fake tensors (so every node has ``meta["val"]``) in the
order the Python function runs its ops.
"""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.node import has_side_effect

from offload_compiler.passes import reorder

from ._pass_helpers import mlp4_inputs, mlp4_pair, run_pair

# Test-only custom ops: a reduction that has a side effect, and one that mutates an argument.
_lib = torch.library.Library("trinity_reorder_test", "DEF")
_lib.define("logged_sum(Tensor x) -> Tensor")
_lib.define("consume_(Tensor(a!) counter, Tensor x) -> Tensor")


def _logged_sum(x):
    return x.sum().reshape(1).clone()


def _consume(counter, x):
    counter.add_(1)
    return x.sum().reshape(1).clone()


_lib.impl("logged_sum", _logged_sum, "CompositeExplicitAutograd")
_lib.impl("consume_", _consume, "CompositeExplicitAutograd")


@torch.library.register_fake("trinity_reorder_test::logged_sum", lib=_lib)
def _logged_sum_fake(x):
    return x.new_empty((1,))


@torch.library.register_fake("trinity_reorder_test::consume_", lib=_lib)
def _consume_fake(counter, x):
    return x.new_empty((1,))


LOGGED_SUM = torch.ops.trinity_reorder_test.logged_sum.default
CONSUME = torch.ops.trinity_reorder_test.consume_.default
has_side_effect(LOGGED_SUM)


def trace(fn, *inputs):
    return make_fx(fn, tracing_mode="fake")(*inputs)


def order(gm):
    return [n.name for n in gm.graph.nodes]


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def same_results(fn, inputs, seed=None):
    """Trace ``fn``, run it, hoist, run again: both runs on clones of ``inputs``."""
    gm = trace(fn, *[t.clone() for t in inputs])

    def run():
        if seed is not None:
            torch.manual_seed(seed)
        out = gm(*[t.clone() for t in inputs])
        return out if isinstance(out, (tuple, list)) else (out,)

    before = run()
    moved = reorder.hoist_frees(gm)
    after = run()
    return gm, moved, before, after


def x16():
    torch.manual_seed(0)
    return torch.randn(16), torch.randn(16)


def test_reduction_moves_right_after_its_input():
    # exp makes 64 B; sum reads it last and makes 4 B: moved up to right after exp, so the 64 B
    # are free while sin and cos run.
    def fn(x, y):
        a = torch.exp(x)
        b = torch.sin(y)
        c = torch.cos(b)
        s = a.sum()
        return c, s

    gm, moved, before, after = same_results(fn, x16())
    assert moved == 1
    assert targets(gm) == [
        torch.ops.aten.exp.default,
        torch.ops.aten.sum.default,
        torch.ops.aten.sin.default,
        torch.ops.aten.cos.default,
    ]
    for a, b in zip(before, after):
        assert torch.equal(a, b)


def test_moves_after_the_latest_of_several_inputs():
    # dot(a, b) frees 2 x 64 B and makes 4 B: it goes right after b (its latest input), not a.
    def fn(x, y):
        a = torch.exp(x)
        b = torch.sin(y)
        c = torch.cos(y)
        d = torch.tanh(c)
        e = torch.dot(a, b)
        return d, e

    gm, moved, before, after = same_results(fn, x16())
    assert moved == 1
    assert targets(gm) == [
        torch.ops.aten.exp.default,
        torch.ops.aten.sin.default,
        torch.ops.aten.dot.default,
        torch.ops.aten.cos.default,
        torch.ops.aten.tanh.default,
    ]
    for a, b in zip(before, after):
        assert torch.equal(a, b)


def test_reduction_of_a_placeholder_stays():
    # A reduction of a placeholder frees nothing (the caller owns inputs): it stays.
    def fn(x, y):
        a = torch.exp(y)
        b = torch.sin(a)
        s = x.sum()
        return b, s

    gm, moved, _before, _after = same_results(fn, x16())
    assert moved == 0
    assert targets(gm)[-1] == torch.ops.aten.sum.default


@pytest.mark.parametrize(
    "make_tail",
    [
        # Allocates as much as it frees (64 B -> 64 B): no gain, no move.
        lambda a: torch.neg(a),
        # Allocates more (64 B -> 128 B).
        lambda a: torch.cat([a, a]),
    ],
    ids=["equal", "larger"],
)
def test_node_that_does_not_free_more_than_it_allocates_stays(make_tail):
    def fn(x, y):
        a = torch.exp(x)
        b = torch.sin(y)
        c = torch.cos(b)
        return c, make_tail(a)

    gm, moved, _before, _after = same_results(fn, x16())
    assert moved == 0
    assert targets(gm)[:3] == [torch.ops.aten.exp.default, torch.ops.aten.sin.default, torch.ops.aten.cos.default]


def test_input_read_again_later_is_not_freed():
    # a is read again after the sum: moving the sum frees nothing.
    def fn(x, y):
        a = torch.exp(x)
        b = torch.sin(y)
        s = a.sum()
        t = a * 2
        return b, s, t

    gm, moved, _before, _after = same_results(fn, x16())
    assert moved == 0
    assert targets(gm)[:3] == [torch.ops.aten.exp.default, torch.ops.aten.sin.default, torch.ops.aten.sum.default]


def test_random_op_never_moves():
    # multinomial would free the 64-byte probabilities for a 32-byte int64 result (a pure op in
    # its place would move up to right after exp), but it draws from the generator: moving it
    # above randn would change the numbers both get.
    def fn(x, y):
        p = torch.exp(x.view(4, 4))
        b = torch.randn(3)
        c = torch.cos(y)
        m = torch.multinomial(p, 1)
        return b, c, m

    gm, moved, before, after = same_results(fn, x16(), seed=7)
    assert moved == 0
    assert targets(gm)[-1] == torch.ops.aten.multinomial.default
    for a, b in zip(before, after):
        assert torch.equal(a, b)


def test_impure_op_never_moves():
    def fn(x, y):
        a = torch.exp(x)
        b = torch.sin(y)
        c = torch.cos(b)
        s = LOGGED_SUM(a)
        return c, s

    gm = trace(fn, *x16())
    assert reorder.hoist_frees(gm) == 0
    assert targets(gm)[-1] is LOGGED_SUM


def test_mutating_op_never_moves():
    def fn(counter, x, y):
        a = torch.exp(x)
        b = torch.sin(y)
        c = torch.cos(b)
        s = CONSUME(counter, a)
        return c, s

    x, y = x16()
    gm = trace(fn, torch.zeros(1), x, y)
    assert reorder.hoist_frees(gm) == 0
    assert targets(gm)[-1] is CONSUME


def test_results_unchanged_on_a_captured_pair():
    ref = mlp4_pair()
    pair = mlp4_pair()
    reorder.hoist_frees(pair.forward)
    reorder.hoist_frees(pair.backward)
    pair.forward.graph.lint()
    pair.backward.graph.lint()
    primals = mlp4_inputs()
    u0, _, g0 = run_pair(ref, primals)
    u1, _, g1 = run_pair(pair, primals)
    for a, b in zip(u0 + g0, u1 + g1):
        assert (a is None and b is None) or torch.equal(a, b)


def test_pure_reader_is_not_moved_above_a_mutation_of_its_input():
    # dot(a, x) frees a (64 B) for 4 B, but x is mutated in place between a's definition and the
    # dot; the traced dot reads the add_ node (the mutated x), so it may move up to right after
    # the add_ at most, never above it (that would read the old x).
    def fn(x, y):
        a = torch.exp(y)
        b = torch.sin(y)
        x.add_(1)
        d = torch.dot(a, x)
        return b, d

    gm, _moved, before, after = same_results(fn, x16())
    t = targets(gm)
    assert t.index(torch.ops.aten.dot.default) > t.index(torch.ops.aten.add_.Tensor)
    for a, b in zip(before, after):
        assert torch.equal(a, b)
