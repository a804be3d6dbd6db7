"""calibrate: measured figures, the JSON file, and the backend option that uses it."""

import json

import pytest

from offload_compiler.calibrate import (
    CALIBRATION_FIELDS,
    calibrate,
    last_level_cache_bytes,
    load_calibration,
    main,
    stream_bytes_per_s,
    stream_kernels_bytes_per_s,
    stream_numel,
)
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


def _fake_cache(root, cpu, index, level, kind, size, shared):
    d = root / f"cpu{cpu}" / "cache" / f"index{index}"
    d.mkdir(parents=True)
    for name, value in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
        (d / name).write_text(f"{value}\n")


def test_last_level_cache_is_summed_over_its_instances(tmp_path):
    """Two sockets of two cores: per core L1d 48K, L1i 32K, L2 2048K; one 32M L3 per socket
    (shared by cpus 0-1 and 2-3): 64 MiB, each L3 counted once."""
    for cpu in range(4):
        _fake_cache(tmp_path, cpu, 0, 1, "Data", "48K", cpu)
        _fake_cache(tmp_path, cpu, 1, 1, "Instruction", "32K", cpu)
        _fake_cache(tmp_path, cpu, 2, 2, "Unified", "2048K", cpu)
        _fake_cache(tmp_path, cpu, 3, 3, "Unified", "32M", "0-1" if cpu < 2 else "2-3")
    assert last_level_cache_bytes(tmp_path) == 64 * 2**20
    assert last_level_cache_bytes(tmp_path / "nothing") is None


def test_stream_arrays_are_four_times_the_last_level_cache():
    """STREAM's rule: each array at least 4 x the last-level caches (this machine's 260 MiB L3:
    1040 MiB per array; the probe before used 128 MiB arrays, half the L3); at least 128 MiB;
    at most an eighth of the available memory each."""
    assert stream_numel(260 * 2**20, 64 * 2**30) * 4 == 1040 * 2**20
    assert stream_numel(8 * 2**20, 64 * 2**30) == 1 << 25
    assert stream_numel(260 * 2**20, 4 * 2**30) * 4 == 512 * 2**20
    with pytest.raises(ValueError, match="llc_bytes must be positive, got 0"):
        stream_numel(0)


def test_stream_kernels_count_the_write_allocate(monkeypatch):
    """Bytes per fp32 element: copy and scale 12 (STREAM's 8 + the write-allocate read of the
    line stored), add and triad 16 (12 + 4), DAXPY 12 (in place: nothing to allocate). A clock
    that advances 0.5 s per reading makes every run 0.5 s long."""
    import itertools

    import offload_compiler.calibrate as cal

    clock = itertools.count(step=0.5)
    monkeypatch.setattr(cal, "_probe_clock", lambda: next(clock))
    got = stream_kernels_bytes_per_s(numel=1024, reps=2, num_threads=1)
    assert got == {"copy": 24576.0, "scale": 24576.0, "add": 32768.0, "triad": 32768.0, "daxpy": 24576.0}
    assert stream_bytes_per_s(numel=1024, reps=2, num_threads=1) == 32768.0
    with pytest.raises(ValueError, match="reps must be >= 1, got 0"):
        stream_kernels_bytes_per_s(numel=1024, reps=0)


def test_stream_kernels_measure_this_machine():
    """On this machine, 16 MiB arrays (in cache or not), one thread: every kernel's figure is a
    real bandwidth, between 0.1 GB/s and 10 TB/s."""
    got = stream_kernels_bytes_per_s(numel=1 << 22, reps=3, num_threads=1)
    assert set(got) == {"copy", "scale", "add", "triad", "daxpy"}
    for name, value in got.items():
        assert 1e8 < value < 1e13, name
