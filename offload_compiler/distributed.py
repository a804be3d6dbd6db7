"""Trinity under PyTorch's data-parallel engines: which engine runs a graph, and what is refused.

Trinity composes with DDP (``torch.nn.parallel.DistributedDataParallel``) and FSDP2
(``torch.distributed.fsdp.fully_shard``) instead of replacing them. At compile time the backend
asks :func:`detect_engine` which engine the graph belongs to, and :func:`check_combination`
refuses, with :class:`UnsupportedCombinationError` naming the combination, every pairing of an
engine setting and an ``offload`` mode that would train wrong:

* **DDP** is found through ``DistributedDataParallel._get_active_ddp_module()``: DDP sets it for
  the duration of its forward (``_inside_ddp_forward``), which is when Dynamo compiles the wrapped
  module's frames, with or without DDP's graph splitting (``optimize_ddp``). With
  ``optimize_ddp="python_reducer"`` Dynamo traces DDP's forward itself, before it runs: the DDP
  module is then found on the source path of the graph's inputs (the frame's ``self``).
* **FSDP2** is found from the graph's inputs: a module on the source path of an input
  (``node.meta["grapharg"].source``, resolved in the frame being compiled) that is an
  ``FSDPModule``, or a ``DTensor`` input (a sharded parameter).

With ``offload="all"`` a parameter's gradient goes to host memory inside the backward and the
backward returns ``None`` for it, so DDP's reducer hooks (on the parameters' gradient
accumulation) never fire. Trinity then averages the gradients itself, exactly as DDP would
(:mod:`.passes.grad_sync`); what DDP would do differently from that (a communication hook, mixed
precision, unused-parameter detection, the static-graph mode, the Python reducer) is refused.
FSDP2 owns the parameters' storages (it frees and refills the unsharded parameters around each
block) and their host offload (``CPUOffloadPolicy``), so parameter offload under FSDP2 is
refused; activation offload (``offload="activations"``) composes with it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

__all__ = [
    "Engine",
    "UnsupportedCombinationError",
    "active_ddp",
    "detect_engine",
    "check_combination",
    "ddp_bucket_caps",
    "resolve_interconnect",
]


class UnsupportedCombinationError(ValueError):
    """A data-parallel engine setting and a trinity option that do not compose; the message names
    both and what to use instead."""


@dataclass(frozen=True)
class Engine:
    """The data-parallel engine a graph runs under.

    Attributes:
        kind: ``"ddp"``, ``"fsdp2"`` or ``"none"``.
        module_ref: a weak reference to the DDP module, or to the first ``FSDPModule`` found
            (``None`` for ``"none"``).
        world_size: ranks of the engine's process group (1 for ``"none"``).
    """

    kind: str
    module_ref: Any = None
    world_size: int = 1

    @property
    def module(self) -> torch.nn.Module | None:
        return self.module_ref() if self.module_ref is not None else None


def active_ddp() -> torch.nn.Module | None:
    """The DDP module whose forward is running (Dynamo compiles inside it), or ``None``."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # torch built without distributed
        return None
    getter = getattr(DistributedDataParallel, "_get_active_ddp_module", None)
    return getter() if getter is not None else None


def _ddp_class():
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # torch built without distributed
        return None
    return DistributedDataParallel


def _fsdp_module_class():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            return None
    return FSDPModule


