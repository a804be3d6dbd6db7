"""The ``torch.compile`` backend: ``torch.compile(model, backend="trinity", options={...})``.

The backend is found through the ``torch_dynamo_backends`` entry point (pyproject.toml), so a user
imports nothing; this module does not call ``register_backend`` itself (Dynamo's entry-point
loader registers it, and registering twice raises ``duplicate name``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from .options import TrinityOptions
from .pipeline import CompileSession, TrinityPartitioner
from .report import record_failure
from .runtime import ops as _ops  # noqa: F401  (registers the trinity::* ops)
from .runtime.transfer import FaultInjection, TransferRuntime

__all__ = ["trinity", "default_host_pool_limit"]


def default_host_pool_limit() -> int:
    """Half of the machine's physical memory, in bytes (the host pool's default limit)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30


def _device_of(example_inputs: Sequence[Any]) -> torch.device:
    counts: dict[torch.device, int] = {}
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            counts[x.device] = counts.get(x.device, 0) + 1
    accel = [d for d in counts if d.type != "cpu"]
    if accel:
        return max(accel, key=lambda d: counts[d])
    return torch.device("cpu")


@contextlib.contextmanager
def _no_caches():
    """The plan depends on options and on a live runtime; a warm AOTAutograd cache would skip the
    partitioner (and trinity's report). Turn the caches off while trinity compiles."""
    import torch._functorch.config as functorch_config

    patches = {"enable_autograd_cache": False}
    for name in ("bundled_autograd_cache", "force_autograd_cache"):
        if hasattr(functorch_config, name):
            patches[name] = False
    with functorch_config.patch(**patches):
        yield


def _stream_safe(compiler: Callable, runtime: TransferRuntime) -> Callable:
    """``compiler`` whose multi-stream graphs switch back to the caller's stream when they raise
    (a graph that stops between ``set_stream(1)`` and ``set_stream(0)`` would leave it current)."""

    def compile_graph(gm: fx.GraphModule, example_inputs):
        from .passes.happens_before import has_streams

        run = compiler(gm, example_inputs)
        if not has_streams(gm):
            return run

        def guarded(args):
            try:
                return run(args)
            except BaseException:
                runtime.compute_streams.restore()
                raise

        guarded._boxed_call = True
        return guarded

    return compile_graph


def _ddp_grad_sync(ddp: torch.nn.Module, slots: dict):
    """The gradient averaging of a pair compiled in ``ddp``'s forward with ``offload="all"``:
    the slots of the parameters DDP itself would reduce (requiring a gradient, not in
    ``ddp.parameters_to_ignore``)."""
    from .runtime.grad_sync import GradSync, install_idle_comm_hook

    install_idle_comm_hook(ddp)  # DDP's own reducer stays idle for what trinity reduces
    ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
    reduced = {id(p) for name, p in ddp.module.named_parameters() if p.requires_grad and name not in ignored}
    ids = frozenset(s.id for s in slots.values() if s.grad is not None and id(s.param_ref()) in reduced)
    return GradSync(ddp, ids)


def trinity(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: dict[str, Any] | TrinityOptions | None = None,
    mode: str | None = None,
    **unexpected: Any,
) -> Callable[..., Any]:
    """Compile ``gm`` (a Dynamo graph) for training with compiler-planned offloading.

    Args:
        gm: the FX graph Dynamo captured.
        example_inputs: its example (fake) inputs.
        options: trinity's options (see :class:`~offload_compiler.options.TrinityOptions`).
        mode: an Inductor mode (``"max-autotune"``, ...), only with ``inner="inductor"``.

    Returns:
        The compiled callable; it keeps the graph pair's transfer runtime alive.

    Raises:
        ValueError: for invalid options, an unexpected keyword, or ``mode`` with ``inner="eager"``.
        offload_compiler.pipeline.InfeasibleBudgetError: when no plan reaches the budget and
            ``on_infeasible="error"``.
    """
    try:
        compiled = _compile(gm, example_inputs, options, mode, unexpected)
        return _with_runtime_check(compiled, gm, example_inputs, options, mode)
    except BaseException:
        record_failure()  # last_report() must not describe an earlier graph
        raise


