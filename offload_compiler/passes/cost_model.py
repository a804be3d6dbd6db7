"""Cost model: a time for every node of the joint schedule and for every transfer.

Per node (roofline, Williams et al., "Roofline", CACM 2009):
``seconds = max(FLOPs / peak FLOP/s, bytes / HBM bytes/s) + launch overhead``, where FLOPs come
from PyTorch's flop-counter registry (``torch.utils.flop_counter``) applied to ``meta["val"]``,
and bytes are the bytes of every tensor the node reads plus every tensor it writes. A node whose
outputs all alias its inputs (views, reshapes, ``detach``, ``getitem``) launches no kernel and
costs nothing, as do placeholders and outputs; where the host is the device
(``DeviceSpec.host_is_device``) an aten view still costs its dispatcher call, one launch overhead.
FLOPs of the CPU attention kernel, which the registry leaves out, are torch's SDPA counts.
Where the liveness assumes fusion (the inner compiler is Inductor: :attr:`.liveness.Buffer.fused`),
a fused temporary's node is computed inside its reader's kernel: it writes nothing to memory and
launches nothing, and its reader does not read it, so a fused pointwise chain costs what its one
kernel moves (its inputs from memory, its output to memory) plus one launch, as the memory model
already assumes.

With measured op times (``op_times="measured"``, ``DeviceSpec.op_times``,
:mod:`.op_timing`) a node whose call was measured takes its measured seconds per call instead
(FLOPs and bytes are still counted for the report).

Per transfer: ``seconds = bytes / link bytes/s`` in the copy's direction (pinned host memory).

Per optimizer update (``offload="all"``, :class:`HostUpdate`): a memory-bound pass over the
parameter, its gradient and its state. AdamW moves 7 bytes per byte of parameter (reads master,
gradient, m, v; writes master, m, v: 28 bytes per fp32 parameter); on the host it takes
``DeviceSpec.host_update_s_per_param`` (measured by ``calibrate``, else derived from the host's
bandwidth) per fp32 parameter, scaled by the bytes each other optimizer moves
(:func:`optimizer_profile`); on the device (parameters the plan keeps there) those bytes at the
device's memory bandwidth. :func:`host_update_seconds` is the one formula the backend and the
``plan`` command use.

Device figures from :mod:`offload_compiler.devices`, overridden by the options. Reads
``node.meta["val"]``; writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from ..devices import DeviceSpec
from ..graph_pair import GraphPair, hint_int, tensor_vals
from ..ir.alias import storage_key, tensor_span_bytes
from ..ir.ops import TRANSFER_OPS
from ..options import TrinityOptions
from .liveness import Liveness
from .simulate import CopyTask

__all__ = [
    "host_update_from_optimizer",
    "Costs",
    "estimate",
    "apply_overrides",
    "node_cost",
    "flop_packet",
    "HostUpdate",
    "host_update_model",
    "host_update_seconds",
    "optimizer_profile",
]


@dataclass(frozen=True)
class Costs:
    """Times of the joint schedule's steps (seconds) and the figures behind them.

    Attributes:
        device: the figures used (after option overrides).
        step_seconds: seconds per step, aligned with :attr:`Liveness.steps`.
        step_flops: FLOPs per step.
        step_bytes: bytes read plus written per step.
        pinned: whether the host side of copies is pinned memory.
    """

    device: DeviceSpec
    step_seconds: tuple[float, ...]
    step_flops: tuple[int, ...]
    step_bytes: tuple[int, ...]
    pinned: bool = True

    def transfer_seconds(self, nbytes: int, direction: Literal["d2h", "h2d"]) -> float:
        """Seconds to copy ``nbytes`` over the host link in ``direction``; host memory is pinned
        when ``pinned`` (trinity's host pool is pinned on CUDA), else pageable. Where copies are
        synchronous (:attr:`synchronous_copies`) the copy's runtime calls are on the same cores:
        plus the direction's ``DeviceSpec.h2d_overhead_s`` / ``d2h_overhead_s`` (calibrated; 0
        from the device table)."""
        return self.device.copy_seconds(nbytes, direction, self.pinned)

    @property
    def synchronous_copies(self) -> bool:
        """Whether copies run on the compute stream, one after the other with the compute: the
        device is the host CPU itself (:attr:`DeviceSpec.host_is_device`), where the runtime's
        copies are memcpys on the cores that run the graph (``runtime/transfer.py``: no copy
        streams), so no copy hides under compute."""
        return self.device.host_is_device

    def copy_task(
        self, task_id: int, direction: Literal["d2h", "h2d"], nbytes: int, issue_pos: int, wait_pos: int
    ) -> CopyTask:
        """The simulator's task for a copy of ``nbytes`` bytes issued at position ``issue_pos`` and
        waited for at ``wait_pos`` (see :mod:`.simulate`): :meth:`transfer_seconds` long, on the
        compute stream where copies are synchronous (:attr:`synchronous_copies`)."""
        return CopyTask(
            task_id,
            direction,
            self.transfer_seconds(nbytes, direction),
            issue_pos,
            wait_pos,
            on_compute=self.synchronous_copies,
        )

    @property
    def compute_seconds(self) -> float:
        return float(sum(self.step_seconds))


def apply_overrides(spec: DeviceSpec, options: TrinityOptions) -> DeviceSpec:
    """``spec`` with a calibration file's figures, then the options' device overrides, applied
    (``peak_flops`` sets every dtype)."""
    fields: dict = {}
    if options.calibration is not None:
        from ..calibrate import load_calibration

        fields.update(load_calibration(options.calibration))
        fields["source"] = f"{spec.source}; calibrated ({options.calibration})"
        spec = replace(spec, **fields)
        fields = {}
    if options.peak_flops is not None:
        fields.update(flops_fp32=options.peak_flops, flops_tf32=options.peak_flops, flops_bf16=options.peak_flops)
    if options.hbm_bytes_per_s is not None:
        fields["hbm_bytes_per_s"] = options.hbm_bytes_per_s
    if options.h2d_bytes_per_s is not None:
        fields["h2d_bytes_per_s"] = options.h2d_bytes_per_s
    if options.d2h_bytes_per_s is not None:
        fields["d2h_bytes_per_s"] = options.d2h_bytes_per_s
    if options.host_bytes_per_s is not None:
        # A stated bandwidth: the update figures derive from it (not from a measurement).
        spec = spec.with_host_bandwidth(options.host_bytes_per_s)
        fields["host_bytes_per_s"] = options.host_bytes_per_s
    if options.device_memory_bytes is not None:
        fields["memory_bytes"] = options.device_memory_bytes
    if fields:
        fields["source"] = spec.source + "; overridden by options"
    return replace(spec, **fields) if fields else spec


def _arg_val(a):
    if isinstance(a, fx.Node):
        return a.meta.get("val")
    if isinstance(a, (list, tuple)):
        return type(a)(_arg_val(x) for x in a)
    return a


# The CPU attention kernels, which torch's flop-counter registry leaves out, take the same
# leading ``(grad_out,) query, key, value`` arguments as the flash kernels it counts: those
# kernels' registered formulas (torch's SDPA counts, 4*b*h*s_q*s_k*d forward, 2.5x that backward)
# apply to them.
_FLOP_ALIASES = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: torch.ops.aten._scaled_dot_product_flash_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        torch.ops.aten._scaled_dot_product_flash_attention_backward
    ),
}


def flop_packet(target):
    """The op overload packet whose FLOP formula in ``torch.utils.flop_counter.flop_registry``
    counts ``target`` (an ``OpOverload``): its own, or for the CPU attention kernels the flash
    kernels' (:data:`_FLOP_ALIASES`); ``None`` when torch registers no formula for it. The one
    lookup the cost model and the recompute chains (:mod:`.recompute_chains`) share."""
    packet = getattr(target, "overloadpacket", None)
    packet = _FLOP_ALIASES.get(packet, packet)
    return packet if packet is not None and packet in flop_registry else None


def node_cost(
    node: fx.Node, spec: DeviceSpec, allow_tf32: bool, fused: frozenset = frozenset()
) -> tuple[int, int, float]:
    """``(flops, bytes, seconds)`` of one node (see the module docstring). ``fused``: the nodes
    the inner compiler computes inside their reader's kernel (liveness's fused temporaries,
    :attr:`.liveness.Buffer.fused`): such a node writes no output to memory and launches no
    kernel of its own, and its reader does not read it from memory."""
    if node.op != "call_function" or node.target in TRANSFER_OPS:
        return 0, 0, 0.0
    outs = tensor_vals(node)
    ins = [t for m in node.all_input_nodes if m not in fused for t in tensor_vals(m)]
    if not outs:
        return 0, 0, 0.0
    measured = spec.op_times.seconds_of(node) if spec.op_times is not None else None
    in_storages = {k for t in ins if (k := storage_key(t)) is not None}
    if all((k := storage_key(t)) is not None and k in in_storages for t in outs):
        if measured is not None:
            return 0, 0, measured
        # A view: no kernel. Where the host is the device its dispatcher call runs on the cores
        # that compute, one after the other with them: one launch overhead (an aten op; Python's
        # getitem costs nothing).
        dispatched = spec.host_is_device and isinstance(node.target, torch._ops.OpOverload)
        return 0, 0, spec.launch_overhead_s if dispatched else 0.0
    flops = 0
    packet = flop_packet(node.target)
    if packet is not None:
        try:
            args = _arg_val(node.args)
            kwargs = {k: _arg_val(v) for k, v in node.kwargs.items()}
            flops = hint_int(flop_registry[packet](*args, **kwargs, out_val=node.meta.get("val")))
        except Exception:  # a formula that cannot take these arguments: count bytes only
            flops = 0
    in_kernel = node in fused
    nbytes = sum(tensor_span_bytes(t) for t in ins) + (0 if in_kernel else sum(tensor_span_bytes(t) for t in outs))
    if measured is not None:
        return flops, nbytes, measured
    dtype = outs[0].dtype
    launch = 0.0 if in_kernel else spec.launch_overhead_s
    seconds = max(flops / spec.peak_flops(dtype, allow_tf32), nbytes / spec.hbm_bytes_per_s) + launch
    return flops, nbytes, seconds


def estimate(pair: GraphPair, liveness: Liveness, spec: DeviceSpec, pinned: bool = True) -> Costs:
    """Time every step of ``liveness``'s joint schedule on ``spec``. ``pinned`` selects the copy
    bandwidth: trinity's host pool is pinned wherever there are copy streams (CUDA); on the CPU
    the ``cpu`` entry's figures are memory copies, for which pinning means nothing."""
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    nodes = list(pair.forward.graph.nodes) + list(pair.backward.graph.nodes)
    if len(nodes) != liveness.num_steps:
        raise ValueError(
            f"cost model: the graphs have {len(nodes)} nodes but the liveness has {liveness.num_steps} "
            "steps; run liveness on the same graphs"
        )
    fused = liveness.fused_holders()
    flops, nbytes, seconds = [], [], []
    for n in nodes:
        f, b, s = node_cost(n, spec, allow_tf32, fused)
        flops.append(f)
        nbytes.append(b)
        seconds.append(s)
    return Costs(
        device=spec, step_seconds=tuple(seconds), step_flops=tuple(flops), step_bytes=tuple(nbytes), pinned=pinned
    )


