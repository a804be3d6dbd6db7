"""Measured op times: each distinct aten call of a graph pair, timed on the machine it will run on.

The cost model's roofline (:mod:`.cost_model`) times a node from its FLOPs and bytes against the
device's peak figures. That misses what the kernels really do at the graph's shapes: a GELU or
an attention kernel on the CPU runs several times slower than its bytes at the memory bandwidth,
small ops cost their dispatcher call, a matmul's efficiency depends on its shape. With
``op_times="measured"`` the backend times each distinct call instead (same op, same argument
shapes, strides and dtypes, same non-tensor arguments) on the device, with inputs of those
layouts, and the cost model uses the measured seconds per call wherever it has them (the roofline
elsewhere). This is the profile-guided cost model of Alpa and FlexFlow (per-operator
measurements on the target device) applied to aten calls.

Method (:func:`measure`): per distinct call, real inputs of the fake values' sizes, strides,
storage offsets and dtypes (floats from a normal distribution, integer and bool tensors zero, so
indices are valid, or one where zeros make the call raise), one call whose outputs must have the
graph's shapes, then batches of calls timed by :mod:`offload_compiler.calibrate`'s timer
(``time.perf_counter`` on the host, CUDA events on a GPU), each batch at least
``min_batch_seconds`` long; the per-call figure is the median over ``batches`` batches. The random generators' states are restored afterwards (a timed
dropout draws no number the training would have drawn). The graphs run their ops back to back
the same way, so the figure counts the call's Python and dispatcher work as well as its kernel.

Not measured (the roofline times them; ``OpTimes.skipped`` and the report list them with the
reason): ops outside the ``aten`` namespace (trinity's copies are timed by the copy formula,
collectives by the communication model), ops whose output depends on the data (torch's
``data_dependent_output`` tag, or outputs of other shapes than the graph's on the built inputs:
a boolean mask's ``index``, ``nonzero``), calls with an argument the method cannot build (a
tensor subclass, a symbolic size without a hint), and a call that raises on the built inputs
(integer inputs are zeros, valid indices, and ones where zeros raise: a divisor). Views are
measured only where the host is the device (elsewhere their dispatch overlaps the device's work
and the roofline's 0 stands).

Reads ``node.meta["val"]``; writes nothing (the times are returned, the caller keeps them).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
import torch.fx as fx
from torch.utils._python_dispatch import _disable_current_modes

from ..host_load import OtherLoad
from ..ir.alias import hint_int

__all__ = ["OpTimes", "TimingKey", "timing_key", "measure"]

TimingKey = tuple
"""``(op name, argument structure)``: tensors as ``("T", sizes, strides, storage offset, dtype,
device type)``, other values as their ``repr``, nested lists as tuples."""

_SKIP_TAGS = tuple(getattr(torch.Tag, t) for t in ("data_dependent_output",) if hasattr(torch.Tag, t))
DATA_DEPENDENT = "its output shape depends on the data"


@dataclass(frozen=True, eq=False)
class OpTimes:
    """Measured seconds per call of distinct aten calls (see the module docstring).

    Attributes:
        seconds: :data:`TimingKey` -> seconds per call (read-only mapping).
        device: the device they were measured on (``"cpu"``, ``"cuda:0"``).
        threads: torch's intra-op threads when measured (``torch.get_num_threads()``).
        not_timed: :data:`TimingKey` -> why the call was not timed (the roofline times it).
        other_load: the share of all the host's cores (0-1) that other processes used while the
            calls were timed (:class:`~offload_compiler.host_load.OtherLoad`; the largest over
            the measurements merged here), or ``None`` where it could not be read. Above
            :data:`~offload_compiler.host_load.BUSY_FRACTION` the CPU times are suspect: the
            kernels' OpenMP threads wait for descheduled workers.
    """

    seconds: Mapping[TimingKey, float] = field(default_factory=lambda: MappingProxyType({}))
    device: str = "cpu"
    threads: int = 1
    not_timed: Mapping[TimingKey, str] = field(default_factory=lambda: MappingProxyType({}))
    other_load: float | None = None

    @property
    def skipped(self) -> tuple[tuple[str, str, int], ...]:
        """``(op name, why, distinct calls)`` of the calls not timed, most calls first."""
        counts: dict[tuple[str, str], int] = {}
        for key, why in self.not_timed.items():
            counts[(key[0], why)] = counts.get((key[0], why), 0) + 1
        return tuple((op, why, n) for (op, why), n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def seconds_of(self, node: fx.Node) -> float | None:
        """The measured seconds per call of ``node``'s call, or ``None`` where it was not
        measured."""
        key = timing_key(node)
        return None if key is None else self.seconds.get(key)

    def __len__(self) -> int:
        return len(self.seconds)


def _arg_key(value) -> Any:
    if isinstance(value, fx.Node):
        value = value.meta.get("val")
        if isinstance(value, torch.Tensor):
            return (
                "T",
                tuple(hint_int(s) for s in value.shape),
                tuple(hint_int(s) for s in value.stride()),
                hint_int(value.storage_offset()),
                str(value.dtype),
                value.device.type,
            )
        return ("V", repr(value if not isinstance(value, torch.SymInt) else hint_int(value)))
    if isinstance(value, (list, tuple)):
        return tuple(_arg_key(v) for v in value)
    if isinstance(value, torch.SymInt):
        return hint_int(value)
    return repr(value)


def timing_key(node: fx.Node) -> TimingKey | None:
    """The :data:`TimingKey` of an aten ``call_function`` node (``None`` for anything else)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    if target.namespace != "aten":
        return None
    try:
        return (
            target._schema.name + "." + target._overloadname,
            _arg_key(tuple(node.args)),
            tuple(sorted((k, _arg_key(v)) for k, v in node.kwargs.items())),
        )
    except Exception:  # a value without a hint: not measured
        return None


