"""Liveness on tiny captured graphs: buffers, kinds, sizes, live ranges and live bytes, checked
against values worked out by hand from the printed graphs.

The main example is ``tanh_mm`` (w: 3x5 parameter, x: 2x3 input, fp32). Its pair is::

    forward                                   backward
     0 primals_1 (w, 60 B)                     9 detach_1 (placeholder, saved)
     1 primals_2 (x, 24 B)                    10 t        (placeholder, saved: x.t())
     2 mm = x @ w            (40 B)           11 tangents_1 (4 B)
     3 tanh = tanh(mm)       (40 B)           12 expand = tangents_1.expand(2, 5)   (view)
     4 detach = tanh.detach()        (view)   13 tanh_backward(expand, detach_1)   (40 B)
     5 sum_1 = tanh.sum()    (4 B, output)    14 mm_1 = t @ tanh_backward (60 B, grad of w)
     6 detach_1 = detach.detach()    (view)   15 output
     7 t = x.t()                     (view)
     8 output (sum_1, detach_1, t)
"""

import pytest
import sympy
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

from offload_compiler.graph_pair import GraphPair
from offload_compiler.passes import liveness
from offload_compiler.passes.liveness import BufferKind

from ._pass_helpers import buffer_holding, gram_pair, mlp4_pair, qkv_pair, tanh_mm_pair
from .graphs import capture_pair, dynamo_pair, partition_unaware_of_parameters

FW = ["primals_1", "primals_2", "mm", "tanh", "detach", "sum_1", "detach_1", "t", "output"]
BW = ["detach_1", "t", "tangents_1", "expand", "tanh_backward", "mm_1", "output"]


@pytest.fixture
def live():
    return liveness.analyze(tanh_mm_pair())


def test_schedule_is_forward_then_backward(live):
    assert live.num_fw_steps == len(FW)
    assert live.num_steps == len(FW) + len(BW)
    assert [(s.graph, s.node) for s in live.steps] == [("forward", n) for n in FW] + [("backward", n) for n in BW]
    assert [s.index for s in live.steps] == list(range(live.num_steps))
    assert [s.is_placeholder for s in live.steps] == [True, True] + [False] * 7 + [True] * 3 + [False] * 4
    assert [s.is_output for s in live.steps].count(True) == 2
    assert live.step_named("forward", "sum_1") == 5
    assert live.step_named("backward", "detach_1") == 9
    assert live.device == "cpu"


def test_kinds_sizes_and_aliases(live):
    expected = {
        # node: (kind, storage bytes, every node holding the storage)
        "forward:primals_1": (BufferKind.PARAMETER, 60, {"forward:primals_1"}),
        "forward:primals_2": (BufferKind.INPUT, 24, {"forward:primals_2", "forward:t", "backward:t"}),
        "forward:mm": (BufferKind.TEMPORARY, 40, {"forward:mm"}),
        "forward:tanh": (
            BufferKind.SAVED,
            40,
            {"forward:tanh", "forward:detach", "forward:detach_1", "backward:detach_1"},
        ),
        "forward:sum_1": (BufferKind.OUTPUT, 4, {"forward:sum_1"}),
        "backward:tangents_1": (BufferKind.TANGENT, 4, {"backward:tangents_1", "backward:expand"}),
        "backward:tanh_backward": (BufferKind.TEMPORARY, 40, {"backward:tanh_backward"}),
        "backward:mm_1": (BufferKind.GRADIENT, 60, {"backward:mm_1"}),
    }
    assert len(live.buffers) == len(expected)
    for node, (kind, nbytes, holders) in expected.items():
        b = buffer_holding(live, node)
        assert b.kind is kind, node
        assert b.size_bytes == nbytes, node
        assert b.size_expr == sympy.Integer(nbytes), node
        assert set(b.nodes) == holders, node
        assert b.on_device and b.device == "cpu" and not b.fused
    assert sorted(b.id for b in live.buffers) == list(range(len(live.buffers)))


def test_kind_of_an_input_depends_on_static_indices():
    torch.manual_seed(0)
    w = torch.randn(3, 5, requires_grad=True)
    x = torch.randn(2, 3)
    from ._pass_helpers import tanh_mm

    live = liveness.analyze(capture_pair(tanh_mm, w, x, static=()))
    assert buffer_holding(live, "forward:primals_1").kind is BufferKind.INPUT