def _with_runtime_check(compiled, gm, example_inputs, options, mode):
    """``compiled`` measured in its first steps and replanned if the measured peak is above the
    budget (``runtime_check``; see ``step_check.py``, which says why a replan compiles
    Dynamo's graph again). Keeps ``gm``, fake copies of ``example_inputs`` and the tracing context
    for that; returns ``compiled`` itself where there is nothing to check."""
    from .step_check import CheckedCompile, session_of

    session = session_of(compiled)
    if session is None or session.options.runtime_check == "off" or session.planned_steps is None:
        return compiled
    if session.options.fault_injection is not None:
        return compiled  # a test mode for ordering bugs: deferred copies keep memory alive on purpose
    recompile = None
    if not session.param_slots:
        ctx = torch._guards.TracingContext.try_get()
        fake_mode = ctx.fake_mode if ctx is not None and ctx.fake_mode is not None else None
        if fake_mode is None:
            from torch._subclasses.fake_tensor import FakeTensorMode

            fake_mode = FakeTensorMode()
        fakes = [
            fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor) else x
            for x in example_inputs
        ]

        def recompile(margins, reuse=None, grad_bytes=0, on_infeasible=None):
            opts = (
                options if on_infeasible is None else dataclasses.replace(session.options, on_infeasible=on_infeasible)
            )
            with torch._guards.tracing(ctx) if ctx is not None else contextlib.nullcontext():
                compiled = _compile(
                    gm,
                    fakes,
                    opts,
                    mode,
                    {},
                    margins=margins,
                    step=session.step,
                    reuse=reuse,
                    grad_bytes=grad_bytes,
                    replan_of=session,
                )
                _push_ddp_bucket(ctx)
            again = session_of(compiled)
            if again is not None:
                again.param_positions = session.param_positions
            return compiled

    return CheckedCompile(compiled, session, recompile, session.options.runtime_check)


def _push_ddp_bucket(ctx) -> None:
    """After a replan's compile of one of DDP's graph splits, do what DDP's splitter does after
    each split's compile (``torch/_dynamo/backends/distributed.py``, ``SubmodCompiler``): push the
    split's forward metadata on the tracing context's ``ddp_optimizer_ctx``. AOTAutograd compiles
    the backward lazily, at its first run, and pops one entry from that stack there (Note
    [DDPOptimizer and fw_metadata] in ``runtime_wrappers.py``); without the push it finds an empty
    stack ("expected same # of fw and bw compiles, but found bucket -1"). A replan runs at a call
    after the step whose backwards popped the compile's own entries, and the backwards of several
    replanned splits run in reverse order of their forwards, so a stack keeps them matched."""
    ddp_ctx = getattr(ctx, "ddp_optimizer_ctx", None) if ctx is not None else None
    if ddp_ctx is None or ctx.fw_metadata is None:
        return
    ddp_ctx.curr_bucket += 1
    del ddp_ctx.metadata_per_bucket[ddp_ctx.curr_bucket :]
    ddp_ctx.metadata_per_bucket.append(ctx.fw_metadata)