# Optimizer name -> (bytes moved per byte of parameter in one update, state tensors per parameter).
# AdamW/Adam and relatives: read param, grad, 2 states, write param and 2 states (7); SGD with
# momentum, Adagrad, RMSprop: read param, grad, 1 state, write param and state (5); plain SGD:
# read param and grad, write param (3).
_PROFILES = {
    "adamw": (7, 2),
    "adam": (7, 2),
    "nadam": (7, 2),
    "radam": (7, 2),
    "adamax": (7, 2),
    "sgd": (5, 1),
    "sgd-plain": (3, 0),
    "adagrad": (5, 1),
    "rmsprop": (5, 1),
    "muon": (5, 1),
    "none": (0, 0),
}


def optimizer_profile(optimizer: str | type, options: dict | None = None) -> tuple[int, int]:
    """``(bytes moved per parameter byte, state tensors per parameter)`` of one update of
    ``optimizer`` (a name such as ``"adamw"``, or a ``torch.optim`` class and its options); an
    optimizer not in the table counts as AdamW. Muon's Newton-Schulz matmuls are not counted
    (its bytes only)."""
    name = optimizer if isinstance(optimizer, str) else optimizer.__name__.lower()
    if name == "sgd" and not isinstance(optimizer, str) and not (options or {}).get("momentum"):
        name = "sgd-plain"
    return _PROFILES.get(name.lower(), _PROFILES["adamw"])