def test_live_ranges(live):
    last = live.num_steps - 1
    # Caller-owned: the whole schedule.
    for node in ("forward:primals_1", "forward:primals_2"):
        b = buffer_holding(live, node)
        assert (b.def_step, b.last_step) == (0 if node.endswith("_1") else 1, last)
    # The user output and the gradient: from their definition to the end.
    assert (buffer_holding(live, "forward:sum_1").def_step, buffer_holding(live, "forward:sum_1").last_step) == (
        5,
        last,
    )
    g = buffer_holding(live, "backward:mm_1")
    assert (g.def_step, g.last_step) == (14, last)
    # Temporaries: definition to last reader.
    mm = buffer_holding(live, "forward:mm")
    assert (mm.def_step, mm.last_step, mm.use_steps) == (2, 3, (3,))
    # The scalar loss's tangent (the seed loss.backward() makes): the whole backward, since
    # torch.autograd.backward holds it until every backward has run (its last reader is 13).
    tangent = buffer_holding(live, "backward:tangents_1")
    assert (tangent.def_step, tangent.last_step, tangent.use_steps[-1]) == (11, last, 13)
    # The saved activation: tanh (3) to its backward reader tanh_backward (13). Its last forward
    # reader is sum_1 (5); the detaches exist only to be saved and do not count. Idle gap: the
    # steps strictly between 5 and 13.
    s = buffer_holding(live, "forward:tanh")
    assert (s.def_step, s.last_step) == (3, 13)
    assert (s.last_fw_use, s.first_bw_use) == (5, 13)
    assert s.idle_gap_steps == 7
    assert s.source_step == 3
    assert s.saved == (0,)


def test_live_bytes_by_hand(live):
    w, x, mm, tanh, out, tangent, tbw, grad = 60, 24, 40, 40, 4, 4, 40, 60
    expected = [
        w,  # 0 primals_1
        w + x,  # 1 primals_2
        w + x + mm,  # 2 mm
        w + x + mm + tanh,  # 3 tanh reads mm: both live
        w + x + tanh,  # 4 detach
        w + x + tanh + out,  # 5 sum_1
        w + x + tanh + out,  # 6 detach_1
        w + x + tanh + out,  # 7 t
        w + x + tanh + out,  # 8 output
        w + x + tanh + out,  # 9 detach_1 placeholder
        w + x + tanh + out,  # 10 t placeholder
        w + x + tanh + out + tangent,  # 11 tangents_1
        w + x + tanh + out + tangent,  # 12 expand
        w + x + tanh + out + tangent + tbw,  # 13 tanh_backward
        w + x + out + tangent + tbw + grad,  # 14 mm_1 (the seed: to the end)
        w + x + out + tangent + grad,  # 15 output
    ]
    assert live.live_bytes().tolist() == expected
    assert live.peak_bytes == 192
    assert live.peak_step == 14
    assert live.bytes_by_kind(14) == {
        "parameter": 60,
        "gradient": 60,
        "temporary": 40,
        "input": 24,
        "output": 4,
        "tangent": 4,
    }
    saved_id = buffer_holding(live, "forward:tanh").id
    assert live.bytes_by_kind(7, removed=frozenset({saved_id})) == {"parameter": 60, "input": 24, "output": 4}


def test_live_bytes_is_a_copy(live):
    a = live.live_bytes()
    a[:] = 0
    assert live.live_bytes().max() == 192


def test_saved_tensors(live):
    tanh_buf = buffer_holding(live, "forward:tanh").id
    x_buf = buffer_holding(live, "forward:primals_2").id
    s0, s1 = live.saved
    assert (s0.index, s0.fw_output_index, s0.fw_node, s0.bw_node, s0.buffer) == (0, 1, "detach_1", "detach_1", tanh_buf)
    assert (s0.def_step, s0.first_bw_use, s0.last_bw_use) == (6, 13, 13)
    assert (s0.shape, s0.stride, s0.storage_offset, s0.itemsize, s0.copy_bytes) == ((2, 5), (5, 1), 0, 4, 40)
    assert s0.dtype == "float32" and s0.static and s0.same_view_as_source
    assert s0.evictable and s0.reason == ""
    # x.t(): a transposed view of the input x, 3x2 with strides (1, 3).
    assert (s1.fw_node, s1.buffer, s1.shape, s1.stride, s1.copy_bytes) == ("t", x_buf, (3, 2), (1, 3), 24)
    assert not s1.same_view_as_source
    assert not s1.evictable and s1.reason == "aliases a input"


