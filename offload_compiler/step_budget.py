"""The memory budget of a training step: a ledger of what the step's compiled graph pairs hold.

One training step can run several compiled graph pairs: DDP's graph splitting (``optimize_ddp``)
compiles one pair per gradient bucket, and a graph break gives a pair on each side. Their
forwards run in order and their backwards in reverse order (``F0 F1 .. Fn Bn .. B0``), so while
pair ``i`` runs (forward and backward) the device holds, besides what pair ``i``'s own liveness
counts:

* the saved activations every **earlier** pair kept on the device for its backward (not
  evicted, not recomputed): they stay until that pair's backward, which runs after pair ``i``'s;
* the earlier pairs' inputs other than parameters (the step's own inputs, held by the caller,
  and the earlier pairs' outputs that the pair after them reads, mostly saved for a backward);
* the model's parameters that pair ``i`` does not read (resident; parameters trinity offloads,
  with ``offload="activations+params"`` or ``"all"``, are on the device only inside their own
  pair and do not count);
* the gradients of those parameters (left by later pairs' backwards, or by an earlier
  micro-step under gradient accumulation; none for parameters whose gradients go to host memory
  with ``"all"``); counted for the whole pair, forward included, and also for earlier pairs'
  parameters whose gradients do not exist yet (conservative);
* under DDP, the reducer's gradient buckets (the bytes of the parameters DDP reduces);
* the inputs of **later** pairs that exist from the step's start: the step's inputs that only a
  later pair reads (soft labels or a teacher's logits read by the loss after a graph break), held
  by the caller through the whole step. They are known only at the later pair's compile, inside
  the first step, by runtime identity (:func:`step_input_bytes`: an input whose storage an earlier
  pair read or made at its latest call, or whose autograd graph reaches an earlier pair's live
  run, was made in the step; any other counts, conservatively: a tensor made by eager code
  between the graphs without autograd, or every input where the earlier pairs are not watched,
  ``runtime_check="off"``). The ledger then raises the earlier pairs' holdings
  (:meth:`StepLedger.later_input_bytes`); each earlier pair's runtime check plans it again with
  them at its next call (the next step's start; the first step runs the old plan), and the
  step's check at its last pair (a percentage: its base includes them) judges the earlier pairs
  at the plans those replans will make (their lowest-peak plans where the budget is below them);
* the outputs of **later** pairs that the caller holds through the earlier pairs' backwards: the
  loss it calls ``backward()`` on (``mse_loss`` keeps its scalar in a storage of its input's
  size), logits returned with it. Predicted at each compile as the loss the step's last pair so
  far returns (its one-element outputs' storages, :func:`~.passes.liveness.loss_output_bytes`;
  dropped for a pair once another compiles after it, which it passes its outputs to; logits may
  or may not be held, ``model(**batch).loss.backward()`` drops them first), and measured by the
  earlier pair's runtime check when its backward starts (the later pairs' latest outputs still
  alive, :meth:`StepLedger.later_outputs_alive`); the larger counts, from
  :data:`MIN_HELD_OUTPUT_BYTES` on, and an earlier pair planned without them is planned again at
  its next call, as for the later pairs' inputs. Not for DDP splits (their outputs are the next
  split's inputs; the model's output that the caller keeps is not counted there);
* the pair's **own** parameters' gradients, when an earlier backward left them for this one to
  accumulate into (DDP's ``no_sync()`` micro-steps, ``zero_grad(set_to_none=False)``): held from
  the pair's forward on (:func:`accumulated_grad_bytes`). The compile sees them when they exist
  then; they mostly appear at a later call (the second micro-step, the second step), where the
  runtime check (``step_check.py``) plans the pair again with them, before that call runs (with
  ``runtime_check="replan"`` and ``offload="activations"``; otherwise it warns with their bytes),
  and without them again once forwards of several steps in a row found them gone
  (``zero_grad(set_to_none=True)``: ``CheckedCompile._grads_gone``).

A later pair's saved activations are never alive while pair ``i`` runs (its backward has freed
them before ``Bi``), so planning the pairs one after another in compile order, which is forward
order, each against the budget less what the ledger says the others hold while it runs, keeps
the whole step within the budget. :class:`StepLedger` keeps those holdings; the pipeline plans a
pair with them (``ModelState.held_bytes`` comes off the pair's budget) and records the result
(:meth:`StepLedger.record`).

**A pair run N times per step.** A block graph reused by identical blocks (FSDP2's per-block
compile, ``fully_shard(block); block.compile(...)``, or any ``block.compile()`` /
``torch.compile(block)`` of identical blocks: Dynamo compiles it once and every block runs the
same code) runs ``F1 .. FN BN .. B1`` in one step. While run ``i`` runs, the runs before it hold
what they keep for their backward, so the worst is the last: its own peak plus ``N - 1`` times
the saved activations one run keeps (and the earlier runs' inputs, and their parameters where
they stay allocated). The compile happens at the first block's call, before any block ran:
:func:`predict_runs` predicts ``N`` there from the module structure (the blocks of the calling
module of the same class and shapes, compiled alike), so that the first step already runs a plan
for the ``N`` runs (a :class:`StepReuse` with ``predicted`` set, a planning input:
``ModelState.reuse_count``, ``pipeline.plan_pair``) and a budget they cannot reach is refused at
that compile. The runtime check of the first step (``step_check.py``) counts the runs of the pair
alive at once and what other trinity pairs' runs outside its ledger hold beside its last run
(:class:`StepReuse`), and, when that is more than the plan assumed (nothing predicted: blocks
called outside any module), or differs from a prediction, plans the pair again with it, so that
own peak + ``(N - 1)`` x kept + what the others hold is within the budget. A percentage is then of the
step's unplanned peak: the pair's own plus ``N - 1`` unplanned runs' kept saved activations plus
the others'. Later pairs of the same ledger see all ``N`` runs' kept activations and inputs.

**A later pair that cannot fit beside the earlier ones.** An earlier pair plans against what
the pairs before it hold, not against the later pairs' needs: with an absolute budget it keeps
all the saved activations it can. When a later pair ``B``'s lowest step peak (its lowest-peak
plan plus what the others hold) is above the budget, :meth:`StepLedger.plan_caps` gives the
earlier pairs caps on their kept saved activations (:attr:`PairHolding.kept_bytes`) that take the
excess off, latest pair first, each down to what it cannot offload
(:attr:`PairHolding.kept_floor_bytes`). Each capped pair is planned under its cap when the cap is
decided (its probe, ``CompileSession.probe_cap``: the plan its next call will make): where that
plan keeps more than the cap (under ``strategy="recompute"`` a recomputed saved activation keeps its
chain's leaves, and the offload floor is no floor), the cap is what it keeps and is not lowered
again, and the pair's own peak under it (recomputing more raises it) is its predicted peak.
:meth:`StepLedger.holdings` counts a capped pair at its cap at once, so ``B`` is planned again against the capped holdings and keeps that plan (no second
replan of ``B`` once the capped pairs are replanned: their new plans keep at most the cap). Each
capped pair's runtime check (``step_check.CheckedCompile``) plans it again at its next call, the
next step's start, never inside a step, with the cap as a planning constraint
(``ModelState.kept_cap_bytes``: the kept boundary-crossing saved bytes <= cap in
:mod:`.passes.plan_window` and :mod:`.passes.plan_recompute`). The step that decided the caps runs
the earlier pairs' old plans; from the next one on the step is within the budget. The same caps are
given at the step's last pair under a percentage budget (its check of every pair's step peak).
With ``on_infeasible="error"`` only a step that even the earlier pairs at their floors (or at what
their probes keep) cannot fit is refused (the message gives those numbers), and then no cap is kept.

**Percentages** (``"50%"``) are of the step's peak without offloading: the largest, over the
pairs compiled so far, of the pair's own unplanned peak plus what the others hold unplanned (the
earlier pairs' saved activations all kept). A pair compiled before the step's last pair sees a
smaller step so far, so it plans against a smaller budget than the final one (it evicts more than
needed, never less). A pair that cannot reach its (provisional) percentage budget while more
pairs of the step are still to compile (a DDP split that is not its frame's last, a graph ending
at a graph break) is not refused at once: the step's last pair's compile checks every pair's
planned step peak against the final budget, and refuses there (``on_infeasible="error"``) or
warns.

**Where the ledger lives**: on the DDP module under DDP, else on the outermost module that owns
the pair's parameters (the compiled model; after a graph break, the resumed frame's ``self``; for
a per-block compile, the block whose call compiled the pair), or, when a module running further
up the Python stack contains that one (a graph break inside a nested call makes Dynamo compile the
inner module's frame on its own: Hugging Face's ``LlamaModel`` inside ``LlamaForCausalLM``; a
block compiled on its own, called by its model), the outermost such module; the ledger is then
also set on the inner module, so both sides of the break share it. Pairs are identified by the
frame's code object and their split index, so a recompile of a frame (another input shape)
replaces that pair's entry, unless the entry's pair has a run alive among the new pair's inputs'
autograd ancestors (the first block's own graph, whose input needs no gradient, and the graph
the other blocks run: both are one step). A pair that reads no parameter (the loss after a graph
break inside a submodule, whose graph is the outer frame's resume) joins the ledger of the pairs
whose runs are alive among its inputs' autograd ancestors; one with none (a function of tensors on
its own) is planned alone, as before. :func:`step_report` of a model whose blocks were compiled
one by one and run outside any module gathers the blocks' ledgers.

**What it does not cover** (see README "Distributed"): memory outside the compiled graphs (eager
code between them, the optimizer's state, the inputs that only a later DDP split reads (a split's
inputs are fake at its compile), the model's output that the caller holds under DDP's splits, FSDP2's all-gather and reduce-scatter buffers; FSDP2's
sharded parameters and gradients count as their local shards); pairs that do not run in compile order (except the runs of other pairs that
the first step's check sees beside a pair's run); a reused pair's ``N`` is predicted at its
compile where the module structure shows it, else (and where the prediction was wrong) what the
first measured step showed (a step with more runs later is not seen), and it is replanned only with
``runtime_check="replan"`` (the default) and ``offload="activations"``; earlier pairs are
capped for a later one (above) only with the same options, not for a later pair run N times per
step, and the step during which a cap is decided runs above the budget; and
``memory_budget="auto"``, which is the free device memory at each pair's compile (what the
others already hold is not free), planned without the ledger's holdings. The ledger records them
for every budget, ``"auto"`` and none included (``CompileSession.step_ledger_held``), so
:func:`step_report`'s predicted step peak is the step's whatever the budget.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch

from .options import format_bytes
from .runtime.accounting import SMALL_ALLOCATION_BYTES

__all__ = [
    "PairHolding",
    "StepLedger",
    "StepPair",
    "StepReport",
    "StepReuse",
    "accumulated_grad_bytes",
    "join_step",
    "predict_runs",
    "step_report",
]

LEDGER_ATTR = "_trinity_step_ledger"
# Later pairs' outputs held by the caller below this many bytes in all (a loss scalar) are not
# counted: a replan of the earlier pairs for them buys nothing (the allocator's bookkeeping,
# runtime.accounting.SMALL_ALLOCATION_BYTES).
MIN_HELD_OUTPUT_BYTES = SMALL_ALLOCATION_BYTES


@dataclass(frozen=True)
class StepReuse:
    """How many runs of one compiled pair are alive at once in a training step, and what else is
    held beside its last run: measured by the runtime check of the first step
    (:mod:`offload_compiler.step_check`), a planning input (``ModelState.reuse_count``).

    Attributes:
        runs: the reuse count N: runs of the pair whose forward has run and whose backward has not
            (and whose autograd graph is alive), at the forward of its last run, that run
            included (4 for one block graph run by 4 blocks, ``F1 .. F4 B4 .. B1``).
        held_bytes: device bytes held while that run runs besides the N - 1 earlier runs' kept
            saved activations (which the plan decides): the earlier runs' inputs other than
            parameters, the parameters that the other runs read and that are still allocated,
            with their gradients (counted whether or not they exist yet: conservative, as the
            ledger counts gradients), and the runs of other trinity pairs that the step ledger
            does not count (their kept saved activations and inputs, under their plans).
        held_unplanned_bytes: the same with the other pairs' saved activations all kept.
        predicted: ``None`` where the figures were measured; where they were predicted at the
            compile from the module structure (:func:`predict_runs`, before any run), the reason,
            for reports and messages (``"4 Block modules in Blocks compiled alike, ..."``).
    """

    runs: int = 1
    held_bytes: int = 0
    held_unplanned_bytes: int = 0
    predicted: str | None = None

    def __post_init__(self):
        if self.runs < 1:
            raise ValueError(f"StepReuse.runs must be >= 1, got {self.runs}")
        for name in ("held_bytes", "held_unplanned_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"StepReuse.{name} must be >= 0, got {getattr(self, name)}")

    def merged(self, other: StepReuse | None) -> StepReuse:
        """The larger of each figure (what either measured step showed); a measurement
        (``predicted`` ``None``)."""
        if other is None:
            return self
        return StepReuse(
            max(self.runs, other.runs),
            max(self.held_bytes, other.held_bytes),
            max(self.held_unplanned_bytes, other.held_unplanned_bytes),
        )

    def exceeds(self, other: StepReuse | None, slack_bytes: int = 0) -> bool:
        """Whether this holds more than ``other`` (``None``: one run, nothing held) by more than
        ``slack_bytes``."""
        other = other or StepReuse()
        return self.runs > other.runs or self.held_bytes > other.held_bytes + slack_bytes


@dataclass(frozen=True)
class PairHolding:
    """What one compiled pair of the step holds and sees (bytes).

    Attributes:
        label: ``"<frame name>"`` or ``"<frame name> (DDP split k)"``.
        kept_bytes: saved activations it keeps on the device from the end of its forward to its
            backward (what later pairs run beside), under its plan.
        kept_unplanned_bytes: the same with nothing offloaded or recomputed.
        param_bytes: device bytes of the parameters it reads.
        input_bytes: device bytes of its other inputs (held while later pairs run).
        held_bytes: what the step's other pairs and model state held while it runs, as planned
            against (:meth:`StepLedger.holdings`), and with ``runs`` > 1 what its own earlier runs
            and the other pairs' runs the first step showed beside it hold (:class:`StepReuse`).
        held_unplanned_bytes: the same with nothing offloaded.
        own_unplanned_peak_bytes / own_planned_peak_bytes: the pair's own peak (its liveness)
            without and with its plan.
        budget_bytes: the step's budget it was planned against (``None``: no limit).
        runs: the runs of the pair alive at once in one step that its plan covers (the reuse
            count N of a block graph run by N blocks; 1 until the first step's check measured
            more, :class:`StepReuse`).
        kept_floor_bytes: the part of its boundary-crossing saved activations that no plan can
            offload (not candidates, :meth:`~.passes.liveness.Liveness.candidates`): the least
            :attr:`kept_bytes` a cap can ask for.
        held_kept_bytes: the part of ``held_bytes`` that is the earlier pairs' kept saved
            activations (their :attr:`kept_bytes`, or their caps where lower, x their runs) when
            it was planned; :meth:`StepLedger.report` replaces it with what they keep now.
        kept_cap_bytes: the cap on :attr:`kept_bytes` that a later pair asked for
            (:meth:`StepLedger.set_caps`; ``None``: none), filled in by :meth:`StepLedger.report`.
        capped_for: the label of the later pair the cap is for.
        later_input_bytes: the part of ``held_bytes`` (and of ``held_unplanned_bytes``) that is the
            inputs of later pairs that exist from the step's start (:meth:`StepLedger.later_input_bytes`)
            when it was planned; :meth:`StepLedger.report` replaces it with what the ledger knows now
            (a later pair compiles after this one: its inputs become known then).
        later_output_bytes: the part of ``held_bytes`` (and of ``held_unplanned_bytes``) that is the
            outputs of later pairs that the caller still held when the pair's backward started (the
            loss, logits: :meth:`StepLedger.later_output_bytes`, measured by the runtime check) when
            it was planned; :meth:`StepLedger.report` replaces it with what the ledger knows now.
        own_lowest_peak_bytes: the pair's own peak under its lowest-peak plan (``None``: not known):
            what the step's check predicts for it where it is to be planned again for more held bytes.
        own_measured_peak_bytes: filled in by :meth:`StepLedger.report`: the pair's own peak as its
            runtime check measured its current plan's first step (``Report.measured_peak_bytes``;
            ``None``: not measured yet, or no check).
        measured_replan_due: filled in by :meth:`StepLedger.report`: that measurement is above
            the plan and the runtime check plans the pair again at its next call.
        later_inputs_due: filled in by :meth:`StepLedger.report`: later pairs' inputs (and held
            outputs) now known hold more than its plan counted, and its runtime check plans it again at its next call
            (:meth:`StepLedger.can_replan`; where it cannot, the held bytes count them all the same).
    """

    label: str
    kept_bytes: int
    kept_unplanned_bytes: int
    param_bytes: int
    input_bytes: int
    held_bytes: int
    held_unplanned_bytes: int
    own_unplanned_peak_bytes: int
    own_planned_peak_bytes: int
    budget_bytes: int | None
    runs: int = 1
    kept_floor_bytes: int = 0
    held_kept_bytes: int = 0
    kept_cap_bytes: int | None = None
    capped_for: str | None = None
    later_input_bytes: int = 0
    later_output_bytes: int = 0
    own_lowest_peak_bytes: int | None = None
    later_inputs_due: bool = False
    own_measured_peak_bytes: int | None = None
    measured_replan_due: bool = False

    @property
    def step_peak_bytes(self) -> int:
        """The step's predicted peak while this pair (its last run, with ``runs`` > 1) runs (own
        planned peak + held)."""
        return self.own_planned_peak_bytes + self.held_bytes

    @property
    def step_unplanned_peak_bytes(self) -> int:
        return self.own_unplanned_peak_bytes + self.held_unplanned_bytes

    @property
    def step_measured_peak_bytes(self) -> int | None:
        """The step's peak while this pair runs with its own peak as measured (its runtime
        check) and what the others hold as planned (``None``: not measured)."""
        return None if self.own_measured_peak_bytes is None else self.own_measured_peak_bytes + self.held_bytes


@dataclass(frozen=True)
class CapProbe:
    """What an earlier pair's plan under a cap on its kept saved activations gives, planned when
    the cap is decided (:meth:`StepLedger.set_caps` with ``probe``; the pair's
    ``CompileSession.probe_cap``).

    Attributes:
        kept_bytes: saved activations that plan keeps across its forward/backward boundary (bytes).
        own_peak_bytes: the pair's own planned peak under it (bytes).
        missed: it keeps more than the cap asked for (no plan meets the cap within the pair's own
            budget): the cap is raised to :attr:`kept_bytes` and not lowered again.
    """

    kept_bytes: int
    own_peak_bytes: int
    missed: bool


@dataclass(frozen=True)
class StepReport:
    """The training step's budget and predicted peak, and which pair holds what.

    Attributes:
        budget_bytes: the step's budget (the largest a pair resolved: a percentage's base grows
            as pairs compile; ``None``: no limit).
        predicted_peak_bytes: the largest :attr:`PairHolding.step_peak_bytes`.
        unplanned_peak_bytes: the largest :attr:`PairHolding.step_unplanned_peak_bytes`.
        pairs: per pair, in forward order.
        measured_peak_bytes: the largest :attr:`PairHolding.step_measured_peak_bytes` of the
            pairs measured (``None``: none measured yet).
    """

    budget_bytes: int | None
    predicted_peak_bytes: int
    unplanned_peak_bytes: int
    pairs: tuple[PairHolding, ...]
    measured_peak_bytes: int | None = None

    @property
    def within_budget(self) -> bool:
        """Whether the predicted peak and, where measured, the measured one (each pair's own
        measured peak with what the others are planned to hold) are within the budget; a
        measurement may be above it by less than
        :data:`~offload_compiler.runtime.accounting.SMALL_ALLOCATION_BYTES` (the allocator's
        bookkeeping: a wrapped scalar, a shape buffer, which the plan does not count)."""
        return self.budget_bytes is None or (
            self.predicted_peak_bytes <= self.budget_bytes and not self.measured_above_budget
        )

    @property
    def measured_above_budget(self) -> bool:
        """Whether a pair's measured step peak is above the budget by
        :data:`~offload_compiler.runtime.accounting.SMALL_ALLOCATION_BYTES` or more."""
        m = self.measured_peak_bytes
        return self.budget_bytes is not None and m is not None and m >= self.budget_bytes + SMALL_ALLOCATION_BYTES

    def summary(self) -> str:
        budget = "no limit" if self.budget_bytes is None else format_bytes(self.budget_bytes)
        measured = ""
        if self.measured_peak_bytes is not None:
            measured = (
                f"; measured {format_bytes(self.measured_peak_bytes)} (each pair's own peak in its plan's first "
                "step, while the pair runs: code outside the compiled graphs is neither planned nor measured)"
            )
            if self.measured_above_budget:
                due = any(
                    p.measured_replan_due
                    for p in self.pairs
                    if (p.step_measured_peak_bytes or 0) >= self.budget_bytes + SMALL_ALLOCATION_BYTES
                )
                measured += f": ABOVE the budget, {self.measured_peak_bytes} > {self.budget_bytes} bytes" + (
                    " (planned again at the next call)" if due else " (the runtime check's warning says why)"
                )
        lines = [
            f"training step: {len(self.pairs)} graph pair(s), budget {budget}, predicted peak "
            f"{format_bytes(self.predicted_peak_bytes)} (unplanned {format_bytes(self.unplanned_peak_bytes)})"
            + measured
        ]
        for p in self.pairs:
            runs = (
                f" [run {p.runs} times per step: the budget covers the {p.runs} runs, the others' held bytes "
                f"include {p.runs - 1} earlier runs']"
                if p.runs > 1
                else ""
            )
            if p.kept_cap_bytes is not None:
                done = p.kept_bytes <= p.kept_cap_bytes
                runs += (
                    f" [{'replanned' if done else 'to be replanned at its next call'} to keep at most "
                    f"{format_bytes(p.kept_cap_bytes)} ({p.kept_cap_bytes} bytes) of saved activations for a later "
                    f"pair, {p.capped_for}, to fit]"
                )
            if p.later_inputs_due:
                runs += (
                    f" [to be replanned at its next call: later pairs' inputs and held outputs hold "
                    f"{format_bytes(p.later_input_bytes + p.later_output_bytes)} beside it]"
                )
            parts = []
            if p.held_kept_bytes:
                parts.append(f"{format_bytes(p.held_kept_bytes)} saved activations that earlier pairs or runs keep")
            if p.later_input_bytes:
                parts.append(f"{format_bytes(p.later_input_bytes)} inputs of later pairs, there from the step's start")
            if p.later_output_bytes:
                parts.append(
                    f"{format_bytes(p.later_output_bytes)} outputs of later pairs that the caller held at its backward"
                )
            rest = p.held_bytes - p.held_kept_bytes - p.later_input_bytes - p.later_output_bytes
            if parts and rest > 0:
                parts.append(f"{format_bytes(rest)} other parameters, gradients, buckets and inputs")
            later = f" (of which {'; '.join(parts)})" if parts else ""
            lines.append(
                f"  {p.label}{runs}: own peak {format_bytes(p.own_planned_peak_bytes)} "
                f"(unplanned {format_bytes(p.own_unplanned_peak_bytes)}), keeps "
                f"{format_bytes(p.kept_bytes)} of saved activations for its backward and "
                f"{format_bytes(p.input_bytes)} of inputs, reads "
                f"{format_bytes(p.param_bytes)} of parameters; the others hold {format_bytes(p.held_bytes)}{later} "
                f"while it runs: step peak {format_bytes(p.step_peak_bytes)}"
                + (
                    f" (measured own peak {format_bytes(p.own_measured_peak_bytes)}: step "
                    f"{format_bytes(p.step_measured_peak_bytes)})"
                    if p.own_measured_peak_bytes is not None
                    else ""
                )
            )
        return "\n".join(lines)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's sharded parameters), else ``t``. Read as the attribute,
    not ``to_local()``: that dispatches an op, which the compile's fake mode refuses on a real
    tensor."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def _nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t`` on its rank (a DTensor's local shard)."""
    t = _local(t)
    return t.numel() * t.element_size()