def _real(val: torch.Tensor, device: torch.device, gen: torch.Generator, int_fill: int = 0) -> torch.Tensor:
    """A tensor with ``val``'s sizes, strides, storage offset and dtype on ``device``: floats
    from a normal distribution, integers and bools ``int_fill``."""
    if type(val) is not torch.Tensor and not isinstance(val, torch._subclasses.FakeTensor):
        raise TypeError(f"a {type(val).__name__} is not built")
    size = tuple(hint_int(s) for s in val.shape)
    stride = tuple(hint_int(s) for s in val.stride())
    offset = hint_int(val.storage_offset())
    extent = offset + 1 + sum((n - 1) * s for n, s in zip(size, stride) if n > 0)
    if any(n == 0 for n in size):
        extent = offset
    if val.dtype.is_floating_point or val.dtype.is_complex:
        base = torch.randn(max(extent, 1), generator=gen, dtype=torch.float32).to(val.dtype)
    else:
        base = torch.full((max(extent, 1),), int_fill, dtype=val.dtype)
    base = base.to(device)
    t = base.as_strided(size, stride, offset)
    return t.requires_grad_(False)


def _build(value, device, gen, int_fill: int = 0):
    if isinstance(value, fx.Node):
        v = value.meta.get("val")
        if isinstance(v, torch.Tensor):
            return _real(v, device, gen, int_fill)
        if isinstance(v, torch.SymInt):
            return hint_int(v)
        if isinstance(v, (int, float, bool)) or v is None:
            return v
        raise TypeError(f"argument {value.name} has no tensor or number value")
    if isinstance(value, (list, tuple)):
        return type(value)(_build(v, device, gen, int_fill) for v in value)
    if isinstance(value, torch.SymInt):
        return hint_int(value)
    return value


def _time_call(fn, device: torch.device, batches: int, min_batch_seconds: float) -> float:
    """Median seconds per call of ``fn``: ``batches`` batches of as many calls as take at least
    ``min_batch_seconds`` (one call's first timing decides), timed by calibrate's timer (its
    warm-up calls first; CUDA events on a GPU)."""
    from ..calibrate import _timer

    time_it = _timer(device)
    one = max(time_it(fn, 1), 1e-7)
    calls = max(1, min(10_000, int(min_batch_seconds / one)))

    def batch():
        for _ in range(calls):
            fn()

    return time_it(batch, batches) / calls