def test_candidates_and_min_bytes(live):
    tanh_buf = buffer_holding(live, "forward:tanh")
    assert [b.id for b in live.candidates()] == [tanh_buf.id]
    assert [b.id for b in live.candidates(min_bytes=40)] == [tanh_buf.id]
    assert live.candidates(min_bytes=41) == []


def test_saved_user_output_and_parameter_views_are_not_evictable():
    torch.manual_seed(0)
    w = torch.randn(3, 5, requires_grad=True)
    x = torch.randn(2, 3, requires_grad=True)

    def fn(w, x):
        h = torch.tanh(x @ w)
        return h, (h * h).sum()

    # A partition that saves the view w.t() rather than w (the backend's saves w itself).
    live = liveness.analyze(capture_pair(fn, w, x, static=(0,), partition=partition_unaware_of_parameters))
    by_node = {s.fw_node: s for s in live.saved}
    # h is returned to the user and saved: the user owns it.
    assert buffer_holding(live, "forward:tanh").kind is BufferKind.OUTPUT
    assert by_node["tanh"].reason == "aliases a output"
    # w.t() is saved for the gradient of x: a view of the parameter.
    assert by_node["t_1"].reason == "aliases a parameter"
    assert live.candidates() == []
    # Two user outputs, two tangents (the 2x5 one and the scalar one).
    tangents = [b for b in live.buffers if b.kind is BufferKind.TANGENT]
    assert sorted(b.size_bytes for b in tangents) == [4, 40]


def test_views_sharing_a_storage_are_one_buffer():
    # q, k, v split from one 2x12 projection and saved separately: one 96-byte buffer.
    live = liveness.analyze(qkv_pair())
    b = buffer_holding(live, "forward:mm")
    assert b.kind is BufferKind.SAVED
    assert b.size_bytes == 2 * 12 * 4
    assert {"forward:getitem", "forward:getitem_1", "forward:getitem_2"} <= set(b.nodes)
    assert {"backward:getitem", "backward:getitem_1", "backward:getitem_2"} <= set(b.nodes)
    members = [live.saved[i] for i in b.saved]
    assert [m.fw_node for m in members] == ["getitem", "getitem_1", "getitem_2"]
    assert [m.storage_offset for m in members] == [0, 4, 8]
    for m in members:
        # A 2x4 view with row stride 12 spans 1 + 1*12 + 3*1 = 16 elements.
        assert (m.shape, m.stride, m.copy_bytes) == ((2, 4), (12, 1), 64)
        assert not m.same_view_as_source and m.evictable
    assert len({m.view_key for m in members}) == 3
    # Forward readers: mul (7) reads q and k, mul_1 (8) reads v; first backward reader of any view.
    assert b.last_fw_use == 8
    assert b.first_bw_use == live.step_named("backward", "mul_3")
    assert b.last_step == live.step_named("backward", "mul_5")
    # Counted once in the live bytes: at step 7 only w, x and the projection are live besides mul.
    assert live.live_bytes()[7] == 192 + 32 + 96 + 32


def test_tensor_and_its_transpose_are_one_buffer():
    live = liveness.analyze(gram_pair())
    b = buffer_holding(live, "forward:mm")
    assert set(b.nodes) >= {"forward:mm", "forward:t", "backward:mm", "backward:t"}
    assert b.size_bytes == 48
    mm, t = (live.saved[i] for i in b.saved)
    assert (mm.fw_node, mm.shape, mm.stride, mm.same_view_as_source) == ("mm", (2, 6), (6, 1), True)
    assert (t.fw_node, t.shape, t.stride, t.same_view_as_source) == ("t", (6, 2), (1, 6), False)
    assert mm.copy_bytes == t.copy_bytes == 48