def accumulated_grad_bytes(params, device: torch.device | str) -> int:
    """Device bytes of the gradients that ``params`` hold now: what an earlier backward left in
    ``p.grad`` for the next one to accumulate into (gradient accumulation: DDP's ``no_sync()``,
    ``zero_grad(set_to_none=False)``). They stay allocated through the next forward and backward,
    and the backward's new gradients are added into them.

    Args:
        params: the parameters a graph pair reads (a DTensor counts its local shard).
        device: the pair's device; gradients elsewhere (host memory) do not count.

    Returns:
        Bytes; each gradient storage once, whole: gradients that are views into one flat buffer
        count that buffer once (under DDP with ``gradient_as_bucket_view=True`` that is DDP's
        buckets, which the ledger counts too: counted twice, conservative). A parameter without
        ``.grad`` counts 0.
    """
    device = torch.device(device)
    seen: set[int] = set()
    total = 0
    for p in params:
        g = getattr(p, "grad", None)
        if g is None:
            continue
        g = _local(g)
        if g.device.type != device.type or (device.index is not None and g.device.index != device.index):
            continue
        try:
            storage = g.untyped_storage()
            ptr, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage
            continue
        if ptr in seen:
            continue
        seen.add(ptr)
        total += size
    return total


class StepLedger:
    """The pairs of one model's training step, in forward (compile) order.

    Args:
        root: the module whose parameters the step reads (under DDP, ``ddp.module``).
        ddp: the DDP module, when the step runs under DDP (its buckets count).
    """

    def __init__(self, root: torch.nn.Module, ddp: torch.nn.Module | None = None):
        self._root = weakref.ref(root)
        self._ddp = weakref.ref(ddp) if ddp is not None else None
        self._entries: dict[Any, PairHolding] = {}
        # Pair key -> (cap on its kept saved activations in bytes, label of the later pair it is
        # for, what its probe planned for the cap or None), and the pairs whose runtime check can
        # plan them again with a cap (set_caps).
        self._caps: dict[Any, tuple[int, str, CapProbe | None]] = {}
        self._replanners: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        # Pair key -> its runtime check (step_check.CheckedCompile; weakly), whose measured first
        # step the report shows (register_checker).
        self._checkers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        # Pair key -> device bytes of its inputs that exist from the step's start (not made by
        # an earlier pair, not read by one): held while every earlier pair runs (set_later_inputs).
        self._later_inputs: dict[Any, int] = {}
        # Pair key -> the storages of its latest call's inputs and outputs ((weak reference to
        # the tensor, storage address)), by which a later pair's compile tells its inputs made or
        # read in the step from those there from its start (note_call).
        self._io: dict[Any, tuple[tuple[Any, int], ...]] = {}
        # Pair key -> the storages of its latest call's outputs (note_call), and pair key -> the
        # most device bytes of later pairs' outputs found alive when its backward started
        # (set_later_outputs): the caller holds them through the earlier pairs' backwards.
        self._outputs: dict[Any, tuple[tuple[Any, int], ...]] = {}
        self._later_outputs: dict[Any, int] = {}
        # Pair key -> device bytes of its forward's outputs, predicted held by the caller through
        # the earlier pairs' backwards while it is the step's last pair (set_pair_outputs).
        self._last_outputs: dict[Any, int] = {}

    def belongs_to(self, root: torch.nn.Module) -> bool:
        return self._root() is root

    def __reduce__(self):
        # A copied or pickled module (``copy.deepcopy``, ``torch.save``) gets an empty ledger
        # that belongs to no module: its first compile starts a new one.
        return (_detached_ledger, ())

    @property
    def entries(self) -> tuple[PairHolding, ...]:
        return tuple(self._entries.values())

    def _model_state_bytes(self, own: set[int], offload: str, device: torch.device | None = None) -> tuple[int, int]:
        """(parameters, gradients) of the model held on the device outside a pair reading ``own``
        (parameter ids): a DTensor's local shard (FSDP2), and, with ``device``, only parameters
        there (not FSDP2's ``CPUOffloadPolicy`` host copies on a GPU run)."""
        from .runtime.model_state import SLOT_ATTR

        root = self._root()
        if root is None:
            return 0, 0
        params = grads = 0
        seen: set[int] = set()
        for p in root.parameters():
            if id(p) in seen or id(p) in own:
                continue
            seen.add(id(p))
            if device is not None and _local(p).device != device:
                continue
            slotted = getattr(p, SLOT_ATTR, None) is not None
            if not slotted:
                params += _nbytes(p)
            if p.requires_grad and not (slotted and offload == "all"):
                grads += _nbytes(p)
        return params, grads

    def _bucket_bytes(self) -> int:
        ddp = self._ddp() if self._ddp is not None else None
        if ddp is None:
            return 0
        ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
        return sum(_nbytes(p) for n, p in ddp.module.named_parameters() if p.requires_grad and n not in ignored)

    def _kept(self, key: Any, e: PairHolding) -> int:
        """What pair ``key`` keeps per run as the others plan against it: its kept bytes, or its
        cap where lower (a cap is planned at its next call, :meth:`set_caps`)."""
        cap = self._caps.get(key)
        return e.kept_bytes if cap is None else min(e.kept_bytes, cap[0])

    def earlier(self, key: Any) -> list[tuple[Any, PairHolding]]:
        """``(key, holding)`` of the pairs recorded before pair ``key``, in forward order, each
        with the later pairs' inputs known now in its held bytes (:meth:`_now`)."""
        out = []
        for k, e in self._entries.items():
            if k == key:
                break
            out.append((k, self._now(k, e)))
        return out

    def earlier_kept(self, key: Any) -> int:
        """Bytes of saved activations the pairs before ``key`` keep while it runs (their
        :attr:`PairHolding.kept_bytes`, or their caps where lower, x their runs)."""
        return sum(self._kept(k, e) * e.runs for k, e in self.earlier(key))

    def later_room(self, key: Any) -> int | None:
        """The most saved-activation bytes (per run) pair ``key`` may keep across its
        forward/backward boundary when it is planned again after later pairs of the step compiled
        (a runtime replan: later pairs' inputs, held gradients, measured workspace), so that no
        later pair's step peak goes above the step's budget: what the later pairs count it keeping
        now (:meth:`_kept`) plus the least room any of them has left (the budget less its step
        peak, :meth:`report`; none where one is above it already: this never asks for less than
        it keeps, which is :meth:`plan_caps`' job), divided by its runs.

        An earlier pair plans against what the pairs before it hold, not against the later pairs'
        needs: replanned against the step's final budget (a percentage's base grows as the pairs
        compile) it would keep what the later pairs were planned without, and the step's check
        would refuse the step at once, naming a budget at which the same happens again (a
        fresh-user trial: '75.4%', '82.9%', '89.1%', '94%', '96.4%', none ran).

        Returns ``None`` where ``key`` has no later pair or the step has no budget."""
        if key not in self._entries or not self.has_later(key):
            return None
        report = self.report()
        if report.budget_bytes is None:
            return None
        keys = list(self._entries)
        later = report.pairs[keys.index(key) + 1 :]
        slack = min(report.budget_bytes - p.step_peak_bytes for p in later)
        e = self._entries[key]
        return self._kept(key, e) + max(0, slack) // e.runs

    def kept_cap(self, key: Any) -> int | None:
        """The cap (bytes) on pair ``key``'s kept saved activations, or ``None``."""
        cap = self._caps.get(key)
        return None if cap is None else cap[0]

    def register_replanner(self, key: Any, replanner: Any) -> None:
        """Pair ``key`` can be planned again with a cap at its next call, by ``replanner`` (its
        :class:`~offload_compiler.step_check.CheckedCompile`; held weakly)."""
        self._replanners[key] = replanner

    def register_checker(self, key: Any, checker: Any) -> None:
        """Pair ``key``'s runtime check (its :class:`~offload_compiler.step_check.CheckedCompile`,
        held weakly): :meth:`report` shows what it measured."""
        self._checkers[key] = checker

    def _measured(self, key: Any) -> tuple[int | None, bool]:
        """(pair ``key``'s own measured peak under its current plan, whether its runtime check
        plans it again at its next call) from its registered check."""
        checker = self._checkers.get(key)
        report = getattr(checker, "report", None) if checker is not None else None
        if report is None:
            return None, False
        return report.measured_peak_bytes, bool(getattr(checker, "replan_due", False))

    def can_replan(self, key: Any) -> bool:
        """Whether pair ``key``'s runtime check can plan it again (:meth:`register_replanner`)."""
        return self._replanners.get(key) is not None

    def plan_caps(self, key: Any, excess_bytes: int, probed: bool = False) -> tuple[dict[Any, int], int]:
        """Caps on the kept saved activations of the pairs before ``key`` that lower what they
        hold while it runs by ``excess_bytes``: ``(key -> cap in bytes, bytes still missing)``.

        Latest pair first: the pair nearest ``key`` gives what it can (its kept bytes, or its
        cap, down to :attr:`PairHolding.kept_floor_bytes`, or not below a cap its probe could not
        meet, :meth:`set_caps`; a pair run N times gives N x per byte of cap), then the one
        before. With ``probed`` (the caps go to :meth:`set_caps` with ``probe``), a pair that may
        recompute (its runtime check's ``may_recompute``: ``strategy`` other than ``"offload"``)
        is asked for down to 0 bytes: what cannot be offloaded may be recomputed, and its probe
        tells what its plan keeps. The latest first because its saved activations are the
        most recent ones, with the shortest host round trip per byte of the earlier pairs (their
        backward comes first of theirs), and a cap changes the fewest pairs. Only pairs that can
        be planned again (:meth:`register_replanner`: ``runtime_check="replan"``,
        ``offload="activations"``) are capped."""
        left = excess_bytes
        caps: dict[Any, int] = {}
        for k, e in reversed(self.earlier(key)):
            if left <= 0:
                break
            replanner = self._replanners.get(k)
            if replanner is None:
                continue
            current = self._kept(k, e)
            probe = self._caps.get(k, (None, None, None))[2]
            if probe is not None and probe.missed:
                floor = current
            elif probed and getattr(replanner, "may_recompute", False):
                floor = 0
            else:
                floor = e.kept_floor_bytes
            room = current - floor
            if room <= 0:
                continue
            take = min(room, -(-left // e.runs))
            caps[k] = current - take
            left -= take * e.runs
        return caps, max(0, left)

    def set_caps(self, caps: dict[Any, int], for_label: str, probe: bool = False) -> None:
        """Enter ``caps`` (pair key -> bytes, :meth:`plan_caps`) for the later pair ``for_label``:
        the holdings count them at once; each capped pair's runtime check plans it again with its
        cap at its next call (the next step's start, ``CompileSession.model_state`` reads it).

        With ``probe`` (a later pair's compile deciding the caps), each capped pair whose runtime
        check can say so (``CheckedCompile.probe_cap``, a plan made now as its next call will
        make it) is counted by that plan: where it keeps more than its cap (no plan meets the cap
        within the pair's own budget: its lowest-peak plan; under ``strategy="recompute"`` a
        recomputed saved activation keeps its chain's leaves), the cap is what it keeps, and
        :meth:`plan_caps` asks it for no less; its own peak under that plan is its predicted own
        peak in :meth:`report` and :meth:`earlier` (recomputing more raises it) until it is
        planned again. Without a probe the cap alone is counted.

        Raises:
            ValueError: a cap < 0 bytes.
        """
        for k, cap in caps.items():
            if cap < 0:
                raise ValueError(f"StepLedger.set_caps: a cap must be >= 0 bytes, got {cap} for {k!r}")
            found = None
            replanner = self._replanners.get(k) if probe else None
            probed = replanner.probe_cap(cap) if replanner is not None else None
            if probed is not None:
                kept, own = probed
                found = CapProbe(kept_bytes=kept, own_peak_bytes=own, missed=kept > cap)
                cap = max(cap, kept)
            self._caps[k] = (cap, for_label, found)

    def caps(self) -> dict[Any, tuple[int, str, CapProbe | None]]:
        """A copy of the caps (pair key -> (bytes, later pair's label, its probe's plan or
        ``None``)), to put back with :meth:`restore_caps` when the caps are not applied after
        all."""
        return dict(self._caps)

    def restore_caps(self, caps: dict[Any, tuple[int, str, CapProbe | None]]) -> None:
        self._caps = dict(caps)

    def keys(self) -> tuple[Any, ...]:
        """The pairs' keys, in forward order (as :attr:`entries`)."""
        return tuple(self._entries)

    def _is_after(self, k: Any, key: Any) -> bool:
        """Whether pair ``k`` runs its forward after pair ``key``'s: recorded after it, or not
        recorded yet (compiling now) while ``key`` is."""
        if k == key:
            return False
        keys = list(self._entries)
        if k not in self._entries:
            return True
        return key in self._entries and keys.index(k) > keys.index(key)

    def later_input_bytes(self, key: Any) -> int:
        """Device bytes of the inputs of the pairs after ``key`` that exist from the step's start
        (the step's inputs that only later pairs read, :meth:`set_later_inputs`): alive on the
        device while pair ``key`` runs, its forward and its backward."""
        return sum(b for k, b in self._later_inputs.items() if self._is_after(k, key))

    def set_later_inputs(self, key: Any, nbytes: int) -> None:
        """Pair ``key`` reads ``nbytes`` of inputs that exist from the step's start and that no
        earlier pair reads or makes (:func:`step_input_bytes`): every earlier pair's holdings
        count them (replaces ``key``'s figure: a recompile of its frame)."""
        if nbytes < 0:
            raise ValueError(f"StepLedger.set_later_inputs: bytes must be >= 0, got {nbytes}")
        if nbytes:
            self._later_inputs[key] = nbytes
        else:
            self._later_inputs.pop(key, None)

    def later_output_bytes(self, key: Any) -> int:
        """Device bytes of the later pairs' outputs that the caller holds through pair ``key``'s
        backward: the loss (``mse_loss`` returns it in a storage of its input's size), logits
        returned with it. Predicted at the compiles as the loss the step's last pair returns
        (:meth:`set_pair_outputs`), and the most the runtime check found alive when ``key``'s
        backward started (:meth:`set_later_outputs`), whichever is larger. The ledger counts them
        held while pair ``key`` runs, its forward too (conservative)."""
        predicted = sum(b for k, b in self._last_outputs.items() if self._is_after(k, key))
        return max(predicted, self._later_outputs.get(key, 0))

    def set_pair_outputs(self, key: Any, nbytes: int) -> None:
        """Pair ``key`` (compiled now) returns a loss in ``nbytes`` of device storage
        (:func:`~.passes.liveness.loss_output_bytes`). While no pair of the step is recorded
        after it, it is the step's last: the caller holds the loss through the backwards of every
        earlier pair, which count it. A pair that another compiles after passes its outputs on
        (the next pair's inputs): its prediction is dropped, and what the caller does hold of
        any pair's outputs (logits too) the runtime check finds (:meth:`set_later_outputs`).
        Totals below :data:`MIN_HELD_OUTPUT_BYTES` (a plain loss scalar) are not counted."""
        if nbytes < 0:
            raise ValueError(f"StepLedger.set_pair_outputs: bytes must be >= 0, got {nbytes}")
        for k in list(self._last_outputs):
            if self._is_after(key, k):
                del self._last_outputs[k]
        if nbytes >= MIN_HELD_OUTPUT_BYTES and not self.has_later(key):
            self._last_outputs[key] = nbytes
        else:
            self._last_outputs.pop(key, None)

    def later_held_bytes(self, key: Any) -> int:
        """:meth:`later_input_bytes` + :meth:`later_output_bytes`: what pairs after ``key`` hold
        while it runs besides their parameters and gradients."""
        return self.later_input_bytes(key) + self.later_output_bytes(key)

    def set_later_outputs(self, key: Any, nbytes: int) -> None:
        """The runtime check of pair ``key`` found ``nbytes`` of later pairs' outputs alive when
        its backward started (:meth:`later_outputs_alive`); the ledger keeps the most seen."""
        if nbytes < 0:
            raise ValueError(f"StepLedger.set_later_outputs: bytes must be >= 0, got {nbytes}")
        if nbytes >= MIN_HELD_OUTPUT_BYTES and nbytes > self._later_outputs.get(key, 0):
            self._later_outputs[key] = nbytes

    def later_outputs_alive(self, key: Any, device: torch.device) -> int:
        """Device bytes (on ``device``) of the storages of the outputs that the pairs after
        ``key`` made at their latest calls and that are alive now, each storage once and whole,
        leaving out storages that ``key`` or the pairs before it read or made (their own
        accounting counts them) and the model's parameters'. Called when ``key``'s backward
        starts: what the caller still holds of the later pairs' results then (the loss it calls
        ``backward()`` on, logits returned with it) stays alive through it."""
        mine: set[int] = set()
        for k, entries in self._io.items():
            if not self._is_after(k, key):
                mine.update(ptr for ref, ptr in entries if ref() is not None)
        root = self._root()
        if root is not None:
            for p in root.parameters():
                try:
                    mine.add(_local(p).untyped_storage().data_ptr())
                except (RuntimeError, NotImplementedError):
                    continue
        seen: set[int] = set()
        total = 0
        for k, entries in self._outputs.items():
            if not self._is_after(k, key):
                continue
            for ref, ptr in entries:
                t = ref()
                if t is None or not ptr or ptr in mine or ptr in seen:
                    continue
                try:
                    local = _local(t)
                    if local.device != device:
                        continue
                    nbytes = local.untyped_storage().nbytes()
                except (RuntimeError, NotImplementedError):
                    continue
                seen.add(ptr)
                total += nbytes
        return total

    def note_call(self, key: Any, refs: tuple, outputs: tuple = ()) -> None:
        """The storages of pair ``key``'s latest call's inputs and outputs (``refs``,
        :func:`storage_refs` of its tensors other than parameters): a later pair's compile reads
        them (:meth:`step_storages`); and of its outputs alone (``outputs``): an earlier pair's
        backward finds those the caller still holds (:meth:`later_outputs_alive`)."""
        self._io[key] = tuple(refs)
        self._outputs[key] = tuple(outputs)

    def step_storages(self, before: Any) -> set[int]:
        """Addresses of the storages that the pairs before ``before`` read or made at their
        latest calls and that are still alive (a dead tensor's address may be reused by
        another)."""
        found = set()
        for k, entries in self._io.items():
            if not self._is_after(before, k):
                continue
            for ref, ptr in entries:
                if ref() is not None and ptr:
                    found.add(ptr)
        return found

    def holdings(
        self, key: Any, own_params: set[int], offload: str, device: torch.device | None = None
    ) -> tuple[int, int, int]:
        """What the step holds on the device outside pair ``key`` while it runs, in bytes:
        ``(planned, unplanned, step unplanned peak so far)``. ``planned`` counts the earlier
        pairs' kept saved activations under their plans, ``unplanned`` all their saved
        activations; both add the parameters and gradients outside the pair and DDP's buckets.
        An earlier pair with a cap (:meth:`set_caps`) counts at most its cap.
        The third figure is the largest unplanned step peak of the other pairs recorded: those
        before it and, when the pair is planned again after the step's later pairs compiled
        (:meth:`has_later`: the runtime check's replan), those after it too, so that a
        percentage budget resolves to the same bytes as the step's check at its last pair."""
        earlier = [e for _k, e in self.earlier(key)]
        params, grads = self._model_state_bytes(own_params, offload, device)
        base = params + grads + self._bucket_bytes() + self.later_held_bytes(key)
        # An earlier pair run N times per step (a reused block graph) holds N runs' worth.
        inputs = sum(e.input_bytes * e.runs for e in earlier)
        return (
            base + inputs + self.earlier_kept(key),
            base + inputs + sum(e.kept_unplanned_bytes * e.runs for e in earlier),
            max(
                (self._now(k, e).step_unplanned_peak_bytes for k, e in self._entries.items() if k != key),
                default=0,
            ),
        )

    def _now(self, k: Any, e: PairHolding) -> PairHolding:
        """Pair ``k``'s entry ``e`` with the later pairs' inputs the ledger knows now in its held
        bytes (a later pair compiled after it was planned), and whether that is more than its plan
        counted (:attr:`PairHolding.later_inputs_due`); with a probed cap (:meth:`set_caps`), its
        own peak under the plan the probe made."""
        probe = self._caps.get(k, (None, None, None))[2]
        if probe is not None:
            # Its plan under the cap (set_caps): the one its runtime check makes at its next call.
            e = replace(e, own_planned_peak_bytes=probe.own_peak_bytes, own_lowest_peak_bytes=probe.own_peak_bytes)
        inputs, outputs = self.later_input_bytes(k), self.later_output_bytes(k)
        if inputs == e.later_input_bytes and outputs == e.later_output_bytes:
            return e
        delta = inputs + outputs - e.later_input_bytes - e.later_output_bytes
        return replace(
            e,
            held_bytes=e.held_bytes + delta,
            held_unplanned_bytes=e.held_unplanned_bytes + delta,
            later_input_bytes=inputs,
            later_output_bytes=outputs,
            later_inputs_due=delta > 0 and self.can_replan(k),
        )

    def has_later(self, key: Any) -> bool:
        """Whether a pair recorded after pair ``key`` is in the ledger: the step's later pairs
        compiled, so the step is known whole when ``key`` is planned again (a runtime replan),
        and its budget is checked at once instead of waiting for a later compile that does not
        come."""
        keys = list(self._entries)
        return key in self._entries and keys.index(key) < len(keys) - 1

    def record(self, key: Any, holding: PairHolding) -> None:
        """Enter (or replace, keeping its place) pair ``key``'s holding. A probe of its cap
        (:meth:`set_caps`) is dropped: the holding is its plan now."""
        self._entries[key] = holding
        cap = self._caps.get(key)
        if cap is not None and cap[2] is not None:
            self._caps[key] = (cap[0], cap[1], None)

    def counts(self, key: Any, holding: PairHolding | None, before: Any) -> bool:
        """Whether the holdings of pair ``before`` count pair ``key``'s ``holding``: it is the
        entry recorded for ``key`` now (not replaced by a recompile of its frame) and ``key``
        comes before ``before``."""
        if holding is None or self._entries.get(key) is not holding:
            return False
        for k in self._entries:
            if k == before:
                return False
            if k == key:
                return True
        return False

    def parameter_ids(self) -> set[int]:
        """Ids of the model's parameters. The holdings of a pair count every one of them outside
        the pair (:meth:`holdings`); a run of a reused block graph reads other blocks' parameters
        than the compile's, of the same bytes, so all of them are counted for any run."""
        root = self._root()
        return set() if root is None else {id(p) for p in root.parameters()}

    def report(self) -> StepReport:
        """The step's report: each pair's held bytes with the earlier pairs' kept saved
        activations as they keep them now (a cap, or a replan under one, lowers them), and its
        cap, if any."""
        entries = []
        for k, e in self._entries.items():
            e = self._now(k, e)
            now = self.earlier_kept(k)
            cap = self._caps.get(k)
            measured, due = self._measured(k)
            entries.append(
                replace(
                    e,
                    held_bytes=e.held_bytes - e.held_kept_bytes + now,
                    held_kept_bytes=now,
                    kept_cap_bytes=None if cap is None else cap[0],
                    capped_for=None if cap is None else cap[1],
                    own_measured_peak_bytes=measured,
                    measured_replan_due=due,
                )
            )
        entries = tuple(entries)
        budgets = [e.budget_bytes for e in entries]
        measured = [e.step_measured_peak_bytes for e in entries if e.step_measured_peak_bytes is not None]
        return StepReport(
            measured_peak_bytes=max(measured) if measured else None,
            # A percentage's base grows with the pairs compiled: the last, largest, is the step's.
            budget_bytes=None if not budgets or None in budgets else max(budgets),
            predicted_peak_bytes=max((e.step_peak_bytes for e in entries), default=0),
            unplanned_peak_bytes=max((e.step_unplanned_peak_bytes for e in entries), default=0),
            pairs=entries,
        )


def _detached_ledger() -> StepLedger:
    ledger = StepLedger.__new__(StepLedger)
    ledger._root = lambda: None
    ledger._ddp = None
    ledger._entries = {}
    ledger._caps = {}
    ledger._replanners = weakref.WeakValueDictionary()
    ledger._checkers = weakref.WeakValueDictionary()
    ledger._later_inputs = {}
    ledger._io = {}
    ledger._outputs = {}
    ledger._later_outputs = {}
    ledger._last_outputs = {}
    return ledger


@dataclass
class StepPair:
    """One pair's membership in a step: its ledger, key, label and the parameters it reads.

    Attributes:
        ledger: the step's :class:`StepLedger`.
        key: the pair's identity in the ledger (frame code object, split index).
        label: for reports.
        params: the real parameters it reads (id -> parameter).
        split: ``(index, count)`` of a DDP split, else ``None``.
        graph_break: Dynamo compiles the frame's graph because of a graph break: more pairs of
            the step follow (the code after the break).
        compiled_alone: the module owning its parameters was compiled on its own
            (``module.compile()``: a block that identical blocks may run the graph of).
        predicted_runs: the runs of the pair alive at once in one step as predicted at its
            compile from the module structure (:func:`predict_runs`; 1: none predicted).
        predicted_why: the reason for ``predicted_runs`` (empty with 1).
    """

    ledger: StepLedger
    key: Any
    label: str
    params: dict[int, torch.nn.Parameter]
    split: tuple[int, int] | None = None
    graph_break: bool = False
    compiled_alone: bool = False
    predicted_runs: int = 1
    predicted_why: str = ""

    @property
    def more_coming(self) -> bool:
        """Whether more pairs of the step compile after this one: a DDP split that is not its
        frame's last, or a graph ending at a graph break."""
        return self.graph_break or (self.split is not None and self.split[0] < self.split[1] - 1)

    def holdings(self, offload: str) -> tuple[int, int, int]:
        device = next((_local(p).device for p in self.params.values()), None)
        return self.ledger.holdings(self.key, set(self.params), offload, device)

    def record(
        self,
        plan,
        held: tuple[int, int, int],
        held_kept: int = 0,
        min_offload_bytes: int = 0,
        later: tuple[int, int] = (0, 0),
    ) -> PairHolding:
        """Record ``plan`` (a :class:`~offload_compiler.pipeline.PairPlan`, after the rewrites)
        in the ledger; returns the holding. ``held_kept``: the part of ``held[0]`` that is the
        earlier pairs' kept saved activations (:meth:`StepLedger.earlier_kept`);
        ``min_offload_bytes``: the option (what cannot be offloaded is the pair's floor);
        ``later``: the parts of ``held`` that are later pairs' inputs and held outputs
        (:meth:`StepLedger.later_input_bytes`, :meth:`StepLedger.later_output_bytes`)."""
        from .passes.plan_window import planned_live_bytes

        act, view, live = plan.activations, plan.activation_liveness, plan.liveness
        own_planned = int(planned_live_bytes(view, act.evictions).max()) if view.num_steps else 0
        if plan.verified_peak_bytes is not None:
            own_planned = plan.verified_peak_bytes
        holding = PairHolding(
            label=self.label,
            kept_bytes=kept_saved_bytes(view, {e.buffer for e in act.evictions}),
            kept_unplanned_bytes=kept_saved_bytes(live, set()),
            param_bytes=sum(_nbytes(p) for p in self.params.values()),
            input_bytes=input_bytes(live),
            held_bytes=held[0],
            held_unplanned_bytes=held[1],
            own_unplanned_peak_bytes=live.peak_bytes,
            own_planned_peak_bytes=own_planned,
            budget_bytes=plan.step_budget_bytes,
            runs=plan.model_state.reuse_count,
            kept_floor_bytes=kept_saved_bytes(live, {b.id for b in live.candidates(min_offload_bytes)}),
            held_kept_bytes=held_kept,
            later_input_bytes=later[0],
            later_output_bytes=later[1],
            own_lowest_peak_bytes=min(own_planned, int(act.lowest_reachable_peak_bytes)),
        )
        self.ledger.record(self.key, holding)
        return holding


def storage_refs(tensors) -> tuple:
    """``(weak reference to the tensor, its storage's address)`` for each of ``tensors`` that has
    one storage (:meth:`StepLedger.note_call`); no tensor is kept alive."""
    out = []
    for t in tensors:
        try:
            ptr = t.untyped_storage().data_ptr()
            out.append((weakref.ref(t), ptr))
        except (RuntimeError, NotImplementedError, TypeError):  # no one storage: not known
            continue
    return tuple(out)


def input_bytes(live) -> int:
    """Device bytes of the forward's inputs other than parameters in ``live``."""
    from .passes.liveness import BufferKind

    return sum(b.size_bytes for b in live.buffers if b.on_device and b.kind == BufferKind.INPUT)


def kept_saved_bytes(live, evicted: set[int]) -> int:
    """Device bytes of saved activations (and of the inner compiler's layout copies saved in place of
    inputs) alive across the forward/backward boundary of ``live`` (a
    :class:`~offload_compiler.passes.liveness.Liveness`), leaving out buffer ids ``evicted``
    (:attr:`~offload_compiler.passes.liveness.Liveness.boundary_saved`)."""
    return sum(size for bid, size in live.boundary_saved.items() if bid not in evicted)


def _ddp_split_position() -> tuple[int, int] | None:
    """``(index, count)`` of the DDP split being compiled: found on the stack, in the
    ``SubmodCompiler`` (``torch/_dynamo/backends/distributed.py``) compiling it, whose module is
    the split graph (its ``call_module`` nodes are the splits; compiled ones are renamed
    ``compiled_*``). ``None`` when not compiling a DDP split."""
    try:
        from torch._dynamo.backends.distributed import SubmodCompiler
    except ImportError:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, SubmodCompiler):
            calls = [n for n in owner.module.graph.nodes if n.op == "call_module"]
            done = sum(str(n.target).startswith("compiled_") for n in calls)
            return (done, len(calls))
        frame = frame.f_back
    return None


def _enclosing_module(module: torch.nn.Module) -> torch.nn.Module:
    """The outermost ``nn.Module`` running on the Python stack (a frame's ``self``) that contains
    ``module`` among its submodules, else ``module`` itself.

    Dynamo compiles the frame of a module called from a frame it could not compile whole (a graph
    break inside a nested call): the caller, running eagerly, is on the stack, and the pairs on
    both sides of the break belong to its step. ``torch.compile``'s ``OptimizedModule`` wrapper is
    skipped (its ``_orig_mod`` is the model itself).

    Only the frames of ``nn.Module._call_impl`` are read: reading a frame's ``f_locals`` (Python
    < 3.13) leaves a snapshot of its locals on the frame until it next syncs, which would keep a
    user's objects alive past their ``del`` (an optimizer, host-pool blocks); a module call's
    locals (the module, its arguments) live for the call anyway."""
    from torch._dynamo.eval_frame import OptimizedModule

    call_impl = torch.nn.Module._call_impl.__code__
    best = module
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self") if frame.f_code is call_impl else None
        if (
            isinstance(owner, torch.nn.Module)
            and owner is not best
            and not isinstance(owner, OptimizedModule)
            and any(m is best for m in owner.modules())
        ):
            best = owner
        frame = frame.f_back
    return best


def join_step(gm, example_inputs, engine) -> StepPair | None:
    """The :class:`StepPair` of the pair being compiled from ``gm`` (a Dynamo graph), or
    ``None`` when it is not part of a model's step (no module owns its parameters, or it is
    compiled outside Dynamo). Under FSDP2 (per-block compile) the ledger is the block's: the
    block graph's runs by the other blocks are measured by the runtime check (module
    docstring)."""
    from .param_offload import owning_roots, real_parameters

    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        output = InstructionTranslator.current_tx().output
        code = output.root_tx.f_code
        graph_break = bool(getattr(getattr(output, "compile_subgraph_reason", None), "graph_break", False))
    except Exception:  # noqa: BLE001  (not inside a Dynamo compile: nothing to join)
        return None
    params = real_parameters(example_inputs, gm)
    ddp = engine.module if engine.kind == "ddp" else None
    if ddp is not None:
        root = ddp.module
        holder = ddp
    else:
        roots = owning_roots(gm, sorted(params))
        if not roots:
            step = _join_by_ancestry(code, example_inputs, graph_break)
            if step is not None:
                _note_step_inputs(step, example_inputs, params)
            return step
        root = holder = _enclosing_module(roots[0])
    ledger = getattr(holder, LEDGER_ATTR, None)
    if not isinstance(ledger, StepLedger) or not ledger.belongs_to(root):
        ledger = StepLedger(root, ddp)
        setattr(holder, LEDGER_ATTR, ledger)
    if ddp is None and roots[0] is not holder:
        setattr(roots[0], LEDGER_ATTR, ledger)  # step_report() of the inner module finds the step
    split = _ddp_split_position() if ddp is not None else None
    index = split[0] if split is not None else 0
    label = code.co_name + (f" (DDP split {index} of {split[1]})" if split is not None else "")
    key = (code, index)
    if ddp is None:
        # Another graph of the same frame whose run is alive among this one's inputs' ancestors
        # is the same step's (the first block's own graph): a second entry, not a replacement.
        alive = _alive_keys(example_inputs, ledger)
        k = 1
        while key in alive:
            key = (code, index, k)
            k += 1
        if k > 1:
            label += f" (graph {k} of the frame)"
    alone = ddp is None and getattr(roots[0], "_compiled_call_impl", None) is not None
    runs, why = (1, "") if ddp is not None else predict_runs(roots[0], holder, example_inputs, params)
    step = StepPair(ledger, key, label, {id(p): p for p in params.values()}, split, graph_break, alone, runs, why)
    if ddp is None:
        _note_step_inputs(step, example_inputs, params)
    return step


def _note_step_inputs(step: StepPair, example_inputs, params: dict) -> None:
    """Enter in the ledger the bytes of ``step``'s inputs that exist from the step's start
    (:func:`step_input_bytes`), which its earlier pairs' holdings count."""
    try:
        nbytes = step_input_bytes(example_inputs, params, step.ledger, step.key)
    except Exception:  # noqa: BLE001  (inputs that cannot be read: nothing known, as before)
        return
    step.ledger.set_later_inputs(step.key, nbytes)


def step_input_bytes(example_inputs, params: dict, ledger: StepLedger, key: Any) -> int:
    """Device bytes of the inputs of pair ``key`` (compiling now, on its real example inputs)
    that are alive while the pairs before it run: the tensors that exist from the step's start.

    Decided by runtime identity, at this compile (inside the step, after the earlier pairs'
    forwards ran): an input (not a parameter of the model, which the ledger counts already) is
    *made in the step* when its storage is one that an earlier pair read or made at its latest
    call (:meth:`StepLedger.note_call`, recorded by the runtime check's wrapper: an earlier
    pair's input counts in that pair's liveness and as its input after it), or when its autograd
    graph reaches a run of an earlier pair that is alive (:func:`~.step_check.runs_before`: eager
    code between the graphs computed it from an earlier pair's output, so it did not exist before
    that pair's forward). Every other input counts: the step's inputs that only later pairs read
    (labels, a teacher's logits), and, conservatively, tensors that eager code made without
    autograd from earlier pairs' outputs, or all inputs where the earlier pairs are not watched
    (``runtime_check="off"``). A leaf input that requires a gradient counts twice (its gradient,
    made by this pair's backward, is alive through the earlier pairs' backwards). Each storage
    counts once, whole. Fake inputs (a DDP split's) are not known: not counted."""
    from torch._subclasses.fake_tensor import FakeTensor

    from .step_check import runs_before

    known = ledger.step_storages(key)
    model_params = ledger.parameter_ids()
    device = next((_local(p).device for p in params.values()), None)
    root = ledger._root()
    if device is None and root is not None:
        device = next((_local(p).device for p in root.parameters()), None)
    own = {id(p) for p in params.values()}
    seen: set[int] = set()
    total = 0
    for i, t in enumerate(example_inputs):
        if not isinstance(t, torch.Tensor) or i in params or id(t) in own or id(t) in model_params:
            continue
        if isinstance(t, FakeTensor) or isinstance(t, torch.nn.Parameter):
            continue
        local = _local(t)
        if (
            local.device.type == "meta"
            or isinstance(local, FakeTensor)
            or (device is not None and local.device != device)
        ):
            continue  # not on the pair's device (host memory) or not real
        try:
            storage = local.untyped_storage()
            ptr, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # a subclass without one storage: its bytes
            ptr, size = None, _nbytes(t)
        if ptr is not None and (ptr in known or ptr in seen or size == 0):
            continue
        if t.grad_fn is not None:
            try:
                made = any(
                    r.session.step is not None and r.session.step.ledger is ledger and r.session.step.key != key
                    for r in runs_before([t])
                )
            except Exception:  # noqa: BLE001  (a graph that cannot be walked: counted)
                made = False
            if made:
                continue
        if ptr is not None:
            seen.add(ptr)
        total += size * (2 if t.requires_grad and t.grad_fn is None else 1)
    return total


def _compile_signature(module: torch.nn.Module, wrappers: dict[int, torch.nn.Module]) -> tuple | None:
    """How ``module`` was compiled on its own: ``(backend name, torch.compile's keyword
    arguments)``, read from ``module.compile()``'s ``_compiled_call_impl`` or from the
    ``OptimizedModule`` in ``wrappers`` (id of its ``_orig_mod`` -> wrapper) that wraps it
    (``torch.compile(block)``); ``("?", None)`` where it was but the backend cannot be read (a
    torch without ``_TorchCompileWrapper``), ``None`` where it was not compiled on its own.
    Dynamo runs one compiled graph for two modules only when their backends compare equal: the
    same backend with the same options (another option compiles another graph)."""
    fn = getattr(module, "_compiled_call_impl", None)
    callbacks = []
    if fn is not None:
        callbacks = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if _cell_set(c)]
    elif id(module) in wrappers:
        callbacks = [getattr(getattr(wrappers[id(module)], "dynamo_ctx", None), "callback", None)]
    else:
        return None
    for cb in callbacks:
        seen = 0
        while cb is not None and seen < 8:
            if hasattr(cb, "compiler_name") and hasattr(cb, "kwargs"):
                return (cb.compiler_name, cb.kwargs)
            cb = getattr(cb, "_torchdynamo_orig_backend", None)
            seen += 1
    return ("?", None)


