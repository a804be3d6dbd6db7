"""The main job: train a character-level GPT twice, without and with trinity, and compare.

The corpus is the Python standard library's own source (present on every machine, no download).
Both runs start from the same seed and see the same batches: the reference through the same inner
compiler without trinity (``aot_eager`` for ``inner="eager"``, Inductor for ``inner="inductor"``),
then ``backend="trinity"`` at the chosen memory budget. Per step both losses are printed; at the
end, the measured peak device bytes of both, what was evicted, step times and where the dumps are.

Run it with ``make demo`` or ``python -m offload_compiler demo``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .host_load import BUSY_FRACTION, OtherLoad
from .models import GPT, GPTConfig
from .options import TrinityOptions, format_bytes
from .pipeline import InfeasibleBudgetError
from .report import reports
from .runtime.accounting import measure_peak_device_bytes

__all__ = ["load_corpus", "Batches", "main"]


def load_corpus(max_bytes: int = 4 << 20) -> torch.Tensor:
    """Bytes of the standard library's ``.py`` files (sorted by path), at most ``max_bytes``, as an
    int64 tensor of token ids in [0, 256).

    Raises:
        RuntimeError: if the standard library's source cannot be found.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py")) + sorted(root.glob("*/*.py"))
    chunks, total = [], 0
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise RuntimeError(f"no Python source found under {root} for the demo corpus")
    blob = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(torch.int64)


@dataclass
class Batches:
    """Random windows of the corpus, reproducible from a seed.

    ``batch(step)`` gives ``(x, y)`` of shape ``[batch_size, seq_len]`` (int64), ``y`` shifted by
    one token.
    """

    data: torch.Tensor
    batch_size: int
    seq_len: int
    seed: int = 0

    def batch(self, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.data.numel() - self.seq_len - 1, (self.batch_size,), generator=g)
        x = torch.stack([self.data[s : s + self.seq_len] for s in starts.tolist()])
        y = torch.stack([self.data[s + 1 : s + 1 + self.seq_len] for s in starts.tolist()])
        return x.to(device), y.to(device)


class _LossModel(torch.nn.Module):
    def __init__(self, gpt: GPT):
        super().__init__()
        self.gpt = gpt

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.gpt(x).flatten(0, 1), y.flatten())


@dataclass
class RunResult:
    losses: list[float]
    step_seconds: list[float]
    peak_bytes: int
    compile_seconds: float