def test_placeholder_joins_its_forward_value_across_graphs():
    live = liveness.analyze(mlp4_pair())
    for name in ("tanh", "tanh_1", "tanh_2"):
        b = buffer_holding(live, f"forward:{name}")
        assert f"backward:{name}" in b.nodes
        assert b.kind is BufferKind.SAVED and b.size_bytes == 256
    # tanh_3 is saved through a late detach: the backward placeholder is detach_4.
    assert "backward:detach_4" in buffer_holding(live, "forward:tanh_3").nodes
    assert len(live.candidates()) == 4


def test_fusion_removes_pointwise_temporaries():
    torch.manual_seed(0)
    w = torch.randn(3, 5, requires_grad=True)
    x = torch.randn(2, 3, requires_grad=True)

    def fn(w, x):
        return torch.sin(torch.sin(x @ w)).sum()

    # forward: mm (2), sin (3), sin_1 (4), sum_1 (5); min-cut saves mm and recomputes the sines.
    plain = liveness.analyze(capture_pair(fn, w, x, static=(0,)))
    fused = liveness.analyze(capture_pair(fn, w, x, static=(0,)), assume_fusion=True)
    assert not any(b.fused for b in plain.buffers)
    fused_nodes = {b.nodes[0] for b in fused.buffers if b.fused}
    # sin feeds sin_1 (pointwise), sin_1 feeds sum (a reduction); in the backward sin, cos, mul
    # and cos_1 feed pointwise ops; mul_1 feeds two matmuls and is materialised.
    assert fused_nodes == {
        "forward:sin",
        "forward:sin_1",
        "backward:sin",
        "backward:cos",
        "backward:mul",
        "backward:cos_1",
    }
    w_, x_, mm, out = 60, 24, 40, 4
    assert plain.live_bytes()[:6].tolist() == [
        w_,
        w_ + x_,
        w_ + x_ + mm,
        w_ + x_ + 2 * mm,
        w_ + x_ + 3 * mm,
        w_ + x_ + mm + mm + out,
    ]
    assert fused.live_bytes()[:6].tolist() == [
        w_,
        w_ + x_,
        w_ + x_ + mm,
        w_ + x_ + mm,
        w_ + x_ + mm,
        w_ + x_ + mm + out,
    ]
    # mm is read by sin at step 3, which is computed inside sum_1's kernel (step 5).
    mm_buf = buffer_holding(fused, "forward:mm")
    assert mm_buf.last_fw_use == 5
    assert buffer_holding(plain, "forward:mm").last_fw_use == 3


def test_convolution_workspace_counts_at_its_step():
    torch.manual_seed(0)
    w = torch.randn(2, 1, 3, 3, requires_grad=True)
    x = torch.randn(1, 1, 5, 5)

    def fn(w, x):
        return torch.nn.functional.conv2d(x, w).tanh().sum()

    live = liveness.analyze(capture_pair(fn, w, x, static=(0,)))
    conv = live.step_named("forward", "convolution")
    conv_bw = live.step_named("backward", "convolution_backward")
    out_bytes = 1 * 2 * 3 * 3 * 4  # the 1x2x3x3 output
    ws = [0] * live.num_steps
    ws[conv] = out_bytes  # forward: one output's worth
    ws[conv_bw] = 2 * out_bytes  # backward: twice its grad_output (same shape as the output)
    assert list(live.workspace_bytes) == ws
    # At the convolution: w (72) + x (100) + its output (72) + workspace (72).
    assert live.live_bytes()[conv] == 72 + 100 + 72 + 72
    assert live.bytes_by_kind(conv)["workspace"] == 72


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_safe_softmax_workspace_is_what_the_allocator_measures(dtype):
    """SDPA's math path (dropout or a mask) runs ``aten._safe_softmax``, which allocates a bool
    mask of its input's size, a bool per row and a 0-d fill value inside itself. A sixth
    fresh-user trial's attention blocks measured its 16,900 bytes above the plan at the first
    step (the runtime check named them); the plan counts them now, as the allocator's trace does."""
    from bench.workspace_probe import transient_bytes

    def fn(w, x):
        q, k, v = (x @ w).view(4, 16, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.5).sum()

    torch.manual_seed(0)
    w = torch.randn(16, 48, dtype=dtype, requires_grad=True)
    pair = capture_pair(fn, w, torch.randn(4, 16, 16, dtype=dtype), static=(0,))
    (node,) = pair.forward.graph.find_nodes(op="call_function", target=torch.ops.aten._safe_softmax.default)
    live = liveness.analyze(pair)
    val = node.args[0].meta["val"]  # (the math path computes the scores of bf16 inputs in fp32)
    scores = torch.randn(val.shape, dtype=val.dtype)
    measured, _ = transient_bytes(lambda: torch.ops.aten._safe_softmax.default(scores, *node.args[1:], **node.kwargs))
    assert live.workspace_bytes[live.step_named("forward", node.name)] == measured > scores.numel()