def _cell_set(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018  (an empty cell raises)
    except ValueError:
        return False
    return True


def _shape_signature(module: torch.nn.Module) -> tuple:
    """Parameter and buffer names, shapes (a DTensor's global shape), dtypes and whether they
    need a gradient: what Dynamo's guards see of two blocks that run one compiled graph."""
    return (
        tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters()),
        tuple((n, tuple(b.shape), b.dtype) for n, b in module.named_buffers()),
    )


def predict_runs(block: torch.nn.Module, holder: torch.nn.Module, example_inputs, params: dict) -> tuple[int, str]:
    """The runs of the pair being compiled for ``block`` that one training step will have alive
    at once, predicted from the module structure at its compile (the first block's call), before
    any run: ``(N, reason)``, ``(1, "")`` where nothing is predicted.

    A block compiled on its own (``block.compile(...)``, ``torch.compile(block)`` in its parent,
    FSDP2's per-block compile) gives one Dynamo graph that every identical block compiled the
    same way runs (``F1 .. FN BN .. B1``). The siblings are the modules of ``holder`` (the module
    whose forward calls the blocks, :func:`_enclosing_module`) of ``block``'s class, with its
    parameter and buffer shapes, compiled with the same backend and options
    (:func:`_compile_signature`); the graph compiling at ``block``'s call runs for ``block`` and
    the siblings after it in module order (taken as the call order): N of them. Predicted only
    where some input other than the parameters needs a gradient: a block whose input needs none
    (the first of a chain, on the step's input) compiles a graph of its own, which the blocks after
    it, whose inputs need gradients, do not run (they compile another one, predicted there).

    A wrong prediction (blocks called in another order, some not called, run apart in the step)
    is corrected by the runtime check of the first step, which measures the runs alive at once
    and plans the pair again for them (``step_check.py``); until then the plan covers N runs.

    Args:
        block: the module owning the pair's parameters (``owning_roots``).
        holder: the outermost module running on the stack that contains ``block``.
        example_inputs: the compile's example inputs.
        params: input position -> real parameter (``real_parameters``).

    Returns:
        ``(N >= 1, reason)``.
    """
    if holder is block:
        return 1, ""  # called from outside any module: the siblings are not known
    from torch._dynamo.eval_frame import OptimizedModule

    try:
        wrappers = {id(m._orig_mod): m for m in holder.modules() if isinstance(m, OptimizedModule)}
        mine = _compile_signature(block, wrappers)
        if mine is None:
            return 1, ""
        if not any(
            isinstance(x, torch.Tensor) and x.requires_grad for i, x in enumerate(example_inputs) if i not in params
        ):
            return 1, ""
        shapes = _shape_signature(block)
        siblings = [
            m
            for m in holder.modules()
            if type(m) is type(block)
            and (m is block or (_compile_signature(m, wrappers) == mine and _shape_signature(m) == shapes))
        ]
    except Exception:  # noqa: BLE001  (a module that cannot be read: nothing predicted)
        return 1, ""
    index = next((i for i, m in enumerate(siblings) if m is block), None)
    if index is None:
        return 1, ""
    runs = len(siblings) - index
    if runs < 2:
        return 1, ""
    name = type(block).__name__
    return runs, (
        f"predicted at its compile: {len(siblings)} {name} modules in {type(holder).__name__} compiled alike"
        + (f", of which the last {runs} run this graph" if index else "")
    )


