"""``python -m offload_compiler plan``: will this model's training step fit, and how fast?

Traces the training step on fake tensors (nothing real is allocated: a 70B model plans on a
laptop) through the backend's own partition entry, with the same arguments, plans it for each
budget through the backend's planning spine (:func:`offload_compiler.pipeline.plan_pair`, the
very function ``torch.compile(backend="trinity")`` calls) against a device's figures, and prints
a table: parameters, the peak without offloading,
the planned peak, the predicted step time and the copy time left exposed. Optimizer state
(``adamw``: two tensors per parameter; ``sgd``: one momentum tensor; ``none``) is resident device
memory and counts in every peak, except with ``--offload all``. ``--offload`` plans model-state
offloading as the backend's option does: with ``activations+params`` or ``all`` the parameters
are fetched around their uses (:mod:`.passes.param_residency`), with ``all`` gradients and
optimizer state live in host memory; the host bytes are reported and the parameter copies are
part of the simulated step. With ``all`` the host optimizer update is part of it too (the same
:func:`~.passes.param_residency.step_timeline` and :mod:`.passes.optimizer_split` as the backend,
through the spine: ``--cpu-optimizer``, ``--overlap`` and ``--optimizer-on-device`` as
``CPUOptimizer`` and the option say; ``--host-bandwidth`` states the host's memory bandwidth),
and the host-update seconds per step are printed. ``--strategy`` chooses how saved activations
meet a budget, as the backend's option does: ``auto`` (keep, offload or recompute, the joint
planner of :mod:`.passes.plan_recompute`), ``offload`` or ``recompute``; the ``recompute`` column
shows what is recomputed in the backward and its predicted seconds. It draws the memory/time
frontier over the budgets as a PNG and names the smallest budget whose predicted step is within
5% of the step without offloading. ``plan --world N`` plans multi-GPU layouts instead
(:mod:`.world_plan`).
``--json FILE`` writes the rows for scripts. ``--inner`` is the inner compiler assumed (the
backend's default, Inductor, for ``--offload activations``; parameter offload needs ``eager``).

This is the "impossible trinity" made explicit: a larger model, a faster step or a cheaper GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .devices import KNOWN_DEVICES, DeviceSpec, lookup_device
from .ir.meta import TARGET_DEVICE_KEY
from .options import MemoryBudget, TrinityOptions, format_bytes, parse_size
from .passes import cost_model, param_residency, plan_recompute
from .trace import TracedStep

__all__ = ["PlanRow", "PlanResult", "plan_model", "plan_step", "default_inner", "model_builder", "HFCausalLM", "main"]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "none": 0}


@dataclass(frozen=True)
class PlanRow:
    """One budget's plan (bytes include the optimizer state when it is on the device; seconds are
    predictions, with every copy the step issues). An infeasible row is the lowest-peak plan.
    ``lowest_reachable_bytes``: the peak with every offload candidate at its tightest window given
    the row's recomputation (see :attr:`~offload_compiler.report.TrinityReport.lowest_reachable_peak_bytes`):
    the lowest any plan reaches in an infeasible row, and in every row of ``--strategy offload``."""

    budget: str
    budget_bytes: int
    planned_peak_bytes: int
    lowest_reachable_bytes: int
    feasible: bool
    predicted_step_seconds: float
    exposed_seconds: float
    evicted_bytes: int
    num_evicted: int
    fits_device: bool
    host_bytes: int = 0
    peak_step: int = -1
    update_seconds: float = 0.0
    exposed_update_seconds: float = 0.0
    device_share: float = 0.0
    recomputed_bytes: int = 0
    num_recomputed: int = 0
    recompute_seconds: float = 0.0
    recompute_flops: int = 0
    chosen: str = ""
    solver_bound_seconds: float | None = None
    peak_breakdown: tuple[tuple[str, int], ...] = ()
    """Device bytes by buffer kind at the row's planned peak (the training step's graphs; the
    optimizer state is apart), largest first."""

    def to_json(self) -> dict:
        """The row for scripts: budget, planned peak, lowest reachable, predicted step, exposed
        copy, host bytes, fits (bytes and seconds; the step figures are ``None`` when the
        budget is infeasible)."""
        ok = self.feasible
        return {
            "budget": self.budget,
            "budget_bytes": self.budget_bytes,
            "planned_peak_bytes": self.planned_peak_bytes,
            "lowest_reachable_bytes": self.lowest_reachable_bytes,
            "predicted_step_seconds": self.predicted_step_seconds if ok else None,
            "exposed_copy_seconds": self.exposed_seconds if ok else None,
            "host_bytes": self.host_bytes,
            "evicted_bytes": self.evicted_bytes,
            "num_evicted": self.num_evicted,
            "peak_step": self.peak_step,
            "update_seconds": self.update_seconds if ok else None,
            "exposed_update_seconds": self.exposed_update_seconds if ok else None,
            "optimizer_on_device_share": self.device_share,
            "recomputed_bytes": self.recomputed_bytes,
            "num_recomputed": self.num_recomputed,
            "recompute_seconds": self.recompute_seconds,
            "recompute_flops": self.recompute_flops,
            "chosen": self.chosen,
            "solver_bound_seconds": self.solver_bound_seconds,
            "feasible": ok,
            "fits": ok and self.fits_device,
        }


@dataclass(frozen=True)
class PlanResult:
    model: str
    device: DeviceSpec
    num_params: int
    param_bytes: int
    optimizer_state_bytes: int
    unplanned_peak_bytes: int
    compute_seconds: float
    rows: tuple[PlanRow, ...]
    trace_seconds: float
    plan_seconds: float
    offload: str = "activations"
    host_model_state_bytes: int = 0
    inner: str = "inductor"
    strategy: str = "offload"
    update: str = ""

    def reference_step_seconds(self) -> float | None:
        """The step the budgets are compared with (seconds): with ``offload="activations"`` the
        step without offloading (:attr:`compute_seconds`); with parameters or the whole model
        state on the host, every budget pays their copies and the host update, so the fastest
        feasible row's step (``None`` when no row is feasible)."""
        if self.offload == "activations":
            return self.compute_seconds
        steps = [r.predicted_step_seconds for r in self.rows if r.feasible]
        return min(steps) if steps else None

    def within_5_percent(self) -> PlanRow | None:
        """The feasible row with the smallest budget whose step is within 5% of
        :meth:`reference_step_seconds`."""
        ref = self.reference_step_seconds()
        if ref is None:
            return None
        ok = [r for r in self.rows if r.feasible and r.predicted_step_seconds <= 1.05 * ref]
        return min(ok, key=lambda r: r.budget_bytes) if ok else None

    def to_json(self) -> dict:
        """The result for scripts (``plan --json``): the model, the device figures, and one row
        per budget (:meth:`PlanRow.to_json`)."""
        return {
            "model": self.model,
            "device": self.device.name,
            "device_memory_bytes": self.device.memory_bytes,
            "offload": self.offload,
            "inner": self.inner,
            "strategy": self.strategy,
            "update": self.update,
            "num_params": self.num_params,
            "param_bytes": self.param_bytes,
            "optimizer_state_bytes": self.optimizer_state_bytes,
            "host_model_state_bytes": self.host_model_state_bytes,
            "unplanned_peak_bytes": self.unplanned_peak_bytes,
            "compute_seconds": self.compute_seconds,
            "trace_seconds": self.trace_seconds,
            "plan_seconds": self.plan_seconds,
            "rows": [r.to_json() for r in self.rows],
        }