def test_random_op_under_an_rng_state_wrapper_is_counted_at_its_step():
    """``run_and_save_rng_state(native_dropout, x, p, train)`` returns ``(state, (output, mask))``:
    a nested tuple. The dropout's output and mask are allocated at the wrapper's step, with the
    dropout's workspace (its noise in the input's dtype); in the backward, ``run_with_rng_state``
    likewise. A fresh-user trial's bf16 attention blocks, with trinity's recomputed dropout,
    measured every step 9.9% above a plan that counted them from the ``getitem`` on (after the
    events the stream pass had put between) and without the workspace."""
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
    from torch.utils.checkpoint import checkpoint

    from offload_compiler.passes.margins import op_key

    def fn(x, w):
        return checkpoint(lambda h: torch.nn.functional.dropout(h, 0.25) @ w, torch.tanh(x), use_reentrant=False).sum()

    torch.manual_seed(0)
    x = torch.randn(32, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    pair = dynamo_pair(fn, x, w)
    live = liveness.analyze(pair)
    nbytes = 32 * 16 * 4  # the dropout's fp32 input, output and noise; its bool mask is a quarter
    for graph, wrapper in (("forward", run_and_save_rng_state), ("backward", run_with_rng_state)):
        gm = pair.forward if graph == "forward" else pair.backward
        (node,) = (n for n in gm.graph.nodes if n.target is wrapper)
        step = live.step_named(graph, node.name)
        defined = sum(b.size_bytes for b in live.buffers if b.def_step == step and b.on_device)
        assert defined == nbytes + nbytes // 4 + (torch.get_rng_state().numel() if graph == "forward" else 0), (
            graph,
            defined,
        )
        assert live.workspace_bytes[step] == nbytes, graph
        assert op_key(node) == ("aten::native_dropout", (((32, 16), "torch.float32"),))


def test_symbolic_sizes_keep_expressions_and_use_hints():
    box = {}

    def partition(joint, inputs, *, num_fwd_outputs, static_lifetime_input_indices=None, **kw):
        fw, bw = min_cut_rematerialization_partition(joint, inputs, num_fwd_outputs=num_fwd_outputs, **kw)
        box["pair"] = GraphPair(fw, bw, num_fwd_outputs, tuple(static_lifetime_input_indices or ()))
        return fw, bw

    backend = aot_autograd(
        fw_compiler=lambda gm, _: make_boxed_func(gm),
        bw_compiler=lambda gm, _: make_boxed_func(gm),
        partition_fn=partition,
    )
    lin = torch.nn.Linear(3, 5, bias=False)

    def fn(x):
        return torch.tanh(lin(x)).sum()

    torch.compile(fn, backend=backend, dynamic=True)(torch.randn(7, 3)).backward()
    live = liveness.analyze(box["pair"])
    saved = [b for b in live.buffers if b.kind is BufferKind.SAVED]
    assert len(saved) == 1
    b = saved[0]
    # tanh(x @ W.t()) is (s0, 5) fp32: 20 * s0 bytes, 140 with the hint s0 = 7.
    assert b.size_bytes == 140
    assert len(b.size_expr.free_symbols) == 1
    (sym,) = b.size_expr.free_symbols
    assert sympy.simplify(b.size_expr - 20 * sym) == 0
    (st,) = [live.saved[i] for i in b.saved]
    assert not st.static and st.copy_bytes == 140 and st.shape == (7, 5)


def test_missing_fake_value_raises():
    # The docstring promises a ValueError when a node that should hold a tensor has no
    # meta["val"] (a graph not traced with fake tensors); silently skipping it under-counts memory.
    pair = tanh_mm_pair()
    (tanh,) = [n for n in pair.forward.graph.nodes if n.name == "tanh"]
    del tanh.meta["val"]
    with pytest.raises(ValueError):
        liveness.analyze(pair)


