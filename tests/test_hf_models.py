"""Model zoo: Hugging Face ``transformers`` architectures trained through trinity.

Tiny configs with random weights (2 layers, hidden 32, sequence 32; nothing is downloaded),
float32, dropout off. Each architecture runs two SGD steps with both inner compilers, at a
feasible budget (75%) and at 50% with ``on_infeasible="warn"`` (the lowest-peak plan), and each
case checks:

* parity: with ``inner="eager"`` the loss and every gradient are bit-identical to ``aot_eager``
  (same partitioner, same op order). With ``inner="inductor"`` both trinity and plain Inductor are
  judged against a float64 eager run of the same model and inputs: trinity's largest error may be
  at most plain Inductor's own largest error times 1.1, plus 1e-6 (Inductor's vectorized reductions
  round differently from eager, so its output is not a reference to match bit for bit);
* that something is evicted;
* the measured peak device bytes (the CPU allocator's trace, as in ``test_e2e``) within the budget
  where it is feasible;
* graph breaks: the same number of breaks and of compiled graphs as plain Inductor.

Falcon's backward has the kernel that torch's CPU Inductor (2.13, before pytorch/pytorch#191837 was
fixed) generates with a twice-scaled index on more than one thread: an accumulating ``index_put``
in a 2-D tiled loop, which under trinity's layouts wrote past its buffer. Trinity's compiles
generate it correctly (``offload_compiler/inductor_fixes.py``, tested on two threads in
``tests/test_inductor_fixes.py``), so Falcon runs with both inner compilers here.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import offload_compiler
from offload_compiler import measure_peak_device_bytes

transformers = pytest.importorskip("transformers")

BATCH, SEQ, HIDDEN, VOCAB = 8, 32, 32, 64
LR = 0.05
STEPS = 2
# As test_e2e: allocator granularity and small bookkeeping tensors outside the graphs.
PEAK_SLACK_BYTES = 64 * 1024


def _ids(seed: int, high: int = VOCAB, shape=(BATCH, SEQ)) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def _lm_batch() -> dict:
    ids = _ids(1)
    return {"input_ids": ids, "labels": ids}


def gpt2():
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=HIDDEN, n_head=2, n_positions=SEQ, vocab_size=VOCAB,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg), _lm_batch()


def _llama_config():
    return transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0,
        pad_token_id=0,
    )  # fmt: skip


def llama():
    return transformers.LlamaForCausalLM(_llama_config()), _lm_batch()


def llama_checkpointed():
    """Llama with Hugging Face's gradient checkpointing (non-reentrant ``torch.utils.checkpoint``
    around each decoder layer)."""
    model = transformers.LlamaForCausalLM(_llama_config())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, _lm_batch()


def bert():
    cfg = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_attention_heads=2,
        vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        pad_token_id=0,
    )  # fmt: skip
    return transformers.BertForMaskedLM(cfg), _lm_batch()


def t5():
    cfg = transformers.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=HIDDEN, d_ff=2 * HIDDEN, num_heads=2, d_kv=16,
        vocab_size=VOCAB, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(cfg), {"input_ids": _ids(1), "labels": _ids(2, shape=(BATCH, 16))}


def vit():
    cfg = transformers.ViTConfig(
        num_hidden_layers=2, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_attention_heads=2,
        image_size=32, patch_size=8, num_labels=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    return transformers.ViTForImageClassification(cfg), {
        "pixel_values": torch.randn(BATCH, 3, 32, 32, generator=g),
        "labels": torch.randint(0, 4, (BATCH,), generator=g),
    }


def falcon():
    cfg = transformers.FalconConfig(
        num_hidden_layers=2, hidden_size=HIDDEN, num_attention_heads=2, vocab_size=VOCAB, hidden_dropout=0.0,
        attention_dropout=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.FalconForCausalLM(cfg), _lm_batch()


def mixtral():
    """Mixture of experts: 4 experts, 2 per token."""
    cfg = transformers.MixtralConfig(
        num_hidden_layers=2, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(cfg), _lm_batch()


ARCHS = {
    "gpt2": gpt2,
    "llama": llama,
    "llama_checkpointed": llama_checkpointed,
    "bert": bert,
    "t5": t5,
    "vit": vit,
    "falcon": falcon,
    "mixtral": mixtral,
}
# "feasible": 75% of each graph's unplanned peak, where the model's body (the largest graph) can
# always be planned. With checkpointing only each layer's input is saved, so offloading lowers the
# peak by little (at these sizes from 897 KiB to 865 KiB): 97% there. A graph break leaves small
# graphs (the loss after a break) whose peak offloading cannot lower: "warn" runs those at their
# lowest peak. "50%": below the lowest reachable peak of most of these models, the lowest-peak
# plan runs.
FEASIBLE = {"llama_checkpointed": "97%"}
# Under Inductor, checkpointed Llama's peak is in the first layer's backward (its recomputed
# attention and MLP temporaries, with every parameter gradient accumulated), where the only saved
# activation still alive is that layer's input, which the recomputation reads: no offload lowers
# the peak at any budget. There the lowest-peak plan must evict nothing (a copy that buys nothing
# is a defect), and the report must say that the lowest reachable peak is the unplanned one.
NOTHING_HELPS = {("llama_checkpointed", "inductor")}
BUDGETS = ("feasible", "50%")
# Measured above the plan, cause not found yet (a known defect, not a tolerance): an expected
# failure of the measured-peak assertion alone, strict (an error once it passes: remove the entry
# then). Empty now. ViT under Inductor was here (578.75 KiB measured in its first step against
# 492.75 KiB planned at 75%): Inductor's channels-last copies of the patch embedding's input and
# weight, saved for the backward in their place, which the plan now counts (liveness.layout_copies).
MEASURED_OVER_PLAN: set[tuple[str, str]] = set()


def _build(arch: str):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation notices of the configs
        model, batch = ARCHS[arch]()
    model.train()
    return model, batch


def _as(batch: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}


def _count_graphs():
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


class _Run:
    """One model copy trained for ``STEPS`` steps, each from the parameters ``start[k]``."""

    def __init__(self, model, compiled, batch):
        self.model, self.compiled, self.batch = model, compiled, batch
        self.losses, self.grads = [], []

    def step(self, params):
        with torch.no_grad():
            for p, q in zip(self.model.parameters(), params):
                p.copy_(q)
        out = self.compiled(**self.batch)
        out.loss.backward()
        self.losses.append(out.loss.detach().clone())
        self.grads.append([None if p.grad is None else p.grad.detach().clone() for p in self.model.parameters()])
        self.model.zero_grad(set_to_none=True)


def _train(arch: str, backend: str, dtype=torch.float32, params=None, **compile_kw):
    """Train a fresh copy of ``arch`` for ``STEPS`` steps from ``params`` (one list per step);
    returns the run and the (graph breaks, graphs) Dynamo counted."""
    from torch._dynamo.utils import counters

    model, batch = _build(arch)
    model = model.to(dtype)
    counters.clear()
    compiled = model if backend == "none" else torch.compile(model, backend=backend, **compile_kw)
    run = _Run(model, compiled, _as(batch, dtype))
    # transformers >= 5.25 sets a context variable (its hub kernels' routing, undone on return) in
    # each decoder layer's forward; inside a checkpointed layer Dynamo refuses that side effect and
    # breaks the graph in every layer, for every backend. Replaying it in the recomputation is not
    # needed, so these runs take Dynamo's own switch for that, as its graph-break hint advises.
    side_effects = torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)
    with warnings.catch_warnings(), side_effects:
        warnings.filterwarnings("ignore", message="trinity: memory_budget")  # the 50% "warn" cases
        warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*")
        warnings.filterwarnings("ignore", message=".*use_cache=True.*")
        for k in range(STEPS):
            run.step(params[k] if params is not None else [p.detach().clone() for p in model.parameters()])
    return run, _count_graphs()


@functools.cache
def _reference(arch: str):
    """Per step: the parameters every run starts from, and the float64 eager results.

    Step k+1 starts from step k's parameters minus LR times the float64 gradients, for every run,
    so the runs are compared on the same parameters at each step."""
    model, _ = _build(arch)
    start = [[p.detach().clone() for p in model.parameters()]]
    model64, batch = _build(arch)
    model64 = model64.double()
    if getattr(model64.config, "_experts_implementation", None) == "grouped_mm":
        # torch's grouped_mm has no float64 kernel: the reference computes the same experts one by one.
        model64.set_experts_implementation("eager")
    batch64 = _as(batch, torch.float64)
    losses, grads = [], []
    for k in range(STEPS):
        with torch.no_grad():
            for p, q in zip(model64.parameters(), start[k]):
                p.copy_(q)
        out = model64(**batch64)
        out.loss.backward()
        losses.append(out.loss.detach().clone())
        grads.append([None if p.grad is None else p.grad.detach().clone() for p in model64.parameters()])
        model64.zero_grad(set_to_none=True)
        start.append([p - LR * g.float() if g is not None else p for p, g in zip(start[k], grads[k])])
    return start[:STEPS], losses, grads


@functools.cache
def _plain(arch: str, backend: str):
    torch._dynamo.reset()
    start, _, _ = _reference(arch)
    run, graphs = _train(arch, backend, params=start)
    torch._dynamo.reset()
    return run.losses, run.grads, graphs


def _error(losses, grads, ref_losses, ref_grads) -> tuple[float, float]:
    """Largest absolute error of the losses, and of every gradient element, over all steps."""
    loss_err = max((a.double() - b).abs().item() for a, b in zip(losses, ref_losses))
    grad_err = 0.0
    for step, ref_step in zip(grads, ref_grads):
        for g, r in zip(step, ref_step):
            assert (g is None) == (r is None)
            if g is not None:
                grad_err = max(grad_err, (g.double() - r).abs().max().item())
    return loss_err, grad_err


def _check_memory(model, compiled, batch, reports, budget: str, helps: bool = True, known_over: bool = False) -> None:
    """Something evicted; each graph pair's plan within its budget where the budget is reachable
    (at the "feasible" budget the pair of the model's body always is) and at its lowest reachable peak where not;
    the measured peak of a step within the step's budget (its pairs share one: ``step_report``), or
    within its predicted peak where the pairs' lowest-peak plans are above it.

    ``helps=False`` (the cases of :data:`NOTHING_HELPS`): instead, nothing is evicted and every
    pair's lowest reachable peak is its unplanned peak."""
    summaries = "\n".join(r.summary() for r in reports)
    if helps:
        assert sum(r.num_evicted for r in reports) > 0, "nothing evicted:\n" + summaries
    else:
        assert all(r.num_evicted == 0 for r in reports), "a copy that buys nothing:\n" + summaries
        assert all(r.lowest_reachable_peak_bytes == r.peak_bytes_unplanned for r in reports), summaries
    ledger = offload_compiler.step_report(model)
    assert ledger is not None and ledger.budget_bytes is not None, "no step ledger for the model"
    # The budget binds the step (its pairs share it); a pair off the step's peak (the loss after a
    # graph break) can fit it without a plan.
    assert ledger.budget_bytes < ledger.unplanned_peak_bytes, ledger.summary()
    for r in reports:
        assert r.budget_bytes is not None
        assert r.feasible == (r.lowest_reachable_peak_bytes <= r.budget_bytes), r.summary()
        if r.feasible:
            assert r.peak_bytes_planned <= r.budget_bytes
        else:
            assert r.peak_bytes_planned == r.lowest_reachable_peak_bytes
    if budget == "feasible" and helps:
        body = max(reports, key=lambda r: r.peak_bytes_unplanned)
        assert body.feasible, body.summary()

    def step():
        compiled(**batch).loss.backward()

    resident = list(model.parameters()) + [t for t in batch.values() if isinstance(t, torch.Tensor)]
    graphs = _count_graphs()
    m = measure_peak_device_bytes(step, resident=resident, device="cpu")
    model.zero_grad(set_to_none=True)
    assert _count_graphs() == graphs, "the measured step compiled again: it is not the trained model's step"
    # The step's budget (its pairs share it: step_budget.py), or its predicted peak where the pairs'
    # lowest-peak plans are above it. Not the sum of the pairs' budgets: a pair that does not run
    # in the measured step (ViT recompiles its frame at the second step, as Hugging Face sets
    # ``config.problem_type`` in the first forward) is no longer in the ledger, and the pairs that
    # run share the parameters.
    limit = ledger.budget_bytes if ledger.within_budget else ledger.predicted_peak_bytes
    if budget == "feasible" and helps:
        assert ledger.within_budget, ledger.summary()
    over = m.peak_bytes > limit + PEAK_SLACK_BYTES
    if known_over:
        assert over, f"measured peak {m.peak_bytes} now within {limit}: remove the case from MEASURED_OVER_PLAN"
        pytest.xfail(f"known defect (MEASURED_OVER_PLAN): measured peak {m.peak_bytes} exceeds {limit}")
    assert not over, f"measured peak {m.peak_bytes} exceeds {limit}\n" + (
        ledger.summary() + "\n" + "\n".join(r.summary() for r in reports)
    )


@pytest.mark.parametrize("budget", BUDGETS)
# One xdist group per architecture: its cases share the float64 reference and the plain runs
# (cached per process), so ``pytest -n 2 --dist loadgroup`` (``make test``) runs each architecture
# on one worker and the architectures side by side.
@pytest.mark.parametrize(
    "arch, inner",
    [pytest.param(a, i, marks=pytest.mark.xdist_group(f"hf-{a}")) for a in ARCHS for i in ("eager", "inductor")],
)
def test_hf_model_trains_like_its_reference(arch, inner, budget):
    start, ref_losses, ref_grads = _reference(arch)
    plain = "aot_eager" if inner == "eager" else "inductor"
    plain_losses, plain_grads, plain_graphs = _plain(arch, plain)
    # Before trinity's run: a first _plain() resets Dynamo, which would drop trinity's compiled
    # code, and the memory measurement below would then measure (and pay for) a fresh compile.
    inductor_graphs = _plain(arch, "inductor")[2]
    before = len(offload_compiler.reports())
    percent = FEASIBLE.get(arch, "75%") if budget == "feasible" else budget
    # strategy="offload": these cases check the offload rewrite on each architecture (on the CPU,
    # whose copies are synchronous, "auto" mostly recomputes instead).
    options = {
        "inner": inner,
        "min_offload_bytes": 0,
        "memory_budget": percent,
        "on_infeasible": "warn",
        "strategy": "offload",
    }
    run, graphs = _train(arch, "trinity", params=start, options=options)
    reports = offload_compiler.reports()[before:]
    assert reports, "trinity planned no training graph"
    # Graph breaks: exactly those plain Inductor has (Dynamo's, not trinity's).
    assert graphs == plain_graphs
    assert graphs == inductor_graphs
    if inner == "eager":
        for k in range(STEPS):
            assert torch.equal(run.losses[k], plain_losses[k]), f"step {k} loss"
            for i, (g, r) in enumerate(zip(run.grads[k], plain_grads[k])):
                assert (g is None) == (r is None)
                assert g is None or torch.equal(g, r), f"step {k} gradient {i}: max diff {(g - r).abs().max()}"
    else:
        loss_err, grad_err = _error(run.losses, run.grads, ref_losses, ref_grads)
        ind_loss_err, ind_grad_err = _error(plain_losses, plain_grads, ref_losses, ref_grads)
        print(
            f"{arch} {budget}: trinity grad err {grad_err:.3g} loss err {loss_err:.3g}; inductor {ind_grad_err:.3g} {ind_loss_err:.3g}"
        )
        assert grad_err <= 1.1 * ind_grad_err + 1e-6, (grad_err, ind_grad_err)
        assert loss_err <= 1.1 * ind_loss_err + 1e-6, (loss_err, ind_loss_err)
    _check_memory(
        run.model,
        run.compiled,
        run.batch,
        reports,
        budget,
        helps=(arch, inner) not in NOTHING_HELPS,
        known_over=(arch, inner) in MEASURED_OVER_PLAN,
    )


# --------------------------------------------------------- recomputation with dropout on


def _gpt2_dropout():
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=HIDDEN, n_head=2, n_positions=SEQ, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)  # resid, embd and attn dropout 0.1