def _join_by_ancestry(code, example_inputs, graph_break: bool) -> StepPair | None:
    """The :class:`StepPair` of a pair that reads no parameter (the loss after a graph break
    inside a submodule: Dynamo resumes the outer frame, whose graph holds only the loss), in the
    ledger of the pairs whose runs are alive among its inputs' autograd ancestors: it runs in
    their step, beside what they keep. ``None`` where no such run is alive (a function of
    tensors on its own: planned alone, as before). It never creates a ledger."""
    from .step_check import runs_before

    try:
        runs = runs_before(example_inputs)
    except Exception:  # noqa: BLE001  (fake inputs, or a graph that cannot be walked: none known)
        return None
    steps = [r.session.step for r in runs if r.session.step is not None]
    if not steps:
        return None
    ledger = steps[0].ledger
    alive = {st.key for st in steps if st.ledger is ledger}
    key, k = (code, 0), 1
    while key in alive:
        key = (code, 0, k)
        k += 1
    label = code.co_name + " (no parameters; in the step of the pairs its inputs come from)"
    return StepPair(ledger, key, label, {}, None, graph_break, False)


def _alive_keys(example_inputs, ledger: StepLedger) -> set:
    """Ledger keys of the pairs of ``ledger`` with a run alive (forward run, backward not yet)
    among the autograd ancestors of ``example_inputs`` (the real inputs Dynamo compiles with)."""
    from .step_check import runs_before

    try:
        runs = runs_before(example_inputs)
    except Exception:  # noqa: BLE001  (fake inputs, or a graph that cannot be walked: none known)
        return set()
    return {r.session.step.key for r in runs if r.session.step is not None and r.session.step.ledger is ledger}


