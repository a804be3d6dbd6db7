"""Trinity's options: one frozen, validated object.

Built from ``torch.compile(model, backend="trinity", options={...})`` and from ``TRINITY_*``
environment variables (an explicit option wins over the environment, the environment over the
default). Every value is validated eagerly: an unknown key, a wrong type or a malformed size raises
:class:`ValueError` that names the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import decimal
import math
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "MemoryBudget",
    "TrinityOptions",
    "parse_size",
    "format_bytes",
    "ENV_PREFIX",
]

ENV_PREFIX = "TRINITY_"

# Binary and decimal units accepted by sizes ("12GiB", "800MB", "1.5 gb", "4096").
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_SIZE_RE = re.compile(r"^\s*((?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_SIZE_HELP = (
    "an int number of bytes, or a string with a unit such as '800MB', '12GiB', '1.5GB' "
    "(units: B, KB, MB, GB, TB powers of 1000; KiB, MiB, GiB, TiB powers of 1024)"
)


def parse_size(key: str, value: Any) -> int:
    """Parse a byte count.

    Args:
        key: the option name, used in the error message.
        value: an ``int`` (bytes, >= 0) or a string such as ``"800MB"`` or ``"12GiB"``.

    Returns:
        The size in bytes (int, >= 0).

    Raises:
        ValueError: naming ``key`` and ``value`` if the value is not a valid size.
    """
    if isinstance(value, bool):
        raise ValueError(f"trinity option {key!r}: got {value!r}; expected {_SIZE_HELP}")
    if _negative(value):
        raise ValueError(f"trinity option {key!r}: got {value!r}; a size must be >= 0 bytes")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(
                f"trinity option {key!r}: got {value!r}; expected a whole, non-negative number of bytes or {_SIZE_HELP}"
            )
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            number = float(m.group(1))
            unit = m.group(2).lower()
            result = number * _UNITS[unit]
            # A bare byte count must be whole; with a larger unit the result is rounded to bytes.
            if math.isfinite(result) and (unit not in ("", "b") or result == int(result)):
                return int(round(result))
    raise ValueError(f"trinity option {key!r}: got {value!r}; expected {_SIZE_HELP}")


def _negative(value: Any) -> bool:
    """Whether ``value`` is a negative number or a string of one (``-1``, ``"-5GiB"``)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return value < 0
    return isinstance(value, str) and value.strip().startswith("-")