def _compile(
    gm, example_inputs, options, mode, unexpected, margins=None, step=None, reuse=None, grad_bytes=0, replan_of=None
):
    if unexpected:
        raise ValueError(
            f"trinity backend: unexpected arguments {sorted(unexpected)}; pass trinity's settings as "
            "torch.compile(..., options={...})"
        )
    opts = TrinityOptions.from_user(options)
    device = _device_of(example_inputs)
    from .distributed import check_combination, detect_engine

    engine = detect_engine(gm, example_inputs)
    check_combination(engine, opts)  # refuses what would train wrong under DDP / FSDP2
    faults = None
    if opts.fault_injection is not None:
        if device.type != "cpu":
            raise ValueError("trinity option 'fault_injection' is a CPU test mode; the graph runs on " + str(device))
        faults = FaultInjection(seed=opts.fault_injection)
    runtime = TransferRuntime(
        device, opts.host_pool_limit_bytes or default_host_pool_limit(), faults, on_pool_full=opts.on_host_pool_full
    )
    session = CompileSession(opts, device, runtime)
    session.margins = margins
    if replan_of is not None:  # the runtime check's replan: what the pair's first compile found
        session.replan_of_compile = True
        session.compile_floor_percent = replan_of.compile_floor_percent
    session.reuse = reuse  # the runs per step the runtime check measured (step_budget.StepReuse)
    from .param_offload import real_parameters

    params = real_parameters(example_inputs, gm)
    # Where each run's parameters are among the call's arguments (the runtime check sees what
    # other runs of the pair, a reused block graph's, keep allocated).
    session.param_positions = tuple(sorted(params))
    # The gradients the pair's parameters hold from an earlier backward (gradient accumulation):
    # what the runtime check saw at a later call, or what is there now. Not planned for with an
    # "auto" budget (the free memory, which they have already taken) or none; there the step
    # report counts those there now.
    from .step_budget import accumulated_grad_bytes

    grads_now = accumulated_grad_bytes(params.values(), device)
    if opts.memory_budget.kind in ("bytes", "fraction"):
        session.accumulated_grad_bytes = max(grad_bytes, grads_now)
    else:
        session.reported_grad_bytes = grads_now
    from .step_budget import join_step

    # The training step's ledger (step_budget.py); a replan of the runtime check keeps the pair's.
    # A block graph that runs once per block (FSDP2's per-block compile, a reused block.compile())
    # is planned for one run at its compile; the runtime check counts its runs in the first step
    # and plans it again for them (step_check.py, step_budget.py).
    session.step = step if step is not None else join_step(gm, example_inputs, engine)
    session.may_be_reused = engine.kind == "fsdp2" or (session.step is not None and session.step.compiled_alone)
    partitioner = TrinityPartitioner(session)
    if opts.offload != "activations":
        if opts.inner != "eager":
            raise ValueError(
                f"trinity option 'offload': {opts.offload!r} needs inner='eager' (parameter storages are "
                "resized inside the graph, which Inductor's buffer planning does not allow); got "
                f"inner={opts.inner!r}"
            )
        from .param_offload import make_slots

        session.param_slots = make_slots(
            example_inputs, opts, opts.host_pool_limit_bytes or default_host_pool_limit(), gm
        )
        if engine.kind == "ddp" and opts.offload == "all" and engine.module is not None:
            session.grad_sync = _ddp_grad_sync(engine.module, session.param_slots)

    if opts.inner == "inductor":
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        # Three Inductor habits keep memory alive past the point where the plan frees it, so they
        # are off for trinity's graphs (inductor_config can turn them back on):
        # - recomputing a pointwise result in each of its readers instead of materialising it once
        #   keeps every input of the chain (a residual stream's branches) alive to the last reader;
        # - holding a freed buffer until a later buffer of the same size reuses it keeps an
        #   evicted activation allocated; the device allocator recycles the memory instead;
        # - reordering the kernels by its own peak-memory estimate (reorder_for_peak_memory), which
        #   knows nothing of the plan: on a LayerNorm/GELU MLP at 80% it ran every recomputed chain
        #   at the top of the backward, measuring the unplanned peak (24.07 MiB against 19.06
        #   planned) at every step.
        patches: dict[str, Any] = {
            "realize_reads_threshold": 0,
            "allow_buffer_reuse": False,
            "reorder_for_peak_memory": False,
        }
        if mode is not None:
            patches.update(list_mode_options(mode))
        patches.update(dict(opts.inductor_config))
        patches["custom_partitioner_fn"] = partitioner
        from .inductor_fixes import with_cpu_codegen_fixes

        # CPU graphs: torch's 2-D tiled accumulating stores (index_put backward) write to wrong
        # addresses on more than one thread; inductor_fixes.py generates them correctly. Around
        # each graph's inner compile, as AOTAutograd may compile the backward at its first run.
        with _no_caches():
            compiled = compile_fx(
                gm, example_inputs, inner_compile=with_cpu_codegen_fixes(device), config_patches=patches
            )
    else:
        if mode not in (None, "default"):
            raise ValueError(
                f"trinity backend: mode={mode!r} applies to Inductor only; with options inner='eager' leave mode unset"
            )
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop

        from .frame_headroom import with_headroom

        extra = {}
        if session.param_slots:
            from .param_offload import rewrite_inference

            def inference_compiler(gm: fx.GraphModule, inputs):
                plan = rewrite_inference(gm, session.param_slots, opts, runtime.id)
                if plan is not None:
                    session.residency_plans.append(plan)
                return boxed_nop(gm, inputs)

            extra["inference_compiler"] = with_headroom(inference_compiler)
        # The graphs' generated code runs with headroom on CPython's data stack (frame_headroom.py).
        inner = with_headroom(boxed_nop)
        if faults is not None and opts.compute_streams > 1:
            # Test mode: multi-stream graphs run under the interleaving executor.
            from .testing.interleave import interleaved_compiler

            inner = interleaved_compiler(opts.fault_injection)
        elif opts.compute_streams > 1:
            inner = _stream_safe(with_headroom(boxed_nop), runtime)
        backend = aot_autograd(
            fw_compiler=inner,
            bw_compiler=inner,
            partition_fn=partitioner,
            keep_inference_input_mutations=True,
            **extra,
        )
        with _no_caches():
            compiled = backend(gm, example_inputs)
    # Dynamo unwraps ``disable`` wrappers down to the innermost callable and keeps that one, so
    # the runtime is attached there: it lives exactly as long as the compiled code.
    from torch._dynamo.eval_frame import innermost_fn

    holder = innermost_fn(compiled)
    holder._trinity_runtime = runtime
    holder._trinity_session = session
    holder._trinity_param_slots = tuple(session.param_slots.values())
    if session.param_slots and opts.offload == "all":
        from .param_offload import release_planned

        release_planned(session.param_slots, session.residency_plans)  # host-resident before the first step
    return compiled