@dataclass(frozen=True)
class HostUpdate:
    """The optimizer update of one step as the simulator sees it (``offload="all"``).

    Attributes:
        host_seconds_per_byte: host update seconds per byte of offloaded parameter.
        device_seconds_per_byte: seconds per byte of a parameter the plan keeps on the device,
            updated there on the compute stream.
        overlap: ``"forward"`` (the update starts at ``step()``) or ``"backward"`` (a chunk
            starts when its gradients are on the host), as ``CPUOptimizer(overlap=...)``.
        chunk_bytes: the ``CPUOptimizer``'s chunk size (bytes of parameters per task).
        on_compute: the host is the device itself (the CPU): host updates take the compute
            stream's time.
        state_factor: optimizer state tensors per parameter (device bytes of the share kept on
            the device: this many times its parameter bytes).
        description: what was assumed, in words.
        host_seconds_per_tensor: fixed host seconds per parameter tensor updated (torch's
            per-call work, measured by ``calibrate``; 0 when not calibrated).
    """

    host_seconds_per_byte: float
    device_seconds_per_byte: float
    overlap: Literal["forward", "backward"] = "forward"
    chunk_bytes: int = 16 * 2**20
    on_compute: bool = False
    state_factor: int = 2
    description: str = ""
    host_seconds_per_tensor: float = 0.0