def format_bytes(n: float | int | None) -> str:
    """Human-readable bytes with binary units, e.g. ``1.50 MiB``; ``None`` gives ``'no limit'``."""
    if n is None:
        return "no limit"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class MemoryBudget:
    """The requested device-memory budget, before it is resolved against a graph.

    Exactly one form:
      * ``kind="bytes"``: ``value`` is an absolute number of bytes;
      * ``kind="fraction"``: ``value`` in (0, 1] is a fraction of the training step's peak
        without offloading (given as ``"50%"``): every compiled graph pair of the step, the model
        state they hold, and a reused block graph's runs (``step_budget.py``); for a step of one
        pair, that pair's own peak;
      * ``kind="auto"``: on CUDA, the device's free memory at compile time less
        ``TrinityOptions.budget_reserve_bytes``; without CUDA, no limit.
      * ``kind="none"``: no limit (never offload).
    """

    kind: Literal["bytes", "fraction", "auto", "none"]
    value: float = 0.0

    @staticmethod
    def parse(value: Any, key: str = "memory_budget") -> MemoryBudget:
        """Parse ``int`` bytes (or a float or string that is a whole number of bytes: ``1e9``,
        ``"1e9"``), ``"12GiB"``, ``"2.5e3MB"``, ``"50%"``, ``"auto"`` or ``None`` /
        ``"none"`` / ``"unlimited"`` / ``"inf"`` (no limit).

        Raises:
            ValueError: naming the key and the value when it is none of the above, when a
                percentage is not in (0, 100], or when a byte count is negative or 0.
        """
        if isinstance(value, MemoryBudget):
            return value
        if value is None:
            return MemoryBudget("none")
        if isinstance(value, str):
            text = value.strip().lower()
            if text == "auto":
                return MemoryBudget("auto")
            if text in ("none", "unlimited", "inf"):
                return MemoryBudget("none")
            if text.endswith("%"):
                try:
                    with decimal.localcontext(decimal.Context(prec=100)):
                        pct = decimal.Decimal(text[:-1].strip())
                        fraction = float(pct / 100)
                    ok = pct.is_finite() and 0 < pct <= 100
                except (decimal.InvalidOperation, ValueError):
                    raise ValueError(
                        f"trinity option {key!r}: got {value!r}; {text[:-1].strip()!r} before the '%' is not a "
                        "number: a percentage is a number in (0, 100] followed by '%', such as '50%' or '37.5%' (a "
                        "fraction of the training step's peak without offloading)"
                    ) from None
                if not ok:
                    raise ValueError(
                        f"trinity option {key!r}: got {value!r}; a percentage must be in (0%, 100%] "
                        "(a fraction of the training step's peak without offloading)"
                    )
                return MemoryBudget("fraction", fraction)
        if _negative(value):
            raise ValueError(
                f"trinity option {key!r}: got {value!r}; a memory budget cannot be negative (bytes >= 0, a "
                "percentage such as '50%', 'auto', or None for no limit)"
            )
        try:
            nbytes = parse_size(key, value)
            budget = MemoryBudget("bytes", float(nbytes))
        except (ValueError, OverflowError):
            hint = ""
            try:
                number = float(value) if isinstance(value, (float, str)) else None
            except ValueError:
                number = None
            if number is not None and 0 < number < 1:
                hint = f" (a fraction is written as a percentage: {MemoryBudget('fraction', number).percent_text()!r})"
            raise ValueError(
                f"trinity option {key!r}: got {value!r}; expected {_SIZE_HELP}, a percentage "
                "such as '50%' of the training step's peak without offloading, 'auto' (free device memory less a reserve) "
                f"or None (no limit){hint}"
            ) from None
        if nbytes == 0:
            # No plan holds a step in no memory: refused here, not at the compile (a fresh-user
            # trial found 0 accepted and refused only there, as infeasible).
            raise ValueError(
                f"trinity option {key!r}: got {value!r}; a memory budget of 0 bytes cannot be met (a positive size "
                "such as '12GiB', a percentage such as '50%', 'auto', or None for no limit)"
            )
        return budget

    def percent_text(self) -> str:
        """The fraction as a percentage string that :meth:`parse` turns back into exactly
        ``self.value`` (the float's exact decimal expansion, times 100)."""
        with decimal.localcontext(decimal.Context(prec=100)):
            text = format((decimal.Decimal(self.value) * 100).normalize(), "f")
        return text + "%"

    def describe(self) -> str:
        """The budget as messages and reports name it. A byte count from 1 to 100 says how a
        percentage is written (``memory_budget=50`` or ``"50"`` is 50 bytes, not 50%)."""
        if self.kind == "bytes":
            hint = ""
            if 1 <= self.value <= 100 and self.value == int(self.value):
                hint = f"; a percentage is written with '%': '{int(self.value)}%'"
            return f"{format_bytes(self.value)} ({int(self.value)} bytes{hint})"
        if self.kind == "fraction":
            return f"{self.value * 100:g}% of the unplanned peak"
        return self.kind


_INNER = ("inductor", "eager")
_ON_INFEASIBLE = ("error", "warn")
_OFFLOAD = ("activations", "activations+params", "all")
_RUNTIME_CHECK = ("replan", "measure", "off")
_STRATEGY = ("auto", "offload", "recompute")