def model_builder(model, seq_len: int, hf_overrides: dict):
    """``(build, vocab_size)`` for a preset (its name, or a :class:`~.models.presets.Preset`
    built by the caller) or ``hf:<model_type>``: ``build()`` makes the module (token ids in,
    logits out).

    Raises:
        ValueError: for an unknown model, a sequence too long for it, or ``hf:`` without
            transformers.
    """
    from .models.presets import Preset, get_preset

    if isinstance(model, Preset):
        preset = model
        if preset.max_seq_len is not None and seq_len > preset.max_seq_len:
            raise ValueError(f"model {preset.name!r} takes sequences up to {preset.max_seq_len}, got {seq_len}")
        return (lambda: preset.build(seq_len)), preset.vocab_size
    if model.startswith("hf:"):
        try:
            from transformers import AutoConfig, AutoModelForCausalLM
        except ImportError:
            raise ValueError(f"model {model!r} needs the transformers package (pip install transformers)") from None
        model_type = model[3:]
        try:
            default = AutoConfig.for_model(model_type)
        except (ValueError, KeyError):
            import difflib

            from transformers.models.auto.configuration_auto import CONFIG_MAPPING

            near = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=5, cutoff=0.6)
            hint = f"; closest: {', '.join(near)}" if near else "; e.g. hf:gpt2, hf:llama, hf:mistral, hf:qwen2"
            raise ValueError(f"model {model!r}: transformers has no model type {model_type!r}{hint}") from None
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise ValueError(
                f"model {model!r}: plan traces causal language models (token ids in, next-token loss), and "
                f"transformers has no causal LM for {model_type!r}; e.g. hf:gpt2, hf:llama, hf:mistral, hf:qwen2"
            )
        for key, value in hf_overrides.items():
            before = getattr(default, key, None)
            if (
                isinstance(value, int)
                and not isinstance(value, bool)
                and isinstance(before, int)
                and not isinstance(before, bool)
                and before >= 0
                and value < 0
            ):
                raise ValueError(f"--hf {key}={value}: {key} is a count or size (default {before}); it must be >= 0")
        unknown = [k for k in hf_overrides if not hasattr(default, k)]
        if unknown:
            import difflib

            fields = sorted(set(default.to_dict()) | set(getattr(default, "attribute_map", {})))
            near = difflib.get_close_matches(unknown[0], fields, n=3, cutoff=0.6)
            raise ValueError(
                f"--hf {unknown[0]}=...: {type(default).__name__} has no field {unknown[0]!r}"
                + (f"; did you mean {' or '.join(near)}?" if near else f" (its fields: {', '.join(fields)})")
            )
        try:
            config = AutoConfig.for_model(model_type, **hf_overrides)
        except Exception as exc:  # noqa: BLE001  (transformers' strict-dataclass and config errors)
            first = str(exc).strip().splitlines()
            raise ValueError(
                f"--hf overrides {hf_overrides!r} for {model!r}: {' '.join(x.strip() for x in first)}"
            ) from None
        limit = next(
            (
                getattr(config, k)
                for k in ("max_position_embeddings", "n_positions")
                if isinstance(getattr(config, k, None), int)
            ),
            None,
        )
        if limit is not None and seq_len > limit:
            raise ValueError(
                f"model {model!r} takes sequences up to {limit} positions, got --seq-len {seq_len} "
                f"(lower --seq-len, or raise it with --hf max_position_embeddings=...)"
            )
        return (lambda: HFCausalLM(AutoModelForCausalLM.from_config(config))), config.vocab_size
    preset = get_preset(model)
    if preset.max_seq_len is not None and seq_len > preset.max_seq_len:
        raise ValueError(f"model {model!r} takes sequences up to {preset.max_seq_len}, got --seq-len {seq_len}")
    return (lambda: preset.build(seq_len)), preset.vocab_size