def _train(model, compiled, batches, steps, device, progress, task, label) -> RunResult:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses, times = [], []
    compile_seconds = 0.0
    for step in range(steps):
        x, y = batches.batch(step, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = compiled(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if step == 0:
            compile_seconds = dt
        else:
            times.append(dt)
        losses.append(loss.item())
        progress.update(task, advance=1, description=f"{label}: step {step + 1}/{steps} loss {losses[-1]:.4f}")
    # One more forward and backward, measured: the peak device bytes of what trinity plans (the
    # compiled step with parameters, gradients and batch; the optimizer's state and update are
    # outside the compiled graph and left out of the count, for both runs alike).
    x, y = batches.batch(steps, device)

    def fwd_bwd():
        loss = compiled(x, y)
        loss.backward()
        return loss

    if device.type == "cuda":
        # The allocator counts everything resident; move the optimizer's state out of the count by
        # measuring against what is allocated before the call.
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(device)
        state = sum(
            t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if torch.is_tensor(t)
        )
        m = measure_peak_device_bytes(fwd_bwd, device=device)
        peak = m.peak_bytes - state if base >= state else m.peak_bytes
    else:
        m = measure_peak_device_bytes(fwd_bwd, resident=list(model.parameters()) + [x, y], device=device)
        peak = m.peak_bytes
    opt.zero_grad(set_to_none=True)
    return RunResult(losses, times, peak, compile_seconds)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m offload_compiler demo``; returns the exit status (1 if the two
    runs' losses disagree beyond the tolerance, or trinity's peak exceeds its budget; 2 if no plan
    reaches the budget: the refusal's message is printed, with the budget that runs)."""
    parser = argparse.ArgumentParser(prog="python -m offload_compiler demo", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps per run (default 40)")
    parser.add_argument(
        "--inner", choices=["inductor", "eager"], default="inductor", help="inner compiler (default inductor)"
    )
    parser.add_argument("--budget", default="50%", help="trinity memory_budget (default 50%%)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--dump-dir", default="trinity_dumps", help="where trinity writes its dumps")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    console = Console()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    reference_backend = "aot_eager" if args.inner == "eager" else "inductor"
    cfg = GPTConfig(vocab_size=256, block_size=args.seq_len, n_layer=args.layers, n_head=4, n_embd=args.width)
    data = load_corpus()
    batches = Batches(data, args.batch_size, args.seq_len, seed=args.seed)
    console.print(
        f"[bold]trinity demo[/bold]: character-level GPT ({args.layers} layers, width {args.width}, "
        f"seq {args.seq_len}, batch {args.batch_size}) on {format_bytes(data.numel())} of the Python standard "
        f"library, {args.steps} steps on {device}, torch {torch.__version__}"
    )
    console.print(
        f"reference: torch.compile(backend={reference_backend!r});  trinity: torch.compile(backend='trinity', "
        f"options={{'memory_budget': {args.budget!r}, 'inner': {args.inner!r}}})"
    )

    options = {"memory_budget": args.budget, "inner": args.inner, "dump_dir": args.dump_dir}
    try:
        TrinityOptions.from_user(options)  # a bad option fails here, before the reference run
    except ValueError as exc:
        parser.error(str(exc))
    torch.manual_seed(args.seed)
    ref_model = _LossModel(GPT(cfg)).to(device)
    tri_model = copy.deepcopy(ref_model)
    before = len(reports())
    with (
        OtherLoad() as load,
        Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console) as progress,
    ):
        task = progress.add_task("reference", total=args.steps)
        ref = _train(
            ref_model,
            torch.compile(ref_model, backend=reference_backend),
            batches,
            args.steps,
            device,
            progress,
            task,
            "reference",
        )
        task = progress.add_task("trinity", total=args.steps)
        try:
            tri = _train(
                tri_model,
                torch.compile(tri_model, backend="trinity", options=options),
                batches,
                args.steps,
                device,
                progress,
                task,
                "trinity",
            )
        except Exception as exc:  # a budget no plan reaches: its message, not Dynamo's traceback
            refused = getattr(exc, "inner_exception", exc)
            if not isinstance(refused, InfeasibleBudgetError):
                raise
            progress.stop()
            console.print(f"[bold red]trinity refused the budget[/bold red] {args.budget!r}:")
            console.print(str(refused), markup=False, highlight=False)
            return 2
    new_reports = reports()[before:]

    exact = args.inner == "eager"
    table = Table(title="losses per step")
    for col in ("step", "reference", "trinity", "relative difference"):
        table.add_column(col, justify="right")
    worst = 0.0
    for i, (a, b) in enumerate(zip(ref.losses, tri.losses)):
        rel = abs(a - b) / max(abs(a), 1e-12)
        worst = max(worst, rel)
        table.add_row(str(i + 1), f"{a:.7f}", f"{b:.7f}", f"{rel:.2e}")
    console.print(table)

    summary = Table(title="measured: one forward and backward (optimizer state and update left out)")
    for col in ("", "reference", "trinity", "trinity / reference"):
        summary.add_column(col, justify="right")
    summary.add_row(
        "peak device memory",
        format_bytes(ref.peak_bytes),
        format_bytes(tri.peak_bytes),
        f"{tri.peak_bytes / ref.peak_bytes:.2f}",
    )
    ref_t, tri_t = statistics.median(ref.step_seconds), statistics.median(tri.step_seconds)
    summary.add_row("median step time", f"{ref_t * 1e3:.1f} ms", f"{tri_t * 1e3:.1f} ms", f"{tri_t / ref_t:.2f}")
    summary.add_row("first step (compile)", f"{ref.compile_seconds:.1f} s", f"{tri.compile_seconds:.1f} s", "")
    console.print(summary)
    if load.fraction is not None and load.fraction >= BUSY_FRACTION:
        console.print(
            f"[yellow]Other processes used {load.fraction:.0%} of this machine's CPU while the two runs trained "
            "(one after the other): their step times, and the ratio, say more about that load than about trinity. "
            "Run the demo on a quiet machine to compare them.[/yellow]"
        )
    for r in new_reports:
        console.print(r.summary())
    if device.type == "cpu":
        console.print(
            "[dim]On a CPU the host pool and the 'device' are the same memory: the peak counts "
            "device-tensor bytes (the host pool excluded) and copies are synchronous memcpy, so step "
            "times say nothing about overlap.[/dim]"
        )
    status = 0
    tolerance = 0.0 if exact else 1e-5
    if worst > tolerance:
        console.print(f"[red]losses differ: worst relative difference {worst:.2e} > {tolerance:g}[/red]")
        status = 1
    else:
        console.print(
            f"losses {'bit-identical' if exact else f'agree to {worst:.1e} relative (tolerance 1e-5)'} over {args.steps} steps"
        )
    budget = sum(r.budget_bytes for r in new_reports if r.budget_bytes is not None)
    if new_reports and budget:
        within = "within" if tri.peak_bytes <= budget else "[red]over[/red]"
        console.print(
            f"trinity's budget for the compiled step: {format_bytes(budget)}; measured peak "
            f"{format_bytes(tri.peak_bytes)} is {within} it; evicted "
            f"{format_bytes(sum(r.evicted_bytes for r in new_reports))} of saved activations per step"
        )
    console.print(f"dumps: {Path(args.dump_dir).resolve()}")
    return status


if __name__ == "__main__":
    sys.exit(main())
