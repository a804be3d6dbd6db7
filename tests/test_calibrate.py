"""calibrate: measured figures, the JSON file, and the backend option that uses it."""

import json

import pytest

from offload_compiler.calibrate import CALIBRATION_FIELDS, calibrate, load_calibration, main
from offload_compiler.devices import KNOWN_DEVICES
from offload_compiler.options import TrinityOptions
from offload_compiler.passes.cost_model import apply_overrides


def test_quick_calibration_measures_every_figure(tmp_path):
    figures = calibrate("cpu", quick=True)
    for key in CALIBRATION_FIELDS:
        assert figures[key] > 0, key
    # A CPU does between 1e8 and 1e14 FLOP/s and moves between 1e8 and 1e12 bytes/s.
    assert 1e8 < figures["flops_fp32"] < 1e14
    assert 1e8 < figures["hbm_bytes_per_s"] < 1e12
    assert figures["pageable_factor"] == 1.0
    # A copy's runtime calls (fetch, wait, release; a gradient's copy and wait) and the host
    # update's per-tensor work take microseconds, not milliseconds.
    for key in ("h2d_overhead_s", "d2h_overhead_s", "host_update_seconds_per_tensor"):
        assert figures[key] < 1e-3, key


def test_main_writes_json_the_options_accept(tmp_path, capsys):
    out = tmp_path / "calib.json"
    assert main(["--out", str(out), "--device", "cpu", "--quick"]) == 0
    units = {line.split()[0]: line.split()[-1] for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert units["h2d_bytes_per_s"] == "bytes/s" and units["hbm_bytes_per_s"] == "bytes/s"
    assert units["h2d_overhead_s"] == "s" and units["host_update_seconds_per_tensor"] == "s/tensor"
    data = json.loads(out.read_text())
    opts = TrinityOptions.from_user({"calibration": str(out), "h2d_bytes_per_s": 1e9}, env={})
    spec = apply_overrides(KNOWN_DEVICES["a100-80gb"], opts)
    assert spec.flops_fp32 == data["flops_fp32"]
    assert spec.hbm_bytes_per_s == data["hbm_bytes_per_s"]
    assert spec.d2h_bytes_per_s == data["d2h_bytes_per_s"]
    assert spec.h2d_bytes_per_s == 1e9  # an explicit option wins over the calibration
    assert "calibrated" in spec.source


def test_bad_calibration_files_are_rejected(tmp_path):
    missing = tmp_path / "missing.json"
    with pytest.raises(ValueError, match="cannot be read"):
        load_calibration(missing)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        load_calibration(bad)
    neg = tmp_path / "neg.json"
    neg.write_text(json.dumps({"flops_fp32": -1}))
    with pytest.raises(ValueError, match="flops_fp32 = -1 is not a positive finite number"):
        load_calibration(neg)
    inf = tmp_path / "inf.json"
    inf.write_text('{"h2d_overhead_s": Infinity}')  # Python's json writes and reads it
    with pytest.raises(ValueError, match="h2d_overhead_s = inf is not a positive finite number"):
        load_calibration(inf)
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    with pytest.raises(ValueError, match="holds none of"):
        load_calibration(empty)
    with pytest.raises(ValueError, match="'calibration'"):
        TrinityOptions.from_user({"calibration": str(neg)}, env={})


def test_per_thread_figures_reach_the_cost_model(tmp_path):
    """calibrate writes the update's throughput and the bandwidth per thread count; the file's
    tables reach the DeviceSpec (JSON's string keys as ints) and an optimizer's thread count picks
    its figure. Before, load_calibration dropped them and every prediction took the all-threads
    figure."""
    path = tmp_path / "calib.json"
    path.write_text(
        json.dumps(
            {
                "host_bytes_per_s": 2e10,
                "host_update_seconds_per_param": 1 / 3e8,
                "host_update_params_per_s": {"fused": {"1": 1e8, "2": 3e8}, "loop": {"1": 2e7, "2": 4e7}},
                "host_bytes_per_s_by_threads": {"1": 1.2e10, "2": 2e10},
            }
        )
    )
    figures = load_calibration(path)
    assert figures["host_update_params_per_s_by_threads"] == (
        ("fused", 1, 1e8),
        ("fused", 2, 3e8),
        ("loop", 1, 2e7),
        ("loop", 2, 4e7),
    )
    assert figures["host_bytes_per_s_by_threads"] == ((1, 1.2e10), (2, 2e10))
    opts = TrinityOptions.from_user({"calibration": str(path)}, env={})
    spec = apply_overrides(KNOWN_DEVICES["a100-80gb"], opts)
    assert spec.host_update_s_per_param("fused", 1) == pytest.approx(1e-8, rel=1e-12)
    assert spec.host_update_s_per_param("fused", 8) == pytest.approx(1 / 3e8, rel=1e-12)
    assert spec.host_update_s_per_param("loop", 1) == pytest.approx(5e-8, rel=1e-12)


@pytest.mark.parametrize(
    "table, message",
    [
        ({"host_update_params_per_s": {"foreach": {"1": 1e8}}}, r"must map 'fused' and/or 'loop'.*\['foreach'\]"),
        (
            {"host_update_params_per_s": {"fused": {"0": 1e8}}},
            r"host_update_params_per_s\['fused'\] has thread count '0'",
        ),
        ({"host_update_params_per_s": {"fused": {"two": 1e8}}}, "has thread count 'two', not an int >= 1"),
        ({"host_bytes_per_s_by_threads": {"1": -5}}, r"host_bytes_per_s_by_threads\['1'\] = -5 is not a positive"),
        ({"host_bytes_per_s_by_threads": []}, "host_bytes_per_s_by_threads must be a non-empty object"),
    ],
)
def test_bad_per_thread_tables_are_rejected(tmp_path, table, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"host_bytes_per_s": 1e10, **table}))
    with pytest.raises(ValueError, match=message):
        load_calibration(path)
