"""Low-rank gradient communication for DDP: PowerSGD with a per-layer rank from each gradient's
stable rank.

**Opt-in, and it changes the training numerics**: the gradients DDP averages are low-rank
approximations (with error feedback, so what is left out is sent later, not lost). Use it where
``plan --world`` says compression pays; across 200+ realistic setups plain synchronous data
parallelism was faster in all but a handful (Agarwal et al., "On the Utility of Gradient
Compression in Distributed Training Systems", MLSys 2022).

Usage::

    from offload_compiler.comm import AdaptivePowerSGDState, adaptive_powersgd_hook

    ddp = DistributedDataParallel(model)
    state = AdaptivePowerSGDState(process_group=None)  # 20 full-rank steps first, then adaptive ranks
    ddp.register_comm_hook(state, adaptive_powersgd_hook)
    ...
    state.bytes_per_step  # bytes this rank all-reduced in each step

The algorithm is torch's PowerSGD (Vogels et al., NeurIPS 2019; ``torch.distributed.algorithms.
ddp_comm_hooks.powerSGD_hook``), on torch's :class:`PowerSGDState` (error feedback, warm-started
``Q``, the same seeded initialisation on every rank), with the rank chosen per layer as
Cuttlefish (Wang et al., MLSys 2023) and Pufferfish (Wang et al., MLSys 2021) do:

* the first ``warmup_steps`` steps all-reduce the full gradients;
* on the last warm-up step, and again every ``reevaluate_every`` steps, the step is a full
  all-reduce (which also flushes the error-feedback memory) and, on the averaged gradient ``G``
  of each matrix, the hook estimates the stable rank ``||G||_F^2 / ||G||_2^2`` with
  ``power_iterations`` power iterations (``||G||_2`` from below, so the estimate errs high);
* the rank is ``ceil(rank_scale * stable rank)``, at least ``min_rank``, at most ``max_rank``
  and at most ``n m / (2 (n + m))`` for an ``n x m`` gradient, so the compressed size
  ``(n + m) r`` is at most half of ``n m``; vectors, matrices where no rank >= ``min_rank``
  fits that cap, and matrices under ``min_compress_numel`` elements are sent uncompressed;
* the ranks are agreed with a tiny all-reduce (maximum over the ranks), so every process
  allocates the same ``P`` and ``Q``.

**Collective order.** torch's hook issues its second and third all-reduce from future
callbacks; with several buckets the ranks then issue collectives in different orders, and gloo
hangs (see /work/shared/TORCH_NOTES.md). Here every collective is issued from the hook's own
body, which DDP calls in bucket order on every rank: the hook for bucket ``b`` first finishes
bucket ``b - 1`` (waits for its ``P`` all-reduce, computes and issues its ``Q`` all-reduce),
then issues bucket ``b``'s ``P`` all-reduce; the last bucket finishes itself. Callbacks only do
local arithmetic (decompression, the error update).
"""

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, _orthogonalize

__all__ = ["AdaptivePowerSGDState", "adaptive_powersgd_hook", "stable_rank", "choose_rank", "rank_cap"]


def rank_cap(n: int, m: int) -> int:
    """The largest rank whose factors ``(n + m) r`` are at most half of ``n m`` elements."""
    return (n * m) // (2 * (n + m))


def stable_rank(matrix: torch.Tensor, power_iterations: int = 4, generator: torch.Generator | None = None) -> float:
    """``||M||_F^2 / ||M||_2^2`` of a 2-D ``matrix`` (``[n, m]``), ``||M||_2`` estimated by
    ``power_iterations`` power iterations on ``M^T M`` from a random start (``generator``, on the
    CPU). Equals the rank for a matrix whose nonzero singular values are equal; 0 for a zero
    matrix.

    Raises:
        ValueError: for a tensor that is not 2-D or ``power_iterations < 1``.
    """
    if matrix.dim() != 2:
        raise ValueError(f"stable_rank: expected a 2-D matrix, got shape {tuple(matrix.shape)}")
    if power_iterations < 1:
        raise ValueError(f"stable_rank: power_iterations must be >= 1, got {power_iterations}")
    m = matrix.detach().double()
    fro2 = float((m * m).sum())
    if fro2 == 0.0:
        return 0.0
    v = torch.randn(m.shape[1], generator=generator, dtype=torch.float64).to(m.device)
    v /= v.norm()
    for _ in range(power_iterations):
        v = m.T @ (m @ v)
        norm = v.norm()
        if norm == 0:
            return 0.0
        v /= norm
    sigma2 = float((m @ v).square().sum())
    return fro2 / sigma2 if sigma2 > 0 else 0.0


