"""CUDA-only tests: each skips itself without a GPU. ``bench/gpu_check.sh`` runs this file.

What only a GPU shows: the copies run on their own streams into pinned host memory, the CUDA
caching allocator (not the CPU trace) measures the peak against the budget, and the runtime check
of the first steps sees CUDA allocations through the profiler and replans on them.
"""

import copy

import pytest
import torch

import offload_compiler
from offload_compiler import measure_peak_device_bytes

from . import models
from .test_step_check import ACT_BYTES, DEPTH, ScratchMLP, scratch_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# The caching allocator rounds every block up to a multiple of 512 bytes, and cuBLAS keeps a
# workspace per stream; a megabyte over the budget is not a miss.
SLACK_BYTES = 1 << 20
REFERENCE = {"eager": "aot_eager", "inductor": "inductor"}


class OnCuda:
    """A model twice on the GPU: compiled with the reference backend and with trinity."""

    def __init__(self, make_model, make_batch, inner, budget="50%", **options):
        torch.manual_seed(0)
        self.device = torch.device("cuda")
        self.ref_model = make_model().to(self.device)
        self.model = copy.deepcopy(self.ref_model)
        self.batch = tuple(t.to(self.device) for t in make_batch())
        self.before = len(offload_compiler.reports())
        self.ref = torch.compile(self.ref_model, backend=REFERENCE[inner])
        opts = {"memory_budget": budget, "inner": inner, "min_offload_bytes": 0, **options}
        self.compiled = torch.compile(self.model, backend="trinity", options=opts)

    def reports(self):
        return offload_compiler.reports()[self.before :]

    def step(self):
        with torch.no_grad():
            for p, q in zip(self.model.parameters(), self.ref_model.parameters()):
                p.copy_(q)
        self.ref(*self.batch).backward()
        self.compiled(*self.batch).backward()
        torch.cuda.synchronize()
        for (name, p), q in zip(self.model.named_parameters(), self.ref_model.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"grad of {n}: {m}")
        self.model.zero_grad(set_to_none=True)
        self.ref_model.zero_grad(set_to_none=True)

    def measured_peak(self) -> int:
        """Peak device bytes of one trinity step, less what else the process holds on the GPU (the
        reference model), plus the pair's own parameters and batch."""
        self.model.zero_grad(set_to_none=True)
        self.ref_model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        own = sum(p.numel() * p.element_size() for p in self.model.parameters())
        own += sum(t.numel() * t.element_size() for t in self.batch)
        other = torch.cuda.memory_allocated() - own
        m = measure_peak_device_bytes(lambda: self.compiled(*self.batch).backward(), device=self.device)
        self.model.zero_grad(set_to_none=True)
        return m.peak_bytes - other


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_gpt_on_cuda_matches_and_stays_within_budget(inner):
    run = OnCuda(models.GPTLoss, lambda: models.gpt_batch(n=64, t=32), inner)
    for _ in range(3):
        run.step()
    (r,) = run.reports()
    assert r.device.startswith("cuda") and r.num_evicted > 0, r.summary()
    stats = r.runtime_stats()
    assert stats.host_pool.pinned and stats.bytes_d2h > 0 and stats.pending_copies == 0
    assert r.measured_peak_bytes is not None
    peak = run.measured_peak()
    assert peak <= r.budget_bytes + SLACK_BYTES, f"measured {peak}\n{r.summary()}"


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_runtime_check_replans_on_cuda_allocations(inner):
    run = OnCuda(lambda: ScratchMLP(factor=2), scratch_batch, inner)
    run.step()
    (first,) = run.reports()
    assert first.measured_peak_bytes > first.budget_bytes >= first.peak_bytes_planned, first.summary()
    run.step()
    (r,) = run.reports()
    assert r.correction is not None, r.summary()
    scratch = [m for m in r.correction.margins if m[1] == "trinity_test::scratch_tanh"]
    assert len(scratch) == DEPTH and all(b >= 2 * ACT_BYTES for _, _, b in scratch), r.correction
    assert r.measured_peak_bytes <= r.budget_bytes, r.summary()
    assert run.measured_peak() <= r.budget_bytes + SLACK_BYTES


def test_check_agrees_with_the_allocator():
    run = OnCuda(models.MLP, models.mlp_batch, "eager")
    run.step()
    run.step()
    (r,) = run.reports()
    assert r.correction is None
    peak = run.measured_peak()
    assert abs(r.measured_peak_bytes - peak) <= SLACK_BYTES + peak // 50, (r.measured_peak_bytes, peak)


def test_calibrate_on_cuda():
    from offload_compiler.calibrate import CALIBRATION_FIELDS, calibrate

    figures = calibrate("cuda", quick=True)
    cpu_only = ("h2d_overhead_s", "d2h_overhead_s")  # synchronous copies' runtime calls
    assert all(figures[k] > 0 for k in CALIBRATION_FIELDS if k not in cpu_only)
    assert not any(k in figures for k in cpu_only)
    assert figures["h2d_bytes_per_s"] > 1e9 and figures["flops_bf16"] > 1e12


def test_evict_into_declared_strides_on_cuda():
    """An evict whose declared strides differ from its source's (Inductor laid the source out
    otherwise) stages the source on the device in the declared layout on the copy stream and
    copies those bytes into a pinned block: the values arrive once ``evict_wait`` returns, the
    host tensor has the declared strides, and a write to the source after the wait leaves the
    host copy alone."""
    from offload_compiler.runtime.transfer import TransferRuntime

    ops = torch.ops.trinity
    rt = TransferRuntime(torch.device("cuda"), 1 << 26)
    src = torch.randn(8, 64, 32, 32, device="cuda")
    expected = src.cpu()
    declared = src.to(memory_format=torch.channels_last).stride()
    host = ops.evict(src, rt.id, list(declared))
    assert host.stride() == declared and host.is_pinned()
    ops.evict_wait(host, src, rt.id)
    torch.cuda.current_stream().synchronize()
    src.fill_(0)
    assert torch.equal(host, expected)
