"""End-to-end multi-stream compute (inner="eager"): the e2e model list with num_streams 1, 2, 3.

The device figures are slowed down (1 GFLOP/s, 10 GB/s) so that the cost model finds these tiny
models' kernels worth a side stream. ``fault_injection`` makes the backend run every multi-stream
graph under the interleaving executor (``offload_compiler.testing.interleave``): streams really
interleave in random valid orders, freed and unwritten buffers read as NaN, copies are deferred to
their waits. Losses and gradients must be bit-identical to ``aot_eager`` and to ``num_streams=1``.
"""

import logging
import re

import pytest
import torch

from .test_e2e import CASES, SideBySide

SLOW = {"peak_flops": 1e9, "hbm_bytes_per_s": 1e10}
# The models whose backward has independent matmuls (input and weight gradients).
MUST_USE_STREAMS = {"mlp", "gpt_block", "tensor_and_transpose", "noncontiguous_shifted_labels"}


def _grads(model):
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_one_two_and_three_streams_under_interleaving(case, caplog):
    make_model, make_batch = CASES[case]
    batch = make_batch()
    grads = {}
    for num_streams in (1, 2, 3):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="offload_compiler"):
            sbs = SideBySide(make_model, "eager", num_streams=num_streams, fault_injection=17 + num_streams, **SLOW)
            sbs.step(batch)  # bit-identical to aot_eager
        used = [int(m) for m in re.findall(r"assign_streams \w+: (\d+) streams used", caplog.text)]
        if num_streams == 1:
            assert used == []
        elif case in MUST_USE_STREAMS:
            assert used and max(used) > 1, f"{case}: no graph used a side stream ({caplog.text[-500:]})"
        # One more step, gradients kept for the comparison across stream counts.
        sbs.sync()
        sbs.trinity_step(batch)
        grads[num_streams] = _grads(sbs.model)
    for n in (2, 3):
        for a, b in zip(grads[1], grads[n]):
            assert (a is None and b is None) or torch.equal(a, b), f"{case}: num_streams={n} differs from 1"


@pytest.mark.parametrize("case", ["mlp", "gpt_block"])
def test_planned_peak_holds_with_side_streams(case):
    """Run as plain FX code (the interleaving executor keeps every value, so it is not the place
    to measure memory): exact parity, and the measured peak within the budget."""
    make_model, make_batch = CASES[case]
    batch = make_batch()
    sbs = SideBySide(make_model, "eager", num_streams=2, **SLOW)
    sbs.step(batch)
    sbs.step(batch)
    sbs.check_memory(batch)


def test_inductor_switches_streams_off_with_a_warning():
    """Without compiling: the session's stream step warns and leaves the graphs alone."""
    from offload_compiler.options import TrinityOptions
    from offload_compiler.pipeline import CompileSession
    from offload_compiler.runtime.transfer import TransferRuntime

    from .graphs import mlp_pair

    pair = mlp_pair()
    before = [n.name for n in pair.backward.graph.nodes]
    opts = TrinityOptions.from_user({"inner": "inductor", "num_streams": 2}, env={})
    session = CompileSession(opts, torch.device("cpu"), TransferRuntime(torch.device("cpu"), 1 << 20))
    with pytest.warns(UserWarning, match="ignored with inner='inductor'"):
        assert session._assign_streams(pair, None, 0) == {}
    assert [n.name for n in pair.backward.graph.nodes] == before


def test_dumps_show_streams_and_a_multi_stream_trace(tmp_path):
    import json

    sbs = SideBySide(CASES["mlp"][0], "eager", num_streams=2, dump_dir=str(tmp_path), **SLOW)
    sbs.step(CASES["mlp"][1]())
    (graph_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    code = (graph_dir / "20_assign_streams.backward.py").read_text()
    assert "trinity_stream: 1" in code and "trinity.wait_event" in code and "trinity.record_event" in code
    streams = json.loads((graph_dir / "streams.json").read_text())
    assert streams["backward"]["seconds"] < streams["backward"]["single_stream_seconds"]
    trace = json.loads((graph_dir / "timeline.json").read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert "compute side stream 1" in names
    side = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("tid") == 11]
    assert side, "no kernel on the side stream's track"