def host_update_model(
    spec: DeviceSpec,
    optimizer: str | type = "adamw",
    options: dict | None = None,
    implementation: Literal["fused", "loop"] = "loop",
    overlap: Literal["forward", "backward"] = "forward",
    chunk_bytes: int = 16 * 2**20,
    threads: int | None = None,
) -> HostUpdate:
    """The :class:`HostUpdate` of ``optimizer`` on ``spec``'s host: ``implementation`` ``"fused"``
    (torch's fused CPU kernel, ``CPUOptimizer(implementation="fastest")``) or ``"loop"`` (its
    for-loop, ``CPUOptimizer``'s default). ``threads``: the update's intra-op threads
    (``CPUOptimizer.num_threads``); ``None``: all the host's. With a calibration measured per
    thread count, the figure at the largest measured count not above ``threads`` is used
    (:meth:`~offload_compiler.devices.DeviceSpec.host_update_s_per_param`), else the all-threads one.

    Raises:
        ValueError: for another ``implementation`` or ``overlap``.
    """
    if overlap not in ("forward", "backward"):
        raise ValueError(f"overlap must be 'forward' or 'backward', got {overlap!r}")
    traffic, states = optimizer_profile(optimizer, options)
    # fp32 AdamW: 28 bytes per parameter, 4 of them the parameter
    per_param, source = spec.host_update_figure(implementation, threads)
    host = per_param / 4 * traffic / 7
    device = host if spec.host_is_device else traffic / spec.hbm_bytes_per_s
    name = optimizer if isinstance(optimizer, str) else optimizer.__name__
    return HostUpdate(
        host_seconds_per_byte=host,
        device_seconds_per_byte=device,
        overlap=overlap,
        chunk_bytes=int(chunk_bytes),
        on_compute=spec.host_is_device,
        state_factor=states,
        host_seconds_per_tensor=spec.host_update_s_per_tensor(implementation),
        description=(
            f"{name} ({implementation}) on the host at {spec.host_bytes_per_s / 1e9:.3g} GB/s"
            + (f", {threads} threads" if threads else "")
            + f": {per_param * 1e9 * traffic / 7:.3g} ns per fp32 parameter ({source}), overlap={overlap}"
        ),
    )


def host_update_from_optimizer(spec: DeviceSpec, optimizer) -> HostUpdate:
    """The :class:`HostUpdate` of a live ``CPUOptimizer`` (its class, options, implementation,
    overlap, chunk size and threads)."""
    impl = "fused" if optimizer.defaults.get("fused") else "loop"
    return host_update_model(
        spec,
        optimizer.optimizer_class,
        optimizer.defaults,
        impl,
        optimizer.overlap,
        optimizer.chunk_bytes,
        optimizer.num_threads,
    )


def host_update_seconds(nbytes: int, model: HostUpdate, on_device: bool = False, num_tensors: int = 0) -> float:
    """Seconds of the update of ``nbytes`` of parameters in ``num_tensors`` tensors: on the host
    (bytes x seconds per byte + tensors x the fixed seconds per tensor), or (``on_device``) on
    the device for a share the plan keeps there (its bytes only)."""
    if on_device:
        return nbytes * model.device_seconds_per_byte
    return nbytes * model.host_seconds_per_byte + num_tensors * model.host_seconds_per_tensor