def _is_view(node: fx.Node) -> bool:
    schema = node.target._schema
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def measure(
    nodes: Iterable[fx.Node],
    device: torch.device | str,
    *,
    host_is_device: bool,
    known: OpTimes | None = None,
    batches: int = 5,
    min_batch_seconds: float = 2e-4,
    seed: int = 0,
) -> OpTimes:
    """Time each distinct aten call among ``nodes`` on ``device`` (module docstring).

    Args:
        nodes: FX nodes with ``meta["val"]`` (fake tensors of the graph's shapes).
        device: where to run the calls; it must be this process's device of the graph.
        host_is_device: the device is the host CPU (views are measured too).
        known: times measured before; their keys are not measured again, and the result holds
            them.
        batches: timed batches per call (the median is kept).
        min_batch_seconds: the least length of one batch (seconds).
        seed: the random inputs' seed.

    Returns:
        the :class:`OpTimes` (``known``'s merged with the new ones).

    Raises:
        RuntimeError: when ``device`` is a CUDA device and CUDA is not available here.
    """
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"op_times='measured': the graph is on {device} but CUDA is not available here")
    if device.type == "meta":
        raise RuntimeError("op_times='measured': the graph is on the meta device; there is nothing to time")
    gen = torch.Generator().manual_seed(seed)
    seconds: dict[TimingKey, float] = dict(known.seconds) if known is not None else {}
    not_timed: dict[TimingKey, str] = dict(known.not_timed) if known is not None else {}
    # Random ops (dropout) draw from the generators: their states are put back afterwards, so
    # that timing changes no random number the training draws.
    rng_devices = [device] if device.type == "cuda" else []
    timed = 0
    with OtherLoad() as load, torch.no_grad(), _disable_current_modes(), torch.random.fork_rng(devices=rng_devices):
        for node in nodes:
            key = timing_key(node)
            if key is None or key in seconds or key in not_timed:
                continue
            if any(tag in node.target.tags for tag in _SKIP_TAGS):
                not_timed[key] = DATA_DEPENDENT
                continue
            if not host_is_device and _is_view(node):
                continue
            got = _time_node(node, device, gen, batches, min_batch_seconds)
            if isinstance(got, str):
                not_timed[key] = got
            else:
                seconds[key] = got
                timed += 1
    loads = [
        x for x in (known.other_load if known is not None else None, load.fraction if timed else None) if x is not None
    ]
    return OpTimes(
        MappingProxyType(seconds),
        str(device),
        torch.get_num_threads(),
        MappingProxyType(not_timed),
        max(loads) if loads else None,
    )


def _shapes(value) -> list[tuple[int, ...]]:
    if isinstance(value, torch.Tensor):
        return [tuple(hint_int(s) for s in value.shape)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _shapes(v)]
    return []


def _time_node(node: fx.Node, device, gen, batches: int, min_batch_seconds: float) -> float | str:
    """Seconds per call of ``node``'s call on built inputs, or why it was not timed. Integer
    inputs are zeros (valid indices), or ones where zeros raise (a divisor); a call whose
    outputs do not have the graph's shapes on them (a mask, ``nonzero``) is not timed."""
    why = ""
    for int_fill in (0, 1):
        try:
            args = _build(tuple(node.args), device, gen, int_fill)
            kwargs = {k: _build(v, device, gen, int_fill) for k, v in node.kwargs.items()}
            call = functools.partial(node.target, *args, **kwargs)
            out = call()
        except Exception as exc:
            why = _why(exc)
            continue
        want = _shapes(node.meta.get("val"))
        if _shapes(out) != want:
            return f"{DATA_DEPENDENT} (on built inputs {_shapes(out)}, in the graph {want})"
        try:
            return _time_call(call, device, batches, min_batch_seconds)
        except Exception as exc:
            return _why(exc)
    return why


def _why(exc: BaseException) -> str:
    """``"RuntimeError: <first line of the message>"`` (at most 120 characters of it)."""
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]}"
