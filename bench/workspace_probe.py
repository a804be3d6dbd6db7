"""Measure op-internal workspace (bytes allocated and freed inside one op) on this machine.

The factors in offload_compiler/passes/liveness.py (_WORKSPACE) come from this script:
``python bench/workspace_probe.py`` prints, per op, the transient bytes as a multiple of the
reference tensor's bytes, from torch.profiler's allocator trace.
"""

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

aten = torch.ops.aten


def transient_bytes(fn) -> tuple[int, int]:
    """(peak minus end, end) of bytes allocated during ``fn()``."""
    fn()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()  # noqa: F841  (kept alive so its outputs count as kept, not transient)
    events = []

    def walk(node):
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    events.sort()
    cur = peak = 0
    for _, size in events:
        cur += size
        peak = max(peak, cur)
    return peak - cur, cur


def main() -> None:
    x = torch.randn(32, 16, 16, 16)
    w = torch.randn(16, 16, 3, 3)
    b = torch.randn(16)
    q = torch.randn(32, 4, 64, 16)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(q, q, q, 0.0, True)
    rm, rv = torch.zeros(16), torch.ones(16)
    bn = aten._native_batch_norm_legit_functional.default(x, b, b, rm, rv, True, 0.1, 1e-5)
    a = torch.randn(2048, 256)
    m = torch.randn(256, 256)
    a16 = a.bfloat16()
    drop_mask = aten.native_dropout.default(a, 0.1, True)[1]
    probes = {
        "convolution (x output)": (
            lambda: aten.convolution.default(x, w, b, [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
            x,
        ),
        "convolution_backward (x grad_output)": (
            lambda: aten.convolution_backward.default(
                x, x, w, [16], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True] * 3
            ),
            x,
        ),
        "sdpa flash cpu forward (x q)": (
            lambda: aten._scaled_dot_product_flash_attention_for_cpu.default(q, q, q, 0.0, True),
            q,
        ),
        "sdpa flash cpu backward (x grad_out)": (
            lambda: aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
                out, q, q, q, out, lse, 0.0, True
            ),
            q,
        ),
        "native_batch_norm_backward (x grad_out)": (
            lambda: aten.native_batch_norm_backward.default(x, x, b, rm, rv, bn[1], bn[2], True, 1e-5, [True] * 3),
            x,
        ),
        "mm (x input)": (lambda: aten.mm.default(a, m), a),
        "mse_loss mean (x input)": (lambda: aten.mse_loss.default(a, a, 1), a),
        "native_dropout train (x input)": (lambda: aten.native_dropout.default(a, 0.1, True), a),
        "native_dropout train, bf16 (x input)": (lambda: aten.native_dropout.default(a16, 0.1, True), a16),
        "native_dropout_backward (x grad)": (
            lambda: aten.native_dropout_backward.default(a, drop_mask, 1 / 0.9),
            a,
        ),
        "native_dropout_backward, bf16 (x grad)": (
            lambda: aten.native_dropout_backward.default(a16, drop_mask, 1 / 0.9),
            a16,
        ),
    }
    scores = torch.randn(8, 2, 32, 32)
    print(f"torch {torch.__version__}, device cpu")
    for t in (scores, scores.bfloat16()):
        transient, _ = transient_bytes(lambda t=t: aten._safe_softmax.default(t, -1))
        rows = t.numel() // t.shape[-1]
        print(
            f"_safe_softmax {t.dtype}: transient {transient} bytes = numel {t.numel()} + rows {rows} "
            f"+ {transient - t.numel() - rows} (_WORKSPACE_FN: numel + rows + element_size {t.element_size()})"
        )
    loss = aten.mse_loss.default(a, a, 1)
    print(
        f"mse_loss mean output: {tuple(loss.shape)}, storage {loss.untyped_storage().nbytes()} bytes "
        f"= {loss.untyped_storage().nbytes() / (a.numel() * a.element_size()):.2f}x input (_OUTPUT_STORAGE)"
    )
    for name, (fn, ref) in probes.items():
        transient, _ = transient_bytes(fn)
        print(f"{name:45s} transient {transient:>10d} bytes = {transient / (ref.numel() * ref.element_size()):.2f}x")


if __name__ == "__main__":
    main()