def test_meta_device_graph():
    # A graph whose tensors live on a non-CPU device: that device is the compute device.
    live = liveness.analyze(tanh_mm_pair(device="meta"))
    assert live.device == "meta"
    assert all(b.device == "meta" and b.on_device for b in live.buffers)
    assert live.peak_bytes == 192


def test_fusion_models_inductors_addmm_pattern():
    """Inductor's post-grad pass turns ``add(mm(a, b), c)`` into ``addmm(c, a, b)`` at the add: the
    product runs there, so ``a`` and ``b`` stay live up to the add and the product is never
    allocated. A tied weight's gradient (two products added) is the case that broke the GPT
    frontier's measured peak: the head's product moved to the end of the backward."""
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(64, 16, requires_grad=True)

    def fn(w, x):
        h = torch.tanh(x @ w)  # w's first use
        return (h @ w).sum()  # w's second use: dW = mm(x^T, g1) + mm(h^T, g2)

    pair = capture_pair(fn, w, x, static=(0,))
    plain = liveness.analyze(pair)
    fused = liveness.analyze(pair, assume_fusion=True)
    bw = list(pair.backward.graph.nodes)
    adds = [n for n in bw if n.target is torch.ops.aten.add.Tensor]
    (add,) = [a for a in adds if any(m.target is torch.ops.aten.mm.default for m in a.all_input_nodes)]
    a0, a1 = add.args
    assert a0.target is torch.ops.aten.mm.default and a1.target is torch.ops.aten.mm.default
    # Of add(mm_a, mm_b) Inductor fuses mm_b (the pattern with the product second is tried first).
    assert liveness.addmm_fused_into(a1) is add and liveness.addmm_fused_into(a0) is None
    mm_b = buffer_holding(fused, f"backward:{a1.name}")
    assert mm_b.fused and not buffer_holding(plain, f"backward:{a1.name}").fused
    assert not buffer_holding(fused, f"backward:{add.name}").fused  # the addmm's output is allocated
    # mm_b's inputs are read at the add's step, not at mm_b's.
    step = {f"{s.graph}:{s.node}": i for i, s in enumerate(fused.steps)}
    for inp in a1.all_input_nodes:
        root = inp
        while root.op == "call_function" and root.target in (torch.ops.aten.t.default, torch.ops.aten.permute.default):
            root = root.args[0]
        b = buffer_holding(fused, f"backward:{root.name}")
        if b.kind is BufferKind.PARAMETER or b.kind is BufferKind.INPUT:
            continue
        assert b.last_step >= step[f"backward:{add.name}"], (inp, b)


def test_addmm_pattern_needs_a_broadcastable_same_dtype_input():
    torch.manual_seed(0)
    a = torch.randn(8, 4, requires_grad=True)
    b = torch.randn(4, 8, requires_grad=True)
    c = torch.randn(8, 8, 2)  # does not broadcast to (8, 8)

    def fn(a, b, c):
        return (torch.ops.aten.add.Tensor(a @ b, c[..., 0]).sin() + c.sum(-1)).sum()

    def fn_bad(a, b, c):
        return (torch.ops.aten.add.Tensor(a @ b, c[..., 0].double()).sin()).sum()

    good = capture_pair(fn, a, b, c)
    mm = next(n for n in good.forward.graph.nodes if n.target is torch.ops.aten.mm.default)
    assert liveness.addmm_fused_into(mm) is not None
    bad = capture_pair(fn_bad, a, b, c)
    mm = next(n for n in bad.forward.graph.nodes if n.target is torch.ops.aten.mm.default)
    assert liveness.addmm_fused_into(mm) is None  # float64 input: Inductor keeps mm and add apart