def step_report(module: torch.nn.Module) -> StepReport | None:
    """The training step's :class:`StepReport` for ``module`` (the model given to
    ``torch.compile``, or its DDP wrapper), or ``None`` before any of its pairs compiled.

    For a model whose blocks were compiled one by one (``block.compile()``, FSDP2's per-block
    compile) the ledgers are the blocks' (where each pair compiled): the report gathers those of
    ``module``'s submodules, in module order, with each pair's held bytes as planned (a reused
    block graph's include its earlier runs and the other blocks' pairs that its first step showed
    beside it).

    Raises:
        TypeError: when ``module`` is not an ``nn.Module`` (a compiled function: pass the module
            whose forward it calls).
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"step_report: expected the nn.Module given to torch.compile (or its DDP wrapper), got "
            f"{type(module).__name__}; for a compiled function, pass the module whose forward it calls"
        )
    for m in (module, getattr(module, "module", None), getattr(module, "_orig_mod", None)):
        ledger = getattr(m, LEDGER_ATTR, None) if m is not None else None
        if isinstance(ledger, StepLedger):
            return ledger.report()
    ledgers = []
    for m in module.modules():
        ledger = getattr(m, LEDGER_ATTR, None)
        if isinstance(ledger, StepLedger) and ledger.belongs_to(m) and ledger.entries and ledger not in ledgers:
            ledgers.append(ledger)
    if not ledgers:
        return None
    reports = [ledger.report() for ledger in ledgers]
    budgets = [r.budget_bytes for r in reports]
    return StepReport(
        budget_bytes=None if None in budgets else max(budgets),
        predicted_peak_bytes=max(r.predicted_peak_bytes for r in reports),
        unplanned_peak_bytes=max(r.unplanned_peak_bytes for r in reports),
        pairs=tuple(p for r in reports for p in r.pairs),
    )
