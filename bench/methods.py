"""The training methods the benchmark compares: one :class:`Method` per way a user might train.

A method turns a freshly copied model into a :class:`Prepared` step: the callable that computes
the loss (``fn(x, y)``), a context entered around each forward and backward (config patches,
saved-tensor hooks), and whether its host copies must be told apart on CPU. The runner does the
rest (optimizer, timing, memory), identically for every method.

Method keys (:func:`get_method`):

- ``eager``: the model as is.
- ``inductor``, ``aot_eager``: ``torch.compile(model, backend=...)``.
- ``checkpoint``: every block wrapped in ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``,
  eager.
- ``sac-<fraction>``: ``torch.compile`` (Inductor) with
  ``torch._functorch.config.activation_memory_budget=<fraction>`` (the min-cut partitioner's
  selective recomputation, e.g. ``sac-0.5``).
- ``save_on_cpu``: eager under ``torch.autograd.graph.save_on_cpu(pin_memory=True)``.
- ``torch-offload``: PyTorch's in-tree activation offloading
  (``torch/_functorch/_activation_offloading``), turned on the way its tests do:
  ``torch._functorch.config.enable_activation_offloading=True`` plus a ``joint_custom_pass`` that
  sets ``node.meta["should_offload"]`` on every node of the joint graph; the partitioner then
  offloads each saved activation it can (not views, not non-contiguous, not outputs). On CUDA with
  its separate copy stream, wait sinking and reload prefetching on.
- ``trinity-<budget>`` / ``trinity-eager-<budget>``: ``backend="trinity"`` with
  ``memory_budget=<budget>`` and ``inner="inductor"`` / ``"eager"``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from offload_compiler.options import MemoryBudget

from .memory import HOST_SCOPE

__all__ = ["Method", "Prepared", "get_method", "has_inductor_offloading", "CheckpointBlock"]


@dataclass
class Prepared:
    """A model made ready by a method: ``fn(x, y) -> loss``; ``context()`` is entered around every
    forward and backward; ``host_copies``: the method keeps host copies inside
    :data:`bench.memory.HOST_SCOPE` (CPU accounting)."""

    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    host_copies: bool = False


@dataclass(frozen=True)
class Method:
    """One way to train.

    Attributes:
        key: the registry key (``trinity-50%``).
        label: what the table shows.
        family: groups points in the frontier plot (``trinity``, ``sac``, ...).
        compiled: whether it goes through ``torch.compile`` (compile time is meaningful).
        prepare: ``(model, device) -> Prepared``; may wrap ``model``'s submodules in place.
        reference: the method that is "the same without offloading" (trinity: its inner
            compiler's plain ``torch.compile``); ``None`` for the others.
        budget: trinity's ``memory_budget`` or the SAC fraction, as given.
        inner: trinity's inner compiler.
        cpu_note: what the figures mean on a CPU, when that needs saying.
    """

    key: str
    label: str
    family: str
    compiled: bool
    prepare: Callable[[nn.Module, torch.device], Prepared] = field(repr=False)
    reference: str | None = None
    budget: str | None = None
    inner: str | None = None
    cpu_note: str = ""


class CheckpointBlock(nn.Module):
    """Runs ``block`` under non-reentrant activation checkpointing."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def _wrap_blocks(model: nn.Module, containers: list[nn.Module]) -> int:
    n = 0
    for container in containers:
        for name, child in list(container.named_children()):
            setattr(container, name, CheckpointBlock(child))
            n += 1
    if n == 0:
        raise ValueError("checkpoint: the model has no blocks to wrap")
    return n


def _compiled(backend: str, **options) -> Callable[[nn.Module, torch.device], Prepared]:
    def prepare(model: nn.Module, device: torch.device) -> Prepared:
        kwargs = {"options": options} if options else {}
        return Prepared(torch.compile(model, backend=backend, **kwargs))

    return prepare


def inductor_with_functorch_config(**config) -> Callable:
    """An Inductor backend (``compile_fx``) that compiles under ``torch._functorch.config.patch(
    **config)`` (the partitioner's settings: ``activation_memory_budget``, activation offloading).

    A backend object of its own, not ``backend="inductor"`` with the patch entered around the
    calls: Dynamo's cache is per code object and checks the backend, not the functorch config, so
    a second instance of a model class compiled with ``"inductor"`` reuses the first instance's
    compiled code (the frontier's reference run): every selective-recompute point measured plain
    Inductor's peak (a tiny GPT saved 832,388 bytes at ``activation_memory_budget=0`` that way,
    140,800 with its own backend)."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        with torch._functorch.config.patch(**config):
            return compile_fx(gm, example_inputs)

    return backend


def _sac(fraction: float) -> Callable[[nn.Module, torch.device], Prepared]:
    def prepare(model: nn.Module, device: torch.device) -> Prepared:
        return Prepared(torch.compile(model, backend=inductor_with_functorch_config(activation_memory_budget=fraction)))

    return prepare


def tag_all_for_offload(gm: torch.fx.GraphModule, joint_inputs) -> torch.fx.GraphModule:
    """``joint_custom_pass`` for PyTorch's in-tree offloading: mark every node; the partitioner
    keeps only the saved activations it can offload."""
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.meta["should_offload"] = True
    return gm


def has_inductor_offloading() -> bool:
    """Whether the installed torch has the in-tree activation offloading this bench drives."""
    try:
        import torch._functorch._activation_offloading.activation_offloading  # noqa: F401
    except ImportError:
        return False
    return hasattr(torch._functorch.config, "enable_activation_offloading") and hasattr(
        torch._functorch.config, "joint_custom_pass"
    )


def _torch_offload(model: nn.Module, device: torch.device) -> Prepared:
    if not has_inductor_offloading():
        raise RuntimeError(f"torch {torch.__version__} has no torch/_functorch/_activation_offloading")
    config = {"enable_activation_offloading": True, "joint_custom_pass": tag_all_for_offload}
    if device.type == "cuda":
        # The asynchronous variant (copy stream, waits sunk, reloads prefetched), where this torch
        # has its switches.
        for name in (
            "activation_offload_separate_stream",
            "activation_offload_sink_wait",
            "activation_reload_prefetch",
        ):
            if hasattr(torch._functorch.config, name):
                config[name] = True
    return Prepared(torch.compile(model, backend=inductor_with_functorch_config(**config)))


def _save_on_cpu(model: nn.Module, device: torch.device) -> Prepared:
    if device.type != "cpu":
        return Prepared(model, lambda: torch.autograd.graph.save_on_cpu(pin_memory=True))

    def context():
        # torch's own hooks object, its pack hook run inside HOST_SCOPE so that the accounting
        # counts its copies as host memory. On the CPU build its unpack returns the host tensor
        # itself (``.to("cpu")`` of a CPU tensor); on a GPU it allocates a device copy, so here the
        # unpack copies too, as the host-to-device copy would.
        hooks = torch.autograd.graph.save_on_cpu(pin_memory=True)
        pack, unpack = hooks.pack_hook, hooks.unpack_hook

        def pack_scoped(tensor):
            with torch.profiler.record_function(HOST_SCOPE):
                return pack(tensor)

        def unpack_copy(packed):
            return unpack(packed).clone()

        hooks.pack_hook, hooks.unpack_hook = pack_scoped, unpack_copy
        return hooks

    return Prepared(model, context, host_copies=True)


def _checkpoint(containers: Callable[[nn.Module], list[nn.Module]]):
    def prepare(model: nn.Module, device: torch.device) -> Prepared:
        _wrap_blocks(model, containers(model))
        return Prepared(model)

    return prepare


_CPU_COPY = "on CPU its copies are memcpy within host memory"


def get_method(key: str, block_containers: Callable[[nn.Module], list[nn.Module]] | None = None) -> Method:
    """The method called ``key`` (see the module docstring). ``block_containers`` (from the
    model's spec) is needed by ``checkpoint``.

    Raises:
        ValueError: for an unknown key or a malformed budget.
    """
    if key == "eager":
        return Method(key, "eager", "eager", False, lambda m, d: Prepared(m))
    if key in ("inductor", "aot_eager"):
        return Method(key, f"torch.compile ({key})", "compile", True, _compiled(key))
    if key == "checkpoint":
        if block_containers is None:
            raise ValueError("checkpoint needs the model's block containers")
        return Method(
            key, "checkpoint per block (eager, non-reentrant)", "checkpoint", False, _checkpoint(block_containers)
        )
    if key.startswith("sac-"):
        try:
            fraction = float(key[4:])
        except ValueError:
            raise ValueError(f"{key!r}: expected sac-<fraction>, e.g. sac-0.5") from None
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"{key!r}: the fraction must be in [0, 1]")
        return Method(
            key,
            f"selective recompute (inductor, activation_memory_budget={fraction:g})",
            "sac",
            True,
            _sac(fraction),
            budget=f"{fraction:g}",
        )
    if key == "save_on_cpu":
        return Method(
            key,
            "save_on_cpu(pin_memory=True) (eager)",
            "save_on_cpu",
            False,
            _save_on_cpu,
            cpu_note=f"{_CPU_COPY} (pageable: no pinned memory without CUDA); the reload is made a real copy",
        )
    if key == "torch-offload":
        return Method(
            key,
            "in-tree offloading (inductor, every eligible saved tensor)",
            "torch-offload",
            True,
            _torch_offload,
            cpu_note="its offload is device_put(cpu), the identity for a tensor already on the CPU: no effect on CPU",
        )
    if key.startswith("trinity-"):
        rest = key[len("trinity-") :]
        inner = "inductor"
        if rest.startswith("eager-"):
            inner, rest = "eager", rest[len("eager-") :]
        MemoryBudget.parse(rest)  # a malformed budget fails here, not mid-suite
        options = {"memory_budget": rest, "inner": inner, "on_infeasible": "warn"}
        return Method(
            key,
            f"trinity {rest} ({inner})",
            "trinity" if inner == "inductor" else "trinity-eager",
            True,
            _compiled("trinity", **options),
            reference="inductor" if inner == "inductor" else "aot_eager",
            budget=rest,
            inner=inner,
            cpu_note=_CPU_COPY,
        )
    raise ValueError(
        f"unknown method {key!r}; known: eager, inductor, aot_eager, checkpoint, sac-<fraction>, save_on_cpu, "
        "torch-offload, trinity-<budget>, trinity-eager-<budget>"
    )


def fresh_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` (the same initial weights for every method)."""
    return copy.deepcopy(model)