def test_addmm_pattern_on_a_gpu_skips_adds_read_only_by_pointwise_ops():
    """Inductor's ``should_prefer_unfused_addmm``: on a GPU an add whose readers are all pointwise
    (through views) keeps its product apart; ``plan`` traces on the CPU for a GPU's figures and
    says so with ``TARGET_DEVICE_KEY`` on the graphs, which liveness follows."""
    from offload_compiler.ir.meta import TARGET_DEVICE_KEY

    torch.manual_seed(0)
    a = torch.randn(8, 4, requires_grad=True)
    b = torch.randn(4, 8, requires_grad=True)
    c = torch.randn(8, 8)

    def pointwise_reader(a, b, c):
        return torch.ops.aten.add.Tensor(a @ b, c).view(64).sin().sum()

    def reduction_reader(a, b, c):
        return torch.ops.aten.add.Tensor(a @ b, c).sum()

    for fn, on_gpu in ((pointwise_reader, False), (reduction_reader, True)):
        pair = capture_pair(fn, a, b, c)
        mm = next(n for n in pair.forward.graph.nodes if n.target is torch.ops.aten.mm.default)
        assert liveness.addmm_fused_into(mm) is not None  # the CPU fuses either way
        assert liveness.addmm_fused_into(mm, "cpu") is not None
        assert (liveness.addmm_fused_into(mm, "cuda") is not None) == on_gpu, fn.__name__
        mm_name = f"forward:{mm.name}"
        assert buffer_holding(liveness.analyze(pair, assume_fusion=True), mm_name).fused
        for gm in (pair.forward, pair.backward):
            gm.meta[TARGET_DEVICE_KEY] = "cuda"
        assert buffer_holding(liveness.analyze(pair, assume_fusion=True), mm_name).fused == on_gpu


def _layout_copies(live) -> dict[str, liveness.Buffer]:
    """The layout copies by the node copied (``"forward:primals_1"``)."""
    return {b.nodes[0].removesuffix(" (layout copy)"): b for b in live.buffers if b.kind is BufferKind.LAYOUT_COPY}


def test_fusion_models_inductors_channels_last_copies_of_saved_inputs():
    """Under its layout optimization (a convolution on the CPU with oneDNN) Inductor copies a
    graph input that a convolution reads and the forward saves to channels-last where the forward
    starts, and saves the copy in its place: the copy is alive to the backward's last reader, while
    the caller still holds the original. ViT's patch embedding measured 88 KiB above its plan
    before the plan counted them."""
    torch.manual_seed(0)
    w = torch.randn(8, 3, 4, 4, requires_grad=True)  # 1,536 bytes
    x = torch.randn(2, 3, 16, 16)  # 6,144 bytes

    def fn(w, x):
        return torch.nn.functional.conv2d(x, w, stride=4).sin().sum()

    pair = capture_pair(fn, w, x, static=(0,))
    fw = list(pair.forward.graph.nodes)
    w_ph, x_ph = fw[0], fw[1]
    saved = {link.fw_node for link in pair.saved_links()}
    assert {w_ph, x_ph} <= saved  # convolution_backward reads both
    assert liveness.inductor_layout_opt(pair.forward)
    assert not _layout_copies(liveness.analyze(pair))  # inner="eager": no copy
    live = liveness.analyze(pair, assume_fusion=True)
    copies = _layout_copies(live)
    assert set(copies) == {f"forward:{w_ph.name}", f"forward:{x_ph.name}"}
    (conv_bw,) = [s.index for s in live.steps if s.graph == "backward" and s.op == "convolution_backward.default"]
    for ph, nbytes in ((w_ph, 1536), (x_ph, 6144)):
        b = copies[f"forward:{ph.name}"]
        assert b.size_bytes == nbytes and b.on_device
        assert (b.def_step, b.last_step) == (live.step_at(ph), conv_bw)
        # The original stays counted as the caller's (a parameter, an input) for the whole step.
        orig = buffer_holding(live, f"forward:{ph.name}")
        assert orig.kind in (BufferKind.PARAMETER, BufferKind.INPUT) and orig.last_step == live.num_steps - 1
    # Saved across the forward/backward boundary: the step ledger counts them as held.
    from offload_compiler.step_budget import kept_saved_bytes

    assert kept_saved_bytes(live, set()) - kept_saved_bytes(liveness.analyze(pair), set()) >= 1536 + 6144
    # Not a candidate for eviction (no FX node holds the copy).
    assert all(b.kind is BufferKind.SAVED for b in live.candidates())
    with torch._inductor.config.patch(layout_optimization=False):
        assert not _layout_copies(liveness.analyze(pair, assume_fusion=True))