def _is_dtensor(x: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(x, DTensor)


def dynamo_source_resolver() -> Callable[[Any], Any] | None:
    """A function mapping a Dynamo ``Source`` to its value in the frame being compiled, or
    ``None`` outside a Dynamo compile (no current instruction translator) or with a Dynamo that
    lacks this machinery. Uses ``OutputGraph.resolve_source_value`` where torch has it, else the
    source's ``get_value`` on the root frame's globals and locals (torch 2.11)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        output = InstructionTranslator.current_tx().output
    except Exception:  # noqa: BLE001  (not inside a Dynamo compile, or another torch)
        return None

    def resolve(source):
        if hasattr(output, "resolve_source_value"):
            return output.resolve_source_value(source)
        root_tx = output.root_tx
        return source.get_value({"G": root_tx.f_globals, "L": root_tx.f_locals}, {}, {})

    return resolve


def source_modules(gm: fx.GraphModule | None) -> list[torch.nn.Module]:
    """Every ``nn.Module`` on the source paths of ``gm``'s inputs (resolved in the frame being
    compiled), outermost first; ``[]`` outside a Dynamo compile."""
    if gm is None:
        return []
    resolve = dynamo_source_resolver()
    if resolve is None:
        return []

    found: dict[int, torch.nn.Module] = {}
    seen_sources: set[str] = set()
    for node in gm.graph.find_nodes(op="placeholder"):
        source = getattr(node.meta.get("grapharg"), "source", None) or getattr(node, "_dynamo_source", None)
        chain = []
        while source is not None:
            chain.append(source)
            source = getattr(source, "base", None)
        for src in reversed(chain):
            key = src.name if isinstance(getattr(src, "name", None), str) else repr(src)
            if key in seen_sources:
                continue
            seen_sources.add(key)
            try:
                value = resolve(src)
            except Exception:  # noqa: BLE001  (a source kind that cannot be evaluated here)
                continue
            if isinstance(value, torch.nn.Module):
                found.setdefault(id(value), value)
    return list(found.values())


def detect_engine(gm: fx.GraphModule | None, example_inputs: Sequence[Any]) -> Engine:
    """The engine ``gm`` runs under (see the module docstring)."""
    ddp = active_ddp()
    if ddp is None:
        # Dynamo traced DDP's forward itself (torch._dynamo.config.optimize_ddp="python_reducer"):
        # the compile runs before DDP's forward, but the DDP module is the frame's ``self``.
        ddp_cls = _ddp_class()
        if ddp_cls is not None:
            ddp = next((m for m in source_modules(gm) if isinstance(m, ddp_cls)), None)
    if ddp is not None:
        pg = getattr(ddp, "process_group", None)
        world = pg.size() if pg is not None else torch.distributed.get_world_size()
        return Engine("ddp", weakref.ref(ddp), int(world))
    fsdp_cls = _fsdp_module_class()
    fsdp = None
    if fsdp_cls is not None:
        fsdp = next((m for m in source_modules(gm) if isinstance(m, fsdp_cls)), None)
    if fsdp is None and not any(_is_dtensor(x) for x in example_inputs):
        return Engine("none")
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return Engine("fsdp2", weakref.ref(fsdp) if fsdp is not None else None, int(world))


TRINITY_HOOK_ATTR = "_trinity_hook"
"""Set on trinity's own DDP communication hook (``runtime.grad_sync.idle_comm_hook``), which
:func:`ddp_comm_hook` does not report (this module does not import the runtime)."""


def ddp_comm_hook(ddp: torch.nn.Module) -> str | None:
    """The name of the communication hook registered on ``ddp`` (Python or built-in), or ``None``."""
    hooks = getattr(ddp, "_comm_hooks", None)
    if hooks:
        hook = hooks[0][0]
        if getattr(hook, TRINITY_HOOK_ATTR, False):
            return None  # trinity's own (runtime.grad_sync.idle_comm_hook), from an earlier compile
        return getattr(hook, "__qualname__", repr(hook))
    try:
        name = ddp._get_ddp_logging_data().get("comm_hook")
    except Exception:  # noqa: BLE001  (no logger: DDP constructed without one)
        name = None
    return name or None


def check_combination(engine: Engine, options) -> None:
    """Refuse the engine settings and ``offload`` modes that do not compose (module docstring).

    Raises:
        UnsupportedCombinationError: naming the engine setting, the option and what to use.
    """
    mode = options.offload
    if engine.kind == "fsdp2" and mode != "activations":
        raise UnsupportedCombinationError(
            f"trinity offload={mode!r} with FSDP2 (fully_shard) is not supported: FSDP2 owns the parameters' "
            "storages (it all-gathers and frees the unsharded parameters around every block) and their host "
            "offload. Use FSDP2's own CPUOffloadPolicy (fully_shard(..., offload_policy=CPUOffloadPolicy())) for "
            "parameters, gradients and optimizer state, and trinity's offload='activations' (the default) for "
            "saved activations."
        )
    if engine.kind != "ddp" or mode != "all":
        return
    ddp = engine.module
    if ddp is None:
        return
    problems = []
    hook = ddp_comm_hook(ddp)
    if hook is not None:
        problems.append(
            f"DDP's communication hook {hook!r} (trinity averages the gradients itself with offload='all', so "
            "the hook would never run)"
        )
    if getattr(ddp, "mixed_precision", None) is not None:
        problems.append("DDP's mixed_precision (the gradients' reduced dtype would be skipped)")
    if getattr(ddp, "_use_python_reducer", False):
        problems.append("DDP's Python reducer (torch._dynamo.config.optimize_ddp='python_reducer')")
    if getattr(ddp, "find_unused_parameters", False):
        problems.append("DDP(find_unused_parameters=True) (DDP's reducer would run its own collectives)")
    if getattr(ddp, "static_graph", False):
        problems.append("DDP(static_graph=True) (its first step delays and runs DDP's own all-reduce)")
    if getattr(ddp, "_delay_all_reduce_params", None):
        # DDP all-reduces these itself after the backward, from their device .grad, which
        # offload='all' leaves None (and ignores them in its own reducer).
        problems.append("DDP's delay_all_reduce_named_params (their all-reduce delayed to the end of the backward)")
    if problems:
        raise UnsupportedCombinationError(
            "trinity offload='all' under DDP is not supported with "
            + "; ".join(problems)
            + ". Use offload='activations+params' (DDP reduces the device gradients as usual, hooks included) "
            "or remove the setting."
        )


def ddp_bucket_caps(ddp: torch.nn.Module) -> tuple[int, ...]:
    """DDP's gradient bucket caps in bytes, per bucket in order, the last repeating (the
    ``bucket_size_limits`` its reducer rebuilds its buckets with): ``bucket_cap_mb_list`` where
    given; else the first bucket's cap (``dist._DEFAULT_FIRST_BUCKET_BYTES`` with DDP's default
    ``bucket_cap_mb``, else the cap) and ``bucket_bytes_cap``. Read from DDP's
    ``_bucket_config`` (torch >= 2.12) or its ``bucket_bytes_cap`` / ``bucket_bytes_cap_default``
    attributes (earlier; ``torch/nn/parallel/distributed.py``).

    Raises:
        ValueError: when ``ddp`` has no bucket cap (not a ``DistributedDataParallel``).
    """
    import torch.distributed as dist

    cfg = getattr(ddp, "_bucket_config", None)
    if cfg is not None:
        if cfg.per_bucket_bytes_caps:
            return tuple(int(c) for c in cfg.per_bucket_bytes_caps)
        cap, first = int(cfg.bucket_bytes_cap), int(cfg.first_bucket_bytes_cap)
    else:
        cap = getattr(ddp, "bucket_bytes_cap", None)
        if cap is None:
            raise ValueError(f"ddp_bucket_caps: {type(ddp).__name__} has no bucket_bytes_cap (not a DDP module?)")
        cap = int(cap)
        first = int(dist._DEFAULT_FIRST_BUCKET_BYTES) if getattr(ddp, "bucket_bytes_cap_default", False) else cap
    first = max(1, min(first, cap))
    return (first, cap) if first < cap else (cap,)


def resolve_interconnect(name):
    """The :class:`~offload_compiler.collectives.Link` of the ``interconnect`` option: a key of
    :data:`~offload_compiler.collectives.LINKS`, a JSON file written by ``python -m
    offload_compiler calibrate --collectives`` (:func:`~offload_compiler.collectives.load_link`),
    or ``None``: :data:`~offload_compiler.collectives.DEFAULT_LINK`.

    Raises:
        ValueError: naming the value and what is allowed.
    """
    from pathlib import Path

    from .collectives import DEFAULT_LINK, LINKS, load_link

    if name is None:
        return LINKS[DEFAULT_LINK]
    text = str(name)
    if text in LINKS:
        return LINKS[text]
    if text.endswith(".json") or Path(text).is_file():
        return load_link(text)
    raise ValueError(
        f"interconnect {text!r}: one of {', '.join(LINKS)}, or a JSON file written by "
        "`python -m offload_compiler calibrate --collectives`"
    )