def choose_rank(
    srank: float, n: int, m: int, rank_scale: float = 1.0, min_rank: int = 1, max_rank: int | None = None
) -> int:
    """The rank for an ``n x m`` gradient of stable rank ``srank``: ``ceil(rank_scale * srank)``
    clamped to ``[min_rank, max_rank]`` and to :func:`rank_cap`; 0 (send uncompressed) when
    the cap is below ``min_rank``."""
    cap = rank_cap(n, m)
    if max_rank is not None:
        cap = min(cap, max_rank)
    if cap < min_rank:
        return 0
    return max(min_rank, min(cap, math.ceil(rank_scale * srank * (1 - 1e-6))))  # float noise above an integer


class AdaptivePowerSGDState(PowerSGDState):
    """torch's :class:`PowerSGDState` plus the adaptive-rank settings and the byte counters.

    Args:
        process_group: the data-parallel group (``None``: the default group).
        warmup_steps: full-rank steps first (torch's ``start_powerSGD_iter``; >= 2, because DDP
            rebuilds its buckets after the first step).
        reevaluate_every: every this many steps after the warm-up, one full-rank step
            re-estimates the stable ranks (>= 2).
        power_iterations: power iterations per stable-rank estimate (>= 1).
        rank_scale, min_rank, max_rank: the rank rule (module docstring). The defaults (4, 2,
            none) and ``warmup_steps=20`` are what kept the demo GPT within 2% of plain DDP's loss
            at a fifth of its bytes (``bench/results/powersgd_cpu.json``); with ``rank_scale=1``
            it sent 10% and lost 4%. Tune them for your model.
        min_compress_numel: matrices with fewer elements are sent uncompressed.
        orthogonalization_epsilon, random_seed: as in torch's state.

    Attributes:
        ranks: ``{bucket index: [rank per tensor]}`` (0 = uncompressed) in use.
        stable_ranks: ``{bucket index: [estimate per tensor]}`` (``nan`` for vectors).
        bytes_per_step: bytes this process all-reduced in each finished step.
        full_bytes_per_step: bytes plain DDP would have all-reduced in each step.

    Raises:
        ValueError: for a setting out of range.
    """

    def __init__(
        self,
        process_group=None,
        warmup_steps: int = 20,
        reevaluate_every: int = 50,
        power_iterations: int = 4,
        rank_scale: float = 4.0,
        min_rank: int = 2,
        max_rank: int | None = None,
        min_compress_numel: int = 4096,
        orthogonalization_epsilon: float = 1e-8,
        random_seed: int = 0,
    ):
        for name, value, low in (
            ("warmup_steps", warmup_steps, 2),
            ("reevaluate_every", reevaluate_every, 2),
            ("power_iterations", power_iterations, 1),
            ("min_rank", min_rank, 1),
        ):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"AdaptivePowerSGDState: {name} must be an int >= {low}, got {value!r}")
        if not rank_scale > 0:
            raise ValueError(f"AdaptivePowerSGDState: rank_scale must be > 0, got {rank_scale!r}")
        if max_rank is not None and (not isinstance(max_rank, int) or max_rank < min_rank):
            raise ValueError(f"AdaptivePowerSGDState: max_rank must be None or an int >= min_rank, got {max_rank!r}")
        super().__init__(
            process_group,
            matrix_approximation_rank=1,
            start_powerSGD_iter=warmup_steps,
            min_compression_rate=2,
            use_error_feedback=True,
            warm_start=True,
            orthogonalization_epsilon=orthogonalization_epsilon,
            random_seed=random_seed,
        )
        self.reevaluate_every = reevaluate_every
        self.power_iterations = power_iterations
        self.rank_scale = float(rank_scale)
        self.min_rank = min_rank
        self.max_rank = max_rank
        self.min_compress_numel = int(min_compress_numel)
        self.random_seed = random_seed
        self.ranks: dict[int, list[int]] = {}
        self.stable_ranks: dict[int, list[float]] = {}
        self.bytes_per_step: list[int] = []
        self.full_bytes_per_step: list[int] = []
        self._fresh: dict[int, list[float]] = {}
        self._pending: _Pending | None = None
        self._bytes = 0
        self._full_bytes = 0

    def is_full_step(self, step: int) -> bool:
        """Whether step ``step`` all-reduces full gradients (warm-up or re-evaluation)."""
        if step < self.start_powerSGD_iter:
            return True
        return (step - self.start_powerSGD_iter + 1) % self.reevaluate_every == 0

    def compression_ratio(self) -> float:
        """Bytes sent over bytes plain DDP would send, over all finished steps."""
        full = sum(self.full_bytes_per_step)
        return sum(self.bytes_per_step) / full if full else 1.0