def _opt_dropout():
    cfg = transformers.OPTConfig(
        num_hidden_layers=2, hidden_size=HIDDEN, ffn_dim=2 * HIDDEN, num_attention_heads=2, word_embed_proj_dim=HIDDEN,
        vocab_size=VOCAB, max_position_embeddings=SEQ, dropout=0.1, attention_dropout=0.1, bos_token_id=0,
        eos_token_id=0, pad_token_id=1,
    )  # fmt: skip
    return transformers.OPTForCausalLM(cfg)


DROPOUT_ARCHS = {"gpt2": _gpt2_dropout, "opt": _opt_dropout}


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, idx):
        return self.model(input_ids=idx).logits


@pytest.mark.parametrize("inner", ["eager", "inductor"])
@pytest.mark.parametrize("arch", sorted(DROPOUT_ARCHS))
def test_hf_dropout_models_recompute_through_constants_seeds_and_scans(arch, inner):
    """From a scan of ``transformers`` models for saved activations the planner could not
    recompute: ``torch.tensor(...)`` constants (``lift_fresh_copy`` of a ``get_attr``: GPT-2's
    and OPT's masks), Inductor's dropout seeds (``inductor_lookup_seed`` of ``inductor_seeds``)
    and OPT's ``cumsum`` position ids were refused, so whatever depends on them could only be
    kept or offloaded (GPT-2 with dropout, eager: 16 of 48 saved buffers refused). Now only
    chains longer than ``MAX_CHAIN_NODES`` are, and a recompute-only step at 40% trains
    bit-identically to ``aot_eager`` (inner eager) or to plain Inductor within float rounding
    (inner Inductor: the masks must be the same, so the seeds are)."""
    from offload_compiler import devices
    from offload_compiler.passes import cost_model, liveness, recompute_chains
    from offload_compiler.pipeline import prepare
    from offload_compiler.trace import trace_training_step

    def build():
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = DROPOUT_ARCHS[arch]()
        model.train()
        return model

    pair = trace_training_step(lambda: _Logits(build()), BATCH, SEQ, VOCAB, inner=inner).pair
    prepare(pair, inner)
    live = liveness.analyze(pair, assume_fusion=inner == "inductor")
    costs = cost_model.estimate(pair, live, devices.lookup_device("h100-sxm"))
    analysis = recompute_chains.analyze(pair, live, costs, rng_replay=inner == "eager")
    too_long = f"longer than {recompute_chains.MAX_CHAIN_NODES} nodes"
    assert [why for _b, why in analysis.refused if too_long not in why] == []
    kinds = {leaf.kind for c in analysis.chains for leaf in c.leaves}
    assert ("seeds" if inner == "inductor" else "rng state") in kinds, kinds
    if inner == "eager":  # (Inductor's decompositions fold the constants into the graph)
        assert "constant" in kinds, kinds

    ids = _ids(1)

    def train(backend, options=None):
        torch._dynamo.reset()
        model = build()
        compiled = torch.compile(model, backend=backend, options=options)
        out = []
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="trinity: memory_budget")
            for k in range(STEPS):
                torch.manual_seed(10 + k)
                loss = compiled(input_ids=ids, labels=ids).loss
                loss.backward()
                out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
                model.zero_grad(set_to_none=True)
        return out

    before = len(offload_compiler.reports())
    options = {"inner": inner, "strategy": "recompute", "memory_budget": "40%", "on_infeasible": "warn"}
    trinity = train("trinity", options)
    reports = offload_compiler.reports()[before:]
    assert sum(r.recompute["num_recomputed"] for r in reports if r.recompute) > 0
    plain = train("aot_eager" if inner == "eager" else "inductor")
    torch._dynamo.reset()
    for k, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(trinity, plain)):
        if inner == "eager":
            assert torch.equal(loss, ref_loss), f"step {k} loss"
            for i, (g, r) in enumerate(zip(grads, ref_grads)):
                assert torch.equal(g, r), f"step {k} gradient {i}: max diff {(g - r).abs().max()}"
        else:  # a different mask would differ by the gradients' size, not by rounding
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
            for g, r in zip(grads, ref_grads):
                torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