class HFCausalLM(torch.nn.Module):
    """A ``transformers`` causal LM as ``forward(idx [batch, seq]) -> logits [batch, seq, vocab]``."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, idx):
        # transformers skips its data-dependent mask checks only while torch compiles; a fake
        # trace is symbolic too, so say so while it runs.
        if torch.compiler.is_compiling():
            return self.inner(input_ids=idx, use_cache=False).logits
        from unittest import mock

        with mock.patch("torch.compiler.is_compiling", lambda: True):
            return self.inner(input_ids=idx, use_cache=False).logits


def _parse_budgets(budgets: list[str], device: DeviceSpec) -> list[tuple[str, MemoryBudget]]:
    if not budgets:
        raise ValueError("--budgets: no budget given; e.g. '100%,50%,24GiB,device'")
    parsed = []
    for b in budgets:
        if b == "device":
            parsed.append((b, MemoryBudget("bytes", float(device.memory_bytes))))
            continue
        try:
            mb = MemoryBudget.parse(b, key="--budgets")
        except ValueError as exc:
            if b.strip().endswith("%"):  # a percentage out of range: the parser's reason says which
                raise ValueError(str(exc)) from None
            mb = None
        if mb is None or mb.kind not in ("bytes", "fraction"):
            raise ValueError(f"--budgets: {b!r} is not a size ('24GiB'), a percentage ('50%') or 'device'")
        parsed.append((b, mb))
    return parsed


def mark_target_device(pair, device: DeviceSpec) -> None:
    """Writes :data:`~offload_compiler.ir.meta.TARGET_DEVICE_KEY` on ``pair``'s graphs: a trace
    made on the CPU is planned for ``device`` (``"cuda"`` unless it is the host itself), whose
    Inductor fusions liveness models (``passes/liveness.py``)."""
    for gm in (pair.forward, pair.backward):
        gm.meta[TARGET_DEVICE_KEY] = "cpu" if device.host_is_device else "cuda"


def default_inner(offload: str) -> str:
    """The inner compiler ``plan`` assumes: the backend's default, Inductor, for
    ``offload="activations"``; ``"eager"`` for parameter offload (which needs it)."""
    return "inductor" if offload == "activations" else "eager"


def plan_step(
    traced: TracedStep,
    device: DeviceSpec,
    budgets: list[str],
    *,
    model: str = "model",
    optimizer: str = "adamw",
    min_offload_bytes: int = 1 << 20,
    offload: str = "activations",
    inner: str | None = None,
    trace_seconds: float = 0.0,
    strategy: str = "auto",
    cpu_optimizer: str = "exact",
    overlap: str = "forward",
    optimizer_on_device: float | str = 0.0,
    solver_time_limit: float = 0.5,
) -> PlanResult:
    """Plan a traced training step for each budget on ``device`` through the backend's spine:
    :func:`~offload_compiler.pipeline.prepare`, then
    :func:`~offload_compiler.pipeline.plan_pair` with the options the backend would have
    (``memory_budget`` = the row's budget, ``inner``, ``offload``, ``min_offload_bytes``,
    ``solver_time_limit``) and a
    :class:`~offload_compiler.pipeline.ModelState` holding the parameters to offload (every
    ``nn.Parameter``, as the backend's slots) and the optimizer's state bytes. ``traced`` must
    have been traced with the same ``inner``. Mutates ``traced.pair`` (prepare). ``strategy``,
    ``optimizer_on_device``: the backend's options of those names. With ``offload="all"`` the
    optimizer update of ``optimizer`` is modelled as ``CPUOptimizer(implementation=cpu_optimizer,
    overlap=overlap)`` runs it on ``device``'s host figures
    (:func:`~.passes.cost_model.host_update_model`).

    Raises:
        ValueError: for an unknown optimizer, offload mode, strategy or a malformed budget, naming
            it; for ``inner="inductor"`` or ``strategy="recompute"`` with parameter offload; for a
            ``traced`` step traced for another ``inner``.
    """
    from .pipeline import ModelState, analyze_pair, plan_pair, prepare

    if optimizer not in _OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; one of {', '.join(_OPTIMIZER_STATES)}")
    if offload not in ("activations",) + param_residency.MODES:
        raise ValueError(f"unknown offload {offload!r}; one of activations, {', '.join(param_residency.MODES)}")
    inner = inner or default_inner(offload)
    if traced.inner != inner:
        raise ValueError(
            f"plan_step: the step was traced for inner={traced.inner!r} (its decompositions) but is planned "
            f"for inner={inner!r}; trace it with inner={inner!r}"
        )
    if cpu_optimizer not in ("exact", "fastest"):
        raise ValueError(f"cpu_optimizer {cpu_optimizer!r}: expected 'exact' or 'fastest'")
    if strategy == "recompute" and offload != "activations":
        raise ValueError(f"--strategy recompute is not combined with --offload {offload} yet")
    parsed = _parse_budgets(budgets, device)
    user = {"inner": inner, "offload": offload, "min_offload_bytes": min_offload_bytes, "verify": False}
    user["strategy"] = strategy
    user["solver_time_limit"] = solver_time_limit
    if offload == "all":
        user["optimizer_on_device"] = optimizer_on_device
    base = TrinityOptions.from_user(user, env={})
    t0 = time.perf_counter()
    pair = traced.pair
    mark_target_device(pair, device)  # first: prepare's addmm split reads it
    prepare(pair, inner)
    analysis = analyze_pair(pair, base, device)
    full_state = _OPTIMIZER_STATES[optimizer] * traced.param_bytes
    params = {}
    if offload != "activations":
        per_param = 2 if offload == "all" else 1  # the master copy, and the host gradient with "all"
        params = {i: (0, per_param * n) for i, n in zip(traced.param_positions, traced.param_nbytes)}
    update = None
    if offload == "all":
        update = cost_model.host_update_model(
            device, optimizer, implementation="fused" if cpu_optimizer == "fastest" else "loop", overlap=overlap
        )
    state = ModelState(offload=offload, params=params, optimizer_state_bytes=full_state, update=update)
    rows = []
    first = None
    for text, budget in parsed:
        pp = plan_pair(pair, replace(base, memory_budget=budget), state, spec=device, analysis=analysis)
        first = first or pp
        pred = pp.predictions
        rp = pp.joint.recompute if offload == "activations" else None
        rows.append(
            PlanRow(
                budget=text,
                budget_bytes=pp.step_budget_bytes,
                planned_peak_bytes=pred.planned_peak_bytes,
                lowest_reachable_bytes=pred.lowest_reachable_peak_bytes,
                feasible=pred.feasible,
                predicted_step_seconds=pred.step_seconds,
                exposed_seconds=pred.exposed_transfer_seconds,
                evicted_bytes=pp.activations.evicted_bytes,
                num_evicted=len(pp.activations.evictions),
                fits_device=pred.planned_peak_bytes <= device.memory_bytes,
                host_bytes=pred.host_bytes,
                peak_step=pp.activations.peak_step_planned,
                update_seconds=pred.update_seconds,
                exposed_update_seconds=pred.exposed_update_seconds,
                device_share=pp.split.share if pp.split is not None else 0.0,
                recomputed_bytes=rp.recomputed_bytes if rp else 0,
                num_recomputed=len(rp.recomputes) if rp else 0,
                recompute_seconds=rp.recompute_seconds if rp else 0.0,
                recompute_flops=rp.recompute_flops if rp else 0,
                chosen=rp.chosen if rp else "offload only",
                solver_bound_seconds=rp.solver_bound_seconds if rp else None,
                peak_breakdown=tuple(pp.activations.peak_breakdown),
            )
        )
    return PlanResult(
        model=model,
        device=device,
        num_params=traced.num_params,
        param_bytes=traced.param_bytes,
        optimizer_state_bytes=full_state,
        unplanned_peak_bytes=first.predictions.unplanned_peak_bytes,
        compute_seconds=analysis.costs.compute_seconds,  # the unrewritten pair (a recompute plan adds its own)
        rows=tuple(rows),
        trace_seconds=trace_seconds,
        plan_seconds=time.perf_counter() - t0,
        offload=offload,
        host_model_state_bytes=state.host_bytes,
        inner=inner,
        strategy=strategy if offload == "activations" else "offload",
        update=update.description if update is not None else "",
    )


def plan_model(
    model,
    device: DeviceSpec,
    budgets: list[str],
    batch: int = 1,
    seq_len: int = 1024,
    dtype: torch.dtype = torch.bfloat16,
    optimizer: str = "adamw",
    min_offload_bytes: int = 1 << 20,
    hf_overrides: dict | None = None,
    offload: str = "activations",
    inner: str | None = None,
    *,
    strategy: str = "auto",
    cpu_optimizer: str = "exact",
    overlap: str = "forward",
    optimizer_on_device: float | str = 0.0,
    traced: TracedStep | None = None,
    solver_time_limit: float = 0.5,
) -> PlanResult:
    """Plan ``model``'s training step for each budget on ``device`` (see the module docstring):
    trace it (:func:`~offload_compiler.trace.trace_training_step`, with ``inner``'s
    decompositions), then :func:`plan_step`.

    ``model`` is a preset's name, ``hf:<model_type>``, or a :class:`~.models.presets.Preset`
    (a model built by the caller, e.g. one pipeline stage or one tensor-parallel shard of a
    preset: ``plan --world`` plans those). Budgets are sizes (``"24GiB"``), percentages of the
    peak without offloading (``"50%"``) or ``"device"`` (the device's memory). ``inner`` defaults
    to :func:`default_inner`. ``strategy``, ``cpu_optimizer``, ``overlap``,
    ``optimizer_on_device`` and ``solver_time_limit``: see :func:`plan_step`. ``traced``: a :class:`~.trace.TracedStep` of
    this model to plan instead of tracing it again (prepared once, in place).

    Raises:
        ValueError: for an unknown model, optimizer, strategy or a malformed budget, naming it.
    """
    from .trace import trace_training_step

    if optimizer not in _OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; one of {', '.join(_OPTIMIZER_STATES)}")
    if offload not in ("activations",) + param_residency.MODES:
        raise ValueError(f"unknown offload {offload!r}; one of activations, {', '.join(param_residency.MODES)}")
    inner = inner or default_inner(offload)
    if strategy == "recompute" and offload != "activations":  # named as the command's flags
        raise ValueError(f"--strategy recompute is not combined with --offload {offload} yet")
    TrinityOptions.from_user(
        {"inner": inner, "offload": offload, "strategy": strategy, "solver_time_limit": solver_time_limit}, env={}
    )  # fail before tracing
    _parse_budgets(budgets, device)
    t0 = time.perf_counter()
    if traced is None:
        build, vocab = model_builder(model, seq_len, hf_overrides or {})
        traced = trace_training_step(build, batch, seq_len, vocab, dtype, inner=inner)
    trace_seconds = time.perf_counter() - t0
    return plan_step(
        traced,
        device,
        budgets,
        model=getattr(model, "name", model),
        optimizer=optimizer,
        min_offload_bytes=min_offload_bytes,
        offload=offload,
        inner=inner,
        trace_seconds=trace_seconds,
        strategy=strategy,
        cpu_optimizer=cpu_optimizer,
        overlap=overlap,
        optimizer_on_device=optimizer_on_device,
        solver_time_limit=solver_time_limit,
    )


def frontier_png(result: PlanResult, path: Path) -> Path:
    """Planned peak against predicted step time, one point per budget (PNG)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    gib = 2**30
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    pts = [r for r in result.rows if r.predicted_step_seconds == r.predicted_step_seconds]
    ax.plot(
        [r.predicted_step_seconds * 1e3 for r in pts], [r.planned_peak_bytes / gib for r in pts], "o-", color="#1f77b4"
    )
    for r in pts:
        label = r.budget + ("" if r.feasible else " (infeasible)")
        ax.annotate(
            label,
            (r.predicted_step_seconds * 1e3, r.planned_peak_bytes / gib),
            fontsize=7,
            xytext=(4, 4),
            textcoords="offset points",
        )
    ax.axhline(result.device.memory_bytes / gib, color="#d62728", linestyle="--", label=f"{result.device.name} memory")
    ax.axvline(result.compute_seconds * 1e3, color="#999999", linestyle=":", label="step without offloading")
    ax.set_xlabel("predicted step time (ms)")
    ax.set_ylabel("planned peak device memory (GiB)")
    ax.set_title(f"{result.model}: memory/time frontier")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _count(n: int) -> str:
    """A parameter count for people: 6.74B, 124M, 957K, 512."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


def parse_hf_overrides(items: list[str], model: str) -> dict:
    """``--hf KEY=VALUE`` items as a config-override dict for an ``hf:<model_type>`` model.

    A value reads as an int (``12``, ``-1``), a float (``1e-5``), ``true``/``false``, ``none``,
    else a string. The config checks each value's type when it is built (:func:`model_builder`).

    Raises:
        ValueError: an item without ``=`` or with an empty key, a key given twice, or any
            ``--hf`` with a model that is not ``hf:`` (a preset has no transformers config, so the
            overrides would be silently ignored).
    """
    if items and not str(model).startswith("hf:"):
        raise ValueError(
            f"--hf {items[0]!r}: overrides apply to hf:<model_type> models only, not --model {model!r} "
            "(a preset's sizes are fixed; pick another preset or hf:<model_type>)"
        )
    out: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--hf {item!r}: expected KEY=VALUE, e.g. --hf num_hidden_layers=4")
        if key in out:
            raise ValueError(f"--hf {item!r}: {key!r} is given twice")
        out[key] = _hf_value(value.strip())
    return out


def _hf_value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


# Options whose value may start with "-" (a negative size is refused with a clear error, not
# taken by argparse for an unknown option): "--budgets -5GiB" is read as "--budgets=-5GiB".
_VALUE_OPTIONS = ("--budgets", "--device-memory", "--min-offload-bytes", "--hf", "--host-bandwidth")


def _glue_values(argv: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in _VALUE_OPTIONS and i + 1 < len(argv) and argv[i + 1].startswith("-") and argv[i + 1] != "--":
            out.append(f"{a}={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to a flag's help unless the help already says its default, or there
    is none to state (``None``, an empty list). The formatter of ``plan`` and ``plan --world``."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, [], argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--world" or a.startswith("--world=") for a in argv):
        from .world_plan import main as world_main  # plan --world N: layouts for N GPUs

        return world_main(argv)
    parser = argparse.ArgumentParser(
        prog="python -m offload_compiler plan",
        description=__doc__.split("\n")[0],
        formatter_class=DefaultsHelp,
    )
    parser.add_argument(
        "--model",
        default="gpt2-small",
        help="a preset (demo, gpt2-small/medium/large/xl, llama-1b, llama-7b, llama3-8b, llama-13b, llama-30b, "
        "llama-70b) or hf:<model_type>",
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16", help="float32, bfloat16 or float16")
    parser.add_argument("--optimizer", default="adamw", help="adamw, adam, sgd (momentum) or none")
    parser.add_argument(
        "--device", default="a100-80gb", help="a device from the table: " + ", ".join(sorted(KNOWN_DEVICES))
    )
    parser.add_argument(
        "--device-memory", default=None, help="override the device's memory, e.g. 24GiB (default: the table's)"
    )
    parser.add_argument(
        "--budgets",
        default="100%,90%,75%,60%,50%,40%,30%,25%,device",
        help="comma-separated sizes, percentages or 'device'",
    )
    parser.add_argument(
        "--min-offload-bytes", default="1MiB", help="saved activations smaller than this are never offloaded"
    )
    parser.add_argument(
        "--offload",
        default="activations",
        help="activations, activations+params or all (parameters, gradients, optimizer state on the host)",
    )
    parser.add_argument(
        "--inner",
        default=None,
        help="inner compiler assumed: inductor or eager (default: inductor with --offload activations, else eager)",
    )
    parser.add_argument(
        "--host-bandwidth",
        default=None,
        help="the host's sustained memory bandwidth in bytes/s (e.g. 60e9; default the device table's host)",
    )
    parser.add_argument(
        "--cpu-optimizer", default="exact", help="with --offload all: CPUOptimizer's implementation, exact or fastest"
    )
    parser.add_argument("--overlap", default="forward", help="with --offload all: CPUOptimizer's overlap")
    parser.add_argument(
        "--optimizer-on-device", default="0", help="with --offload all: share on the device, 0.0..1.0 or auto"
    )
    parser.add_argument(
        "--strategy",
        default="auto",
        choices=plan_recompute.STRATEGIES,
        help="how saved activations meet a budget: auto (keep, offload or recompute), offload or recompute",
    )
    parser.add_argument(
        "--solver-time-limit",
        default="0.5",
        help="seconds the joint planner's solver searches per budget (the backend's solver_time_limit; default 0.5)",
    )
    parser.add_argument("--png", default=None, help="draw the frontier into this PNG file (default: none)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON to FILE")
    parser.add_argument(
        "--hf", action="append", default=[], metavar="KEY=VALUE", help="config override for hf: models (repeatable)"
    )
    parser.add_argument(
        "--world", type=int, default=None, help="plan a layout for N GPUs instead (see: plan --world N --help)"
    )
    args = parser.parse_args(_glue_values(argv))

    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(160, Console().width))
    try:
        for flag, value in (("--png", args.png), ("--json", args.json)):
            # Checked before the trace (tens of seconds), not after it.
            if value and not Path(value).resolve().parent.is_dir():
                raise ValueError(f"{flag} {value!r}: the folder {str(Path(value).resolve().parent)!r} does not exist")
        if args.dtype not in _DTYPES:
            raise ValueError(f"--dtype {args.dtype!r} is not one of {', '.join(_DTYPES)}")
        spec = lookup_device(args.device)
        if args.device_memory is not None:
            memory = parse_size("--device-memory", args.device_memory)
            if memory <= 0:
                raise ValueError(f"--device-memory {args.device_memory!r}: a device's memory must be more than 0 bytes")
            spec = replace(spec, memory_bytes=memory)
        budget_list = [b.strip() for b in args.budgets.split(",")]
        if any(not b for b in budget_list):
            raise ValueError(f"--budgets {args.budgets!r}: an empty entry; e.g. '100%,50%,24GiB,device'")
        if args.host_bandwidth:
            try:
                bandwidth = float(args.host_bandwidth)
            except ValueError:
                bandwidth = -1.0
            if not bandwidth > 0:
                raise ValueError(f"--host-bandwidth {args.host_bandwidth!r} is not a positive number of bytes/s")
            spec = spec.with_host_bandwidth(bandwidth)
        if args.cpu_optimizer not in ("exact", "fastest"):
            raise ValueError(f"--cpu-optimizer {args.cpu_optimizer!r} is not exact or fastest")
        if args.overlap not in ("forward", "backward"):
            raise ValueError(f"--overlap {args.overlap!r} is not forward or backward")
        share = TrinityOptions.from_user(
            {"offload": "all", "inner": "eager", "optimizer_on_device": args.optimizer_on_device}, env={}
        ).optimizer_on_device
        overrides = parse_hf_overrides(args.hf, args.model)
        result = plan_model(
            args.model,
            spec,
            budget_list,
            args.batch,
            args.seq_len,
            _DTYPES[args.dtype],
            args.optimizer,
            parse_size("--min-offload-bytes", args.min_offload_bytes),
            overrides,
            args.offload,
            args.inner,
            strategy=args.strategy,
            cpu_optimizer=args.cpu_optimizer,
            overlap=args.overlap,
            optimizer_on_device=share,
            solver_time_limit=TrinityOptions.from_user(
                {"solver_time_limit": args.solver_time_limit}, env={}
            ).solver_time_limit,
        )
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    console.print(
        f"[bold]{result.model}[/bold]: {_count(result.num_params)} parameters ({format_bytes(result.param_bytes)}), "
        f"batch {args.batch} x {args.seq_len} tokens, {args.dtype}, optimizer {args.optimizer} "
        f"({format_bytes(result.optimizer_state_bytes)} of state"
        + (", on the host" if result.offload == "all" else "")
        + f") on {spec.name} "
        f"({format_bytes(spec.memory_bytes)}, {spec.h2d_bytes_per_s / 1e9:.0f} GB/s host link)"
    )
    console.print(
        f"peak without offloading {format_bytes(result.unplanned_peak_bytes)}; step without offloading "
        f"{result.compute_seconds * 1e3:.1f} ms (predicted); traced in {result.trace_seconds:.1f} s, planned "
        f"{len(result.rows)} budgets in {result.plan_seconds:.1f} s (strategy {result.strategy})"
    )
    if result.offload != "activations":
        console.print(
            f"offload={result.offload}: model state in host memory {format_bytes(result.host_model_state_bytes)} "
            "(parameter master copies" + (", gradients, optimizer state" if result.offload == "all" else "") + ")"
        )
    if result.offload == "all":
        console.print(f"host optimizer update: {result.update}")
    table = Table()
    cols = ["budget", "budget bytes", "planned peak", "fits device", "step (pred.)", "exposed copy", "evicted"]
    cols.append("recompute")
    if result.offload == "all":
        cols += ["host update", "exposed update", "on device"]
    for col in cols:
        table.add_column(col, justify="right", no_wrap=True)
    for r in result.rows:
        if not r.feasible:
            peak = f"[red]infeasible[/red]: lowest {format_bytes(r.lowest_reachable_bytes)}"
        else:
            peak = format_bytes(r.planned_peak_bytes)
        step = f"{r.predicted_step_seconds * 1e3:.1f} ms" if r.feasible else ""
        exposed = f"{r.exposed_seconds * 1e3:.1f} ms" if r.feasible else ""
        table.add_row(
            r.budget,
            format_bytes(r.budget_bytes),
            peak,
            # An infeasible row's planned peak is its lowest-peak plan's: whether that fits the device.
            ("yes" if r.fits_device else "no") if r.feasible else ("lowest fits" if r.fits_device else "no"),
            step,
            exposed,
            f"{format_bytes(r.evicted_bytes)} ({r.num_evicted})" if r.feasible else "",
            (
                f"{format_bytes(r.recomputed_bytes)} ({r.num_recomputed}), {r.recompute_seconds * 1e3:.1f} ms"
                if r.feasible and r.num_recomputed
                else ("0 B" if r.feasible else "")
            ),
            *(
                (
                    f"{r.update_seconds * 1e3:.1f} ms" if r.feasible else "",
                    f"{r.exposed_update_seconds * 1e3:.1f} ms" if r.feasible else "",
                    f"{100 * r.device_share:.0f}%" if r.feasible else "",
                )
                if result.offload == "all"
                else ()
            ),
        )
    console.print(table)
    best = result.within_5_percent()
    ref_name = (
        "the no-offload step"
        if result.offload == "activations"
        else f"the fastest planned step with --offload {result.offload}"
    )
    if best is not None:
        console.print(
            f"smallest budget within 5% of {ref_name}: [bold]{best.budget}[/bold] = "
            f"{format_bytes(best.budget_bytes)} (peak {format_bytes(best.planned_peak_bytes)}, step "
            f"{best.predicted_step_seconds * 1e3:.1f} ms)"
        )
    else:
        console.print(f"no budget in the list keeps the predicted step within 5% of {ref_name}")
    lowest = min(r.lowest_reachable_bytes for r in result.rows)
    infeasible = [r for r in result.rows if not r.feasible]
    if infeasible:
        # What sets the floor (the backend's refusal says the same): the lowest-peak plan's peak.
        floor = min(infeasible, key=lambda r: r.planned_peak_bytes)
        total = sum(b for _k, b in floor.peak_breakdown) or 1
        parts = ", ".join(f"{kind} {format_bytes(b)} ({100 * b / total:.0f}%)" for kind, b in floor.peak_breakdown if b)
        state = (
            f"; the optimizer state, {format_bytes(result.optimizer_state_bytes)}, stays on the device beside it"
            if result.offload == "activations" and result.optimizer_state_bytes
            else ""
        )
        model_state = sum(b for k, b in floor.peak_breakdown if k in ("parameter", "gradient"))
        hint = ""
        if result.offload != "all" and (model_state >= total / 2 or result.optimizer_state_bytes >= total / 2):
            hint = (
                "; with --offload activations only saved activations move: --offload all moves parameters, "
                "gradients and optimizer state to host memory"
                if result.offload == "activations"
                else "; --offload all also moves gradients and optimizer state to host memory"
            )
        console.print(
            f"rows marked infeasible are below the lowest peak any plan reaches, {format_bytes(lowest)}; at that "
            f"peak the step's graphs hold {parts}{state}{hint}"
        )
    if lowest > spec.memory_bytes:
        console.print(
            f"[yellow]even offloading every saved activation, the step needs {format_bytes(lowest)} > "
            f"{format_bytes(spec.memory_bytes)} on {spec.name}: parameters, gradients and optimizer state "
            "dominate" + ("; --offload all moves them to host memory" if result.offload != "all" else "") + "[/yellow]"
        )
    if args.png:
        console.print(f"frontier: {frontier_png(result, Path(args.png))}")
    if args.json:
        payload = {
            **result.to_json(),
            "batch": args.batch,
            "seq_len": args.seq_len,
            "dtype": args.dtype,
            "optimizer": args.optimizer,
            "command": "python -m offload_compiler plan " + " ".join(argv),
            "torch": torch.__version__,
            "note": "predicted by the cost model and simulator on the device's figures; not measured",
        }
        Path(args.json).write_text(json.dumps(payload, indent=1) + "\n")
        console.print(f"rows: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