@dataclass
class _Pending:
    """A bucket whose P all-reduce is in flight; its Q round is still to be issued."""

    index: int
    buffer: torch.Tensor
    views: list
    ranks: list[int]
    matrices: list
    ps: list
    qs: list
    p_flat: torch.Tensor
    p_offset: int
    unc_views: list
    work: object
    result: torch.futures.Future
    errors: list
    world: int
    q_flat: torch.Tensor = field(default=None)


def _group(state):
    return state.process_group if state.process_group is not None else dist.distributed_c10d._get_default_group()


def _all_reduce(group, tensor: torch.Tensor, op=None):
    if op is None:
        return group.allreduce([tensor]).get_future()
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    return group.allreduce([tensor], opts).get_future()


def _views(bucket) -> list[torch.Tensor]:
    buf = bucket.buffer()
    views, offset = [], 0
    for p in bucket.parameters():
        n = p.numel()
        views.append(buf[offset : offset + n].view(p.shape))
        offset += n
    if offset != buf.numel():
        raise RuntimeError(f"adaptive_powersgd_hook: bucket {bucket.index()} holds {buf.numel()} elements, "
                           f"its parameters {offset}")  # fmt: skip
    return views


def _offsets(views: list) -> list[int]:
    out, off = [], 0
    for v in views:
        out.append(off)
        off += v.numel()
    return out


def _estimate(state, index: int, reduced: torch.Tensor, shapes: list) -> None:
    """Stable ranks of each matrix in the averaged bucket ``reduced`` (local arithmetic only)."""
    g = torch.Generator().manual_seed(state.random_seed * 1_000_003 + index)
    out, offset = [], 0
    for shape in shapes:
        numel = math.prod(shape)
        if len(shape) < 2:
            out.append(float("nan"))
        else:
            out.append(stable_rank(reduced[offset : offset + numel].view(shape[0], -1), state.power_iterations, g))
        offset += numel
    state._fresh[index] = out


def _decide_ranks(state, group, index: int, views: list) -> list[int]:
    """Per-tensor ranks from the fresh estimates, agreed across processes (maximum)."""
    est = state._fresh.pop(index)
    ranks = []
    for v, s in zip(views, est):
        if v.dim() < 2 or v.numel() < state.min_compress_numel or math.isnan(s):
            ranks.append(0)
            continue
        n, m = v.shape[0], v.numel() // v.shape[0]
        ranks.append(choose_rank(s, n, m, state.rank_scale, state.min_rank, state.max_rank))
    agreed = torch.tensor(ranks, dtype=torch.float32)
    _all_reduce(group, agreed, dist.ReduceOp.MAX).wait()
    state._bytes += agreed.numel() * agreed.element_size()
    state.stable_ranks[index] = est
    return [int(r) for r in agreed.tolist()]


def _finish_pending(state, group) -> None:
    """Wait for the pending bucket's P all-reduce, compute its Q and issue the Q all-reduce."""
    pend = state._pending
    if pend is None:
        return
    state._pending = None
    try:
        pend.work.wait()
        for p in pend.ps:
            _orthogonalize(p.unsqueeze(0), state.orthogonalization_epsilon)
        for mat, p, q in zip(pend.matrices, pend.ps, pend.qs):
            torch.matmul(mat.T, p, out=q)
        fut = _all_reduce(group, pend.q_flat)
        state._bytes += pend.q_flat.numel() * pend.q_flat.element_size()
    except Exception as exc:  # never leave DDP waiting on a future nobody completes
        pend.result.set_exception(exc)
        return

    def decompress(f):
        try:
            world = pend.world
            unc = pend.p_flat[: pend.p_offset].div_(world)
            off = 0
            for v in pend.unc_views:
                v.copy_(unc[off : off + v.numel()].view_as(v))
                off += v.numel()
            pend.q_flat.div_(world)
            for mat, e, p, q in zip(pend.matrices, pend.errors, pend.ps, pend.qs):
                approx = p @ q.T
                torch.sub(mat, approx, out=e)  # error feedback: what this step left out
                mat.copy_(approx)
            pend.result.set_result(pend.buffer)
        except Exception as exc:
            pend.result.set_exception(exc)

    fut.then(decompress)