def test_the_step_after_inductors_lazy_backward_compile_is_measured_too():
    """From the sixth fresh-user trial: a dropout Llama under bf16 autocast and Inductor, at the
    62.2% its 55% refusal named. Inductor compiles the backward graph lazily, inside the first
    backward, and that first step measured 361 KB while every later step used 398 KB, above the
    391,904-byte budget, with no warning: the runtime check had measured only the first step.
    Under Inductor it now measures the next step of a plan too, and plans again for what that
    shows: from then on the step is within its budget. Whether the second step exceeds the budget
    depends on the machine's Inductor kernels; either way the step after is within it."""
    from offload_compiler.step_budget import LEDGER_ATTR

    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=64, max_position_embeddings=32, attention_dropout=0.2, bos_token_id=0, eos_token_id=0,
        pad_token_id=0,
    )  # fmt: skip
    torch._dynamo.reset()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.LlamaForCausalLM(cfg)
    model.train()
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(1))
    opts = {"inner": "inductor", "strategy": "auto", "memory_budget": "62.2%", "min_offload_bytes": 0}
    compiled = torch.compile(model, backend="trinity", options=opts)

    def step(seed):
        torch.manual_seed(seed)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    for seed in range(4):
        step(seed)
    (checker,) = getattr(model, LEDGER_ATTR)._checkers.values()
    assert len(checker.measurements) >= 2, checker.measurements
    measured = [m.peak_bytes for m in checker.measurements]
    budget = offload_compiler.last_report().budget_bytes
    c = offload_compiler.last_report().correction
    if max(measured) > budget:
        # The report names the measurement that led to the replan, above the budget (it named the
        # first step's, within it: the seventh trial).
        assert c is not None and c.first_measured_peak_bytes in measured, (c, measured)
        assert c.first_measured_peak_bytes > budget, c
    else:
        # Inductor's kernels differ by CPU: on an AMD EPYC (AVX2) the second step measured 391,376
        # bytes, within the 391,904-byte budget, so no replan was due, and none may happen.
        assert c is None, (c, measured, budget)
    report = offload_compiler.step_report(model)
    m = measure_peak_device_bytes(lambda: step(9), resident=list(model.parameters()) + [ids], device="cpu")
    assert m.peak_bytes <= report.budget_bytes + 4096, (m.peak_bytes, report.summary())
    torch._dynamo.reset()