def test_channels_last_copy_of_an_unsaved_input_is_a_temporary_and_none_of_a_channels_last_one():
    """An input a convolution reads that the forward does not save is copied for that convolution
    alone (a temporary at its step); an input already channels-last is not copied."""
    torch.manual_seed(0)
    w = torch.randn(8, 3, 4, 4)
    x = torch.randn(2, 3, 16, 16)
    s = torch.randn(8, 1, 1, requires_grad=True)  # its gradient reads the convolution's output alone

    def fn(w, x, s):
        return (torch.nn.functional.conv2d(x, w, stride=4) * s).sum()

    pair = capture_pair(fn, w, x, s)
    assert not {n.name for n in pair.forward.graph.find_nodes(op="placeholder")[:2]} & {
        link.fw_node.name for link in pair.saved_links()
    }
    live = liveness.analyze(pair, assume_fusion=True)
    (conv,) = [s.index for s in live.steps if s.graph == "forward" and s.op == "convolution.default"]
    copies = _layout_copies(live)
    assert {n: (c.size_bytes, c.def_step, c.last_step) for n, c in copies.items()} == {
        "forward:primals_1": (1536, conv, conv),
        "forward:primals_2": (6144, conv, conv),
    }
    pair = capture_pair(fn, w, x.contiguous(memory_format=torch.channels_last), s)
    assert set(_layout_copies(liveness.analyze(pair, assume_fusion=True))) == {"forward:primals_1"}


def test_split_late_addmm_keeps_a_product_where_the_graph_computes_it():
    """Inductor's addmm pattern runs ``add(mm(a, b), c)`` at the add, keeping ``a`` allocated up to
    there (a tied weight's gradient: the head's product made at the start of the backward, added
    to the embedding's at its end, holds the logits' gradient). ``split_late_addmm`` fences the
    product (a second reader stops the pattern) when that frees more than the product holds, and
    liveness then frees ``a`` at the product; not when ``a`` is read after the add anyway, nor
    when the add follows the product at once."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from offload_compiler.ir.ops import FENCE
    from offload_compiler.passes.split_addmm import split_late_addmm

    def late(x, b, c):
        big = x * 2.0  # (256, 512) float32, 512 KiB: freed at the product once split
        prod = torch.mm(big.t(), b)  # (512, 16), 32 KiB
        other = torch.tanh(c) * 3.0  # work between the product and the add
        return torch.ops.aten.add.Tensor(prod, other)

    def read_again(x, b, c):
        big = x * 2.0
        prod = torch.mm(big.t(), b)
        out = torch.ops.aten.add.Tensor(prod, torch.tanh(c) * 3.0)
        return out, big.sum()  # big is read after the add: nothing to free

    def adjacent(x, b, c):
        return torch.ops.aten.add.Tensor(torch.mm((x * 2.0).t(), b), c)

    args = (torch.randn(256, 512), torch.randn(256, 16), torch.randn(512, 16))
    for fn, expect in ((late, 1), (read_again, 0), (adjacent, 0)):
        gm = make_fx(fn, tracing_mode="fake")(*args)
        (mm,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]
        assert liveness.addmm_fused_into(mm) is not None, fn.__name__
        assert split_late_addmm(gm) == expect, fn.__name__
        fences = [n for n in gm.graph.nodes if n.target is FENCE]
        assert len(fences) == expect, fn.__name__
        if expect:
            assert fences[0].args == ([], mm) and fences[0].prev is mm
            assert liveness.addmm_fused_into(mm) is None  # the pattern no longer applies
            assert split_late_addmm(gm) == 0
        assert torch.equal(
            gm(*args)[0] if fn is read_again else gm(*args), (fn(*args)[0] if fn is read_again else fn(*args))
        )


def test_a_larger_tangent_lives_to_its_last_reader():
    """A tangent of more than one element (the gradient of a hidden state that a graph-broken
    step's later pair passes back, made by the autograd engine) is freed at its last reader, as
    measured; only a one-element one (a loss's seed) is counted to the end of the backward."""

    def f(w, x):
        return torch.tanh(x @ w) * 2

    pair = capture_pair(f, torch.randn(5, 5, requires_grad=True), torch.randn(64, 5), static=(0,))
    live = liveness.analyze(pair)
    (tangent,) = [b for b in live.buffers if b.kind is BufferKind.TANGENT]
    assert tangent.size_bytes == 64 * 5 * 4
    assert tangent.last_step == tangent.use_steps[-1] < live.num_steps - 1