def adaptive_powersgd_hook(state: AdaptivePowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: PowerSGD with per-layer adaptive ranks (module docstring).

    Register with ``ddp.register_comm_hook(state, adaptive_powersgd_hook)``. ``bucket`` is DDP's
    ``GradBucket`` (its flat ``buffer()`` holds the gradients of ``parameters()`` in order).
    Returns a future of the averaged (or low-rank averaged) bucket, in place.
    """
    group = _group(state)
    world = group.size()
    buf = bucket.buffer()
    index = bucket.index()
    step = state.iter
    last = bucket.is_last()
    elem = buf.element_size()
    state._full_bytes += buf.numel() * elem
    _finish_pending(state, group)  # the previous bucket's Q round goes first, on every rank
    views = _views(bucket)
    full = state.is_full_step(step) or (index not in state.ranks and index not in state._fresh)
    if not full and index in state._fresh:
        ranks = _decide_ranks(state, group, index, views)
        if ranks != state.ranks.get(index):
            state.ranks[index] = ranks
            state.p_memory_dict.pop(index, None)
            state.q_memory_dict.pop(index, None)
    if not full and not any(state.ranks[index]):
        full = True  # nothing in this bucket gains from compression
    if full:
        errors = state.error_dict.pop(index, None)
        if errors is not None:
            buf.add_(errors)  # the full all-reduce sends what earlier steps left out
        estimate = step >= 1 and not state.is_full_step(step + 1)
        shapes = [tuple(v.shape) for v in views]
        fut = _all_reduce(group, buf)
        state._bytes += buf.numel() * elem

        def average(f):
            out = f.value()[0].div_(world)
            if estimate:
                _estimate(state, index, out, shapes)
            return out

        result = fut.then(average)
    else:
        ranks = state.ranks[index]
        errors = state.error_dict.get(index)
        if errors is None or errors.numel() != buf.numel():
            errors = torch.zeros_like(buf)
            state.error_dict[index] = errors
        buf.add_(errors)  # error feedback in (zero outside the compressed matrices)
        err_views = [errors[o : o + v.numel()].view(v.shape[0], -1) for o, v in zip(_offsets(views), views)]
        comp = [(v, r, e) for v, r, e in zip(views, ranks, err_views) if r > 0]
        unc_views = [v for v, r in zip(views, ranks) if r == 0]
        matrices = [v.view(v.shape[0], -1) for v, _, _ in comp]
        p_numel = sum(m.shape[0] * r for m, (_, r, _) in zip(matrices, comp))
        q_numel = sum(m.shape[1] * r for m, (_, r, _) in zip(matrices, comp))
        new_q = index not in state.q_memory_dict
        if new_q:
            state.q_memory_dict[index] = torch.empty(q_numel, device=buf.device, dtype=buf.dtype)
        unc_numel = sum(v.numel() for v in unc_views)
        p_flat = torch.empty(unc_numel + p_numel, device=buf.device, dtype=buf.dtype)
        q_flat = state.q_memory_dict[index]
        ps, qs, po, qo = [], [], unc_numel, 0
        for mat, (_, r, _) in zip(matrices, comp):
            n, m = mat.shape
            ps.append(p_flat[po : po + n * r].view(n, r))
            qs.append(q_flat[qo : qo + m * r].view(m, r))
            po += n * r
            qo += m * r
        if new_q:  # the same seeded start on every rank, fresh each time ranks change
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(state.rng.randint(1_000_000_000)))
                for q in qs:
                    q.copy_(torch.randn(*q.shape, device="cpu", dtype=buf.dtype))
        for q in qs:
            _orthogonalize(q.unsqueeze(0), state.orthogonalization_epsilon)
        off = 0
        for v in unc_views:
            p_flat[off : off + v.numel()].copy_(v.reshape(-1))
            off += v.numel()
        for mat, p, q in zip(matrices, ps, qs):
            torch.matmul(mat, q, out=p)
        work = _all_reduce(group, p_flat)
        state._bytes += p_flat.numel() * p_flat.element_size()
        devices = [buf.device] if buf.device.type == "cuda" else None
        result = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
        state._pending = _Pending(
            index, buf, [v for v, _, _ in comp], [r for _, r, _ in comp], matrices, ps, qs, p_flat, unc_numel,
            unc_views, work, result, [e for _, _, e in comp], world, q_flat,
        )  # fmt: skip
        state.total_numel_before_compression += buf.numel()
        state.total_numel_after_compression += p_flat.numel() + q_flat.numel()
    if last:
        _finish_pending(state, group)
        state.bytes_per_step.append(state._bytes)
        state.full_bytes_per_step.append(state._full_bytes)
        state._bytes = state._full_bytes = 0
    state.maybe_increase_iter(bucket)
    return result