@dataclass(frozen=True)
class TrinityOptions:
    """All of trinity's options, validated. Build it with :meth:`from_user`.

    Attributes:
        memory_budget: peak device bytes the plan must not exceed (see :class:`MemoryBudget`).
        inner: the compiler the rewritten graphs go to: ``"inductor"`` or ``"eager"`` (plain FX
            Python code, AOTAutograd's ``boxed_nop``).
        dump_dir: directory for readable graphs, plans and plots; ``None`` writes nothing.
        verify: run the verifier on every rewritten graph pair (default on).
        on_infeasible: ``"error"`` raises when no plan reaches the budget; ``"warn"`` warns and
            uses the plan with the lowest reachable peak.
        min_offload_bytes: saved activations smaller than this (bytes) are never evicted.
        budget_reserve_bytes: with ``memory_budget="auto"`` on CUDA, bytes left free.
        host_pool_limit_bytes: the most host memory (bytes) the host pool may hold; ``None`` means
            half of the machine's physical memory.
        on_host_pool_full: at that limit, ``"fallback"`` uses host memory outside the pool (with
            a one-time warning); ``"error"`` raises ``HostPoolExhausted``.
        device: a key of ``offload_compiler.devices.KNOWN_DEVICES`` (e.g. ``"h100-sxm"``) whose
            figures the cost model uses instead of detecting the device.
        calibration: a JSON file written by ``python -m offload_compiler calibrate``; its measured
            figures replace the device table's (the options below still win).
        peak_flops: override of the device's peak FLOP/s (all dtypes).
        hbm_bytes_per_s: override of the device's memory bandwidth (bytes/s).
        h2d_bytes_per_s: override of host-to-device copy bandwidth (bytes/s).
        d2h_bytes_per_s: override of device-to-host copy bandwidth (bytes/s).
        host_bytes_per_s: override of the host's sustained memory bandwidth (bytes/s; as
            :func:`offload_compiler.calibrate.stream_bytes_per_s` counts it: STREAM's kernels with
            their write-allocate traffic), from which the host optimizer update's time is derived
            (``offload="all"``).
        optimizer_on_device: with ``offload="all"``, the share of the parameters (by bytes, in
            the order the forward uses them) whose optimizer state, gradient and parameter stay on
            the device and are updated there (ZeRO-Offload++'s Twin-Flow): a number in 0.0..1.0
            (0.0, the default: every parameter on the host), or ``"auto"``: the share the cost
            model predicts the shortest step for within the memory budget, balancing the host
            update against the backward (``passes/optimizer_split.py``).
        device_memory_bytes: override of the device's memory size (bytes).
        inductor_config: extra ``torch._inductor.config`` patches for ``inner="inductor"``.
        fault_injection: a seed turns on the runtime's fault injection (for tests, on a CPU:
            copies deferred to their waits, fresh buffers poisoned with NaN, pool blocks handed
            out in random order; see ``offload_compiler.runtime.transfer.FaultInjection``). With
            ``num_streams > 1`` and ``inner="eager"`` the multi-stream graphs also run under the
            interleaving executor (``offload_compiler.testing.interleave``).
        num_streams: compute streams per device (int >= 1), or ``None`` (the default: 2 with
            ``inner="eager"`` and ``offload="activations"``, else 1; see :attr:`compute_streams`). 1 turns the
            ``assign_streams`` pass off; with more, independent nodes may run on side streams
            where the cost model says that shortens the step. Only with ``inner="eager"``: an
            explicit ``num_streams > 1`` with Inductor is switched off with a one-time warning
            (see README).
        offload: what lives in host memory: ``"activations"`` (saved activations the plan
            evicts; the default), ``"activations+params"`` (also parameters, fetched to the device
            around their uses inside the step and resident between steps) or ``"all"`` (also
            gradients and optimizer state: parameters live in host memory between steps, gradients
            go to host memory as produced, ``offload_compiler.CPUOptimizer`` steps on the CPU).
            Parameter offload needs ``inner="eager"``.
        runtime_check: what the compiled code does in its first steps
            (``offload_compiler/step_check.py``): ``"replan"`` (the default) measures the
            first step of a plan on this machine (the allocator's events: the peak, and per op the
            workspace it allocates and frees inside itself), reports it
            (``TrinityReport.measured_peak_bytes``) and, where the measured peak is above the
            budget, plans again with the measured workspace as margins (at most twice), and
            where the graph runs several times at once per step (a block graph that N blocks run:
            ``TrinityReport.reuse_count``), plans again for its N runs;
            ``"measure"`` measures and reports only; ``"off"`` does neither. Off under
            ``fault_injection`` (its deferred copies keep memory alive on purpose).
        strategy: how a budget below the unplanned peak is met, per saved activation:
            ``"auto"`` (the default: keep, offload or recompute, whichever the joint planner
            predicts fastest within the budget, ``passes/plan_recompute.py``), ``"offload"``
            (keep or offload only) or ``"recompute"`` (keep or recompute in the backward only, no
            copies). With parameter offload (``offload`` other than ``"activations"``) saved
            activations are kept or offloaded (``"auto"`` means ``"offload"`` there;
            ``"recompute"`` is refused).
        op_times: how the cost model times a node: ``"roofline"`` (the default: FLOPs and bytes
            against the device's figures, ``passes/cost_model.py``) or ``"measured"`` (each
            distinct aten call of the graphs timed on this machine at compile time, with inputs of
            the graph's shapes, ``passes/op_timing.py``; the roofline for what is not measured).
            ``"measured"`` times this machine, so it is refused with a table ``device`` other
            than ``"cpu"``.
        interconnect: under DDP with ``offload="all"``, the link between the ranks that the
            cost model times the gradients' bucket all-reduces on (ring alpha-beta,
            ``offload_compiler/collectives.py``): a key of ``offload_compiler.collectives.LINKS``
            (``"nvlink"``, ``"pcie"``, ``"ib-200g"``, ``"eth-25g"``) or a JSON file written by
            ``python -m offload_compiler calibrate --collectives``; ``None`` (the default):
            ``"pcie"``.
        solver_time_limit: seconds the joint planner's MIP solver (``strategy="auto"``,
            ``passes/plan_recompute.py``) searches per program before it stops at its best
            solution so far, counted in the solver thread's CPU time
            (:func:`~offload_compiler.passes.plan_recompute.solver_clock`: other processes on
            the machine do not change the plan) (soft: without one it searches on,
            :data:`~offload_compiler.passes.plan_recompute.SOLVER_START_PATIENCE_S` more when
            the recompute-only choice is known to fit, else up to ``max(this, 10)`` s). Default
            0.5 (the demo GPT at 48 layers plans in 1.6 s on H100 figures); a larger value can
            find a faster plan for a large model (llama-7b's plan is 2.7% faster at 60 s).
    """

    memory_budget: MemoryBudget = field(default_factory=lambda: MemoryBudget("auto"))
    inner: Literal["inductor", "eager"] = "inductor"
    dump_dir: Path | None = None
    verify: bool = True
    on_infeasible: Literal["error", "warn"] = "error"
    min_offload_bytes: int = 1 << 20
    budget_reserve_bytes: int = 1 << 30
    host_pool_limit_bytes: int | None = None
    on_host_pool_full: Literal["fallback", "error"] = "fallback"
    device: str | None = None
    calibration: Path | None = None
    peak_flops: float | None = None
    hbm_bytes_per_s: float | None = None
    h2d_bytes_per_s: float | None = None
    d2h_bytes_per_s: float | None = None
    host_bytes_per_s: float | None = None
    optimizer_on_device: float | Literal["auto"] = 0.0
    device_memory_bytes: int | None = None
    inductor_config: tuple[tuple[str, Any], ...] = ()
    fault_injection: int | None = None
    offload: Literal["activations", "activations+params", "all"] = "activations"
    num_streams: int | None = None
    runtime_check: Literal["replan", "measure", "off"] = "replan"
    strategy: Literal["auto", "offload", "recompute"] = "auto"
    op_times: Literal["roofline", "measured"] = "roofline"
    interconnect: str | None = None
    solver_time_limit: float = 0.5

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_user(
        cls,
        options: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> TrinityOptions:
        """Validate ``options`` (from ``torch.compile(..., options=...)``) over ``TRINITY_*``
        environment variables (``env`` defaults to ``os.environ``) over the defaults.

        Raises:
            ValueError: for an unknown key (listing the allowed keys), a wrong type, or a
                malformed size; the message names the key and the value.
        """
        if options is None:
            options = {}
        if isinstance(options, TrinityOptions):
            return options
        if not isinstance(options, Mapping):
            raise ValueError(
                f"trinity options must be a dict of option name to value; got {type(options).__name__} {options!r}"
            )
        env = os.environ if env is None else env
        allowed = sorted(f.name for f in dataclasses.fields(cls))
        known_env = {ENV_PREFIX + name.upper() for name in allowed}
        for env_key in env:
            if env_key.startswith(ENV_PREFIX) and env_key not in known_env:
                warnings.warn(
                    f"environment variable {env_key} is not a trinity option and is ignored; known: "
                    + ", ".join(sorted(known_env)),
                    stacklevel=2,
                )
        values: dict[str, Any] = {}
        for name in allowed:
            env_key = ENV_PREFIX + name.upper()
            if env_key in env and env[env_key] != "":
                values[name] = (_from_env(name, env[env_key]), env_key)
        for key, value in options.items():
            if not isinstance(key, str) or key not in allowed:
                raise ValueError(
                    f"trinity option {key!r} is unknown (value {value!r}); allowed options: " + ", ".join(allowed)
                )
            values[key] = (value, key)
        kwargs = {name: _validate(name, value, where) for name, (value, where) in values.items()}
        opts = cls(**kwargs)

        def sources(*names: str) -> str:
            """Where each value came from (an option, a ``TRINITY_*`` variable, or the default)."""

            def src(name):
                where = values[name][1] if name in values else None
                return "the default" if where is None else (where if where.startswith(ENV_PREFIX) else "options")

            return " (" + "; ".join(f"{n} from {src(n)}" for n in names) + ")"

        if opts.strategy == "recompute" and opts.offload != "activations":
            raise ValueError(
                f"trinity option 'strategy': 'recompute' is not combined with offload={opts.offload!r} yet "
                "(with parameter offload saved activations are kept or offloaded); use strategy='auto' or "
                "'offload', or offload='activations'" + sources("strategy", "offload")
            )
        if opts.op_times == "measured" and opts.device is not None and not _is_host_cpu(opts.device):
            raise ValueError(
                f"trinity option 'op_times': 'measured' times the ops on this machine, so it cannot plan for the "
                f"table device {opts.device!r}; use op_times='roofline' with device={opts.device!r}, or leave "
                "device unset" + sources("op_times", "device")
            )
        if opts.optimizer_on_device != 0.0 and opts.offload != "all":
            raise ValueError(
                f"trinity option 'optimizer_on_device': {opts.optimizer_on_device!r} needs offload='all' (the "
                f"optimizer state is on the device anyway otherwise); got offload={opts.offload!r}"
                + sources("optimizer_on_device", "offload")
            )
        if opts.offload != "activations" and opts.inner != "eager":
            raise ValueError(
                f"trinity option 'offload': {opts.offload!r} needs inner='eager' (parameter storages are "
                "resized inside the graph, which Inductor's buffer planning does not allow); got "
                f"inner={opts.inner!r}" + sources("offload", "inner")
            )
        return opts

    @property
    def compute_streams(self) -> int:
        """The compute streams the ``assign_streams`` pass may use: ``num_streams``, or when it
        is ``None``, 2 where the pass can run (``inner="eager"`` with ``offload="activations"``)
        and 1 elsewhere (Inductor keeps one compute stream; parameter offload is not combined
        with side streams yet), without a warning."""
        if self.num_streams is not None:
            return self.num_streams
        return 2 if self.inner == "eager" and self.offload == "activations" else 1

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly view (used in dumps and reports); :meth:`from_user` accepts it back."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, MemoryBudget):
                v = (
                    {"bytes": int(v.value), "auto": "auto", "none": None}.get(v.kind)
                    if v.kind != "fraction"
                    else (v.percent_text())
                )
            elif isinstance(v, Path):
                v = str(v)
            elif f.name == "inductor_config":
                v = dict(v)
            out[f.name] = v
        return out


def _is_host_cpu(device: str) -> bool:
    """Whether the table device ``device`` is the host CPU entry (``"cpu"``)."""
    from .devices import KNOWN_DEVICES, lookup_device

    return lookup_device(device) is KNOWN_DEVICES["cpu"]


def _from_env(name: str, text: str) -> Any:
    """Environment values are strings; turn them into what :func:`_validate` expects."""
    if name in ("verify",):
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        return text  # rejected by _validate with the env key in the message
    if name == "inductor_config":
        import json

        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text
    return text


def _validate(name: str, value: Any, where: str) -> Any:
    def bad(expected: str) -> ValueError:
        return ValueError(f"trinity option {where!r}: got {value!r}; expected {expected}")

    if name == "memory_budget":
        return MemoryBudget.parse(value, where)
    if name == "inner":
        if value not in _INNER:
            raise bad("one of " + ", ".join(repr(v) for v in _INNER))
        return value
    if name == "on_host_pool_full":
        if value not in ("fallback", "error"):
            raise bad("'fallback' or 'error'")
        return value
    if name == "offload":
        if value not in _OFFLOAD:
            raise bad("one of " + ", ".join(repr(v) for v in _OFFLOAD))
        return value
    if name == "runtime_check":
        if value not in _RUNTIME_CHECK:
            raise bad("one of " + ", ".join(repr(v) for v in _RUNTIME_CHECK))
        return value
    if name == "strategy":
        if value not in _STRATEGY:
            raise bad("one of " + ", ".join(repr(v) for v in _STRATEGY))
        return value
    if name == "op_times":
        if value not in ("roofline", "measured"):
            raise bad("'roofline' or 'measured'")
        return value
    if name == "interconnect":
        if value is None:
            return None
        if not isinstance(value, (str, os.PathLike)) or str(value) == "":
            raise bad("a link name (nvlink, pcie, ib-200g, eth-25g) or a calibrate --collectives JSON file")
        from .distributed import resolve_interconnect

        try:
            resolve_interconnect(value)
        except ValueError as exc:
            raise ValueError(f"trinity option {where!r}: {exc}") from None
        return str(value)
    if name == "on_infeasible":
        if value not in _ON_INFEASIBLE:
            raise bad("one of " + ", ".join(repr(v) for v in _ON_INFEASIBLE))
        return value
    if name == "calibration":
        if value is None:
            return None
        if not isinstance(value, (str, os.PathLike)) or str(value) == "":
            raise bad("the path of a JSON file written by `python -m offload_compiler calibrate`")
        from .calibrate import load_calibration

        try:
            load_calibration(value)
        except ValueError as exc:
            raise ValueError(f"trinity option {where!r}: {exc}") from None
        return Path(value)
    if name == "dump_dir":
        if value is None:
            return None
        if isinstance(value, (str, os.PathLike)) and str(value) != "":
            return Path(value)
        raise bad("a directory path (str or os.PathLike) or None")
    if name == "verify":
        if not isinstance(value, bool):
            raise bad(
                "True or False (in the environment: 1, true, yes or on; 0, false, no or off)"
                if str(where).startswith("TRINITY_")
                else "True or False"
            )
        return value
    if name in ("min_offload_bytes", "budget_reserve_bytes"):
        return parse_size(where, value)
    if name in ("host_pool_limit_bytes", "device_memory_bytes"):
        if value is None:
            return None
        size = parse_size(where, value)
        if size == 0:
            raise bad("a positive size")
        return size
    if name == "optimizer_on_device":
        if value == "auto":
            return "auto"
        try:
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise ValueError
            share = float(value)
        except (ValueError, OverflowError):
            raise bad("'auto' or a number from 0.0 to 1.0 (the share of the parameter bytes)") from None
        if not 0.0 <= share <= 1.0:
            raise bad("'auto' or a number from 0.0 to 1.0 (the share of the parameter bytes)")
        return share
    if name == "solver_time_limit":
        try:
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise ValueError
            limit = float(value)
        except (ValueError, OverflowError):
            raise bad("a number of seconds, > 0 and at most 3600") from None
        if not (math.isfinite(limit) and 0 < limit <= 3600):
            raise bad("a number of seconds, > 0 and at most 3600")
        return limit
    if name in ("peak_flops", "hbm_bytes_per_s", "h2d_bytes_per_s", "d2h_bytes_per_s", "host_bytes_per_s"):
        if value is None:
            return None
        try:
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise ValueError
            value_f = float(value)
        except (ValueError, OverflowError):
            raise bad("a positive, finite number (FLOP/s or bytes/s), e.g. 1e12") from None
        if not (math.isfinite(value_f) and value_f > 0):
            raise bad("a positive, finite number (FLOP/s or bytes/s)")
        return value_f
    if name == "device":
        if value is None:
            return None
        from .devices import KNOWN_DEVICES, lookup_device

        if not isinstance(value, str):
            raise bad("a device name, one of " + ", ".join(sorted(KNOWN_DEVICES)))
        try:
            spec = lookup_device(value)
        except ValueError:
            raise bad("a device name, one of " + ", ".join(sorted(KNOWN_DEVICES))) from None
        if value.strip().lower() not in KNOWN_DEVICES:
            key = next(k for k, v in KNOWN_DEVICES.items() if v is spec)
            warnings.warn(
                f"trinity option device={value!r} ({where}) is not a table key; using the figures of "
                f"{key!r}. Table keys: {', '.join(sorted(KNOWN_DEVICES))}",
                stacklevel=2,
            )
        return value
    if name == "fault_injection":
        if value is None:
            return None
        digits = value.strip().lstrip("-") if isinstance(value, str) else ""
        if digits.isascii() and digits.isdigit():  # not "¹": str.isdigit accepts superscripts
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise bad("None or a non-negative int seed")
        return value
    if name == "num_streams":
        if value is None:
            return None
        number = int(value) if isinstance(value, str) and value.strip().isdigit() else value
        if isinstance(number, bool) or not isinstance(number, int) or number < 1:
            raise bad("None or an int >= 1 (1 turns multi-stream compute off)")
        return number
    if name == "inductor_config":
        if isinstance(value, tuple) and all(isinstance(kv, tuple) and len(kv) == 2 for kv in value):
            value = dict(value)
        if not isinstance(value, Mapping):
            raise bad("a dict of torch._inductor.config names to values")
        import torch._inductor.config as inductor_config

        known = set(inductor_config._config.keys()) if hasattr(inductor_config, "_config") else None
        for k in value:
            if not isinstance(k, str) or (known is not None and k not in known):
                raise ValueError(f"trinity option {where!r}: {k!r} is not a torch._inductor.config setting")
        return tuple(sorted(value.items()))
    raise AssertionError(f"no validator for option {name}")
