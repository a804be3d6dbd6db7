"""TrinityOptions: accepted forms, sizes, budgets, environment variables, errors, round trips.

Every expected value here is written out by hand (12 GiB is 12 * 2**30 bytes, "50%" is the
fraction 0.5), never recomputed through the module under test.
"""

import dataclasses
import decimal
import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload_compiler.options import MemoryBudget, TrinityOptions, format_bytes, parse_size

ALLOWED = sorted(f.name for f in dataclasses.fields(TrinityOptions))

EXPECTED_ALLOWED = sorted(
    [
        "memory_budget",
        "inner",
        "dump_dir",
        "verify",
        "on_infeasible",
        "on_host_pool_full",
        "min_offload_bytes",
        "budget_reserve_bytes",
        "host_pool_limit_bytes",
        "device",
        "calibration",
        "fault_injection",
        "offload",
        "num_streams",
        "runtime_check",
        "strategy",
        "op_times",
        "interconnect",
        "solver_time_limit",
        "peak_flops",
        "hbm_bytes_per_s",
        "h2d_bytes_per_s",
        "d2h_bytes_per_s",
        "host_bytes_per_s",
        "optimizer_on_device",
        "device_memory_bytes",
        "inductor_config",
    ]
)


def build(options=None, env=None):
    """``from_user`` isolated from this process's environment unless ``env`` is given."""
    return TrinityOptions.from_user(options, env={} if env is None else env)


def assert_round_trips(opts: TrinityOptions) -> None:
    d = opts.to_dict()
    json.dumps(d)  # "JSON-friendly"
    assert set(d) == set(EXPECTED_ALLOWED)
    assert build(d) == opts, f"{d} does not round-trip"


# ---------------------------------------------------------------------------------- defaults


def test_the_option_names_are_the_documented_ones():
    assert ALLOWED == EXPECTED_ALLOWED


def test_defaults():
    opts = build()
    assert opts == TrinityOptions()
    assert opts.memory_budget == MemoryBudget("auto")
    assert opts.inner == "inductor"
    assert opts.dump_dir is None
    assert opts.verify is True
    assert opts.on_infeasible == "error"
    assert opts.min_offload_bytes == 2**20
    assert opts.budget_reserve_bytes == 2**30
    assert opts.host_pool_limit_bytes is None
    assert opts.device is None
    assert opts.peak_flops is None
    assert opts.hbm_bytes_per_s is None
    assert opts.h2d_bytes_per_s is None
    assert opts.d2h_bytes_per_s is None
    assert opts.host_bytes_per_s is None
    assert opts.optimizer_on_device == 0.0
    assert opts.device_memory_bytes is None
    assert opts.inductor_config == ()
    assert opts.strategy == "auto"
    assert opts.op_times == "roofline"
    assert build(None) == opts
    assert_round_trips(opts)


def test_an_options_object_passes_through_unchanged():
    opts = build({"inner": "eager"})
    assert TrinityOptions.from_user(opts) is opts


# ---------------------------------------------------------------------------------- sizes

SIZES = [
    (0, 0),
    (4096, 4096),
    (12.0, 12),
    ("4096", 4096),
    ("12GiB", 12 * 2**30),
    ("12gib", 12 * 2**30),
    ("800MB", 800 * 10**6),
    ("1.5GB", 1_500_000_000),
    ("1.5 gb", 1_500_000_000),
    (" 3 KiB ", 3 * 1024),
    ("2k", 2048),
    ("2M", 2 * 2**20),
    ("1G", 2**30),
    ("1T", 2**40),
    ("1TB", 10**12),
    ("1TiB", 2**40),
    ("0.5KiB", 512),
    (".5MiB", 2**19),
    ("7B", 7),
    ("10kb", 10_000),
    ("1e3", 1000),  # scientific notation, as the float 1e3 is accepted
    ("1E9", 10**9),
    ("2.5e3MB", 2_500_000_000),
    (".5e1KiB", 5 * 1024),
]


@pytest.mark.parametrize("text,expected", SIZES)
def test_parse_size(text, expected):
    got = parse_size("min_offload_bytes", text)
    assert got == expected
    assert type(got) is int


@pytest.mark.parametrize("text,expected", SIZES)
def test_size_options_accept_every_size_form(text, expected):
    opts = build(
        {
            "min_offload_bytes": text,
            "budget_reserve_bytes": text,
            "memory_budget": text if expected else None,  # (0 bytes: refused, test below)
        }
    )
    assert opts.min_offload_bytes == expected
    assert opts.budget_reserve_bytes == expected
    assert opts.memory_budget == (MemoryBudget("bytes", float(expected)) if expected else MemoryBudget("none"))
    assert_round_trips(opts)


@pytest.mark.parametrize(
    "bad",
    [
        "12 GiBs",
        "GiB",
        "1.2.3GB",
        "-5MB",
        "5 M B",
        "",
        "  ",
        "1.5e-1",
        "5e",
        "1eB",
        "abc",
        "12 parsecs",
        -1,
        1.5,
        -2.0,
        float("nan"),
        float("inf"),
        True,
        False,
        None,
        [1],
        {"a": 1},
    ],
)
def test_malformed_sizes_are_rejected_naming_key_and_value(bad):
    with pytest.raises(ValueError) as info:
        build({"min_offload_bytes": bad})
    msg = str(info.value)
    assert "'min_offload_bytes'" in msg
    assert repr(bad) in msg


@pytest.mark.parametrize("key", ["host_pool_limit_bytes", "device_memory_bytes"])
def test_positive_sizes(key):
    assert getattr(build({key: "2GB"}), key) == 2 * 10**9
    assert getattr(build({key: 1}), key) == 1
    assert getattr(build({key: None}), key) is None
    for bad in (0, "0MB", -1, "lots"):
        with pytest.raises(ValueError, match=key):
            build({key: bad})


def test_format_bytes():
    assert format_bytes(None) == "no limit"
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1024) == "1.00 KiB"
    assert format_bytes(1536 * 2**20) == "1.50 GiB"
    assert format_bytes(3 * 2**40) == "3.00 TiB"
    assert format_bytes(5000 * 2**40) == "5000.00 TiB"


# ---------------------------------------------------------------------------------- memory budget


@pytest.mark.parametrize(
    "value,expected",
    [
        ("50%", MemoryBudget("fraction", 0.5)),
        ("100%", MemoryBudget("fraction", 1.0)),
        ("12.5%", MemoryBudget("fraction", 0.125)),
        (" 25 % ", MemoryBudget("fraction", 0.25)),
        ("auto", MemoryBudget("auto")),
        ("AUTO", MemoryBudget("auto")),
        (None, MemoryBudget("none")),
        ("none", MemoryBudget("none")),
        ("unlimited", MemoryBudget("none")),
        ("inf", MemoryBudget("none")),
        (1024, MemoryBudget("bytes", 1024.0)),
        ("12GiB", MemoryBudget("bytes", float(12 * 2**30))),
        (MemoryBudget("fraction", 0.3), MemoryBudget("fraction", 0.3)),
    ],
)
def test_memory_budget_forms(value, expected):
    assert MemoryBudget.parse(value) == expected
    opts = build({"memory_budget": value})
    assert opts.memory_budget == expected
    assert_round_trips(opts)


def test_memory_budget_to_dict_forms():
    assert build({"memory_budget": "12GiB"}).to_dict()["memory_budget"] == 12 * 2**30
    assert build({"memory_budget": "50%"}).to_dict()["memory_budget"] == "50%"
    assert build({"memory_budget": "auto"}).to_dict()["memory_budget"] == "auto"
    assert build({"memory_budget": None}).to_dict()["memory_budget"] is None


@pytest.mark.parametrize("pct", ["33.3333333%", "12.3456789%", "0.1234567%", "99.999999%"])
def test_fractional_percentages_round_trip_exactly(pct):
    """to_dict() must write a fraction so that from_user() reads back the same budget. The
    fraction is the percentage divided by 100 in decimal, then rounded once to a float."""
    opts = build({"memory_budget": pct})
    with decimal.localcontext(decimal.Context(prec=100)):
        expected = float(decimal.Decimal(pct[:-1]) / 100)
    assert opts.memory_budget == MemoryBudget("fraction", expected)
    assert_round_trips(opts)


@pytest.mark.parametrize("bad", ["0%", "150%", "100.5%", "-10%", "nan%", "inf%"])
def test_bad_percentages(bad):
    with pytest.raises(ValueError) as info:
        build({"memory_budget": bad})
    msg = str(info.value)
    assert "'memory_budget'" in msg and repr(bad) in msg
    assert "(0%, 100%]" in msg


@pytest.mark.parametrize("bad, before", [("abc%", "abc"), ("%", ""), ("50%%", "50%"), ("5 0%", "5 0")])
def test_malformed_percentages_say_what_is_not_a_number(bad, before):
    """A fresh-user trial: '50%%' was refused as out of range ('must be in (0%, 100%]')."""
    with pytest.raises(ValueError) as info:
        build({"memory_budget": bad})
    msg = str(info.value)
    assert "'memory_budget'" in msg and repr(bad) in msg
    assert f"{before!r} before the '%' is not a number" in msg and "such as '50%'" in msg


def test_a_bad_environment_boolean_says_which_strings_are_allowed():
    with pytest.raises(ValueError, match=r"'TRINITY_VERIFY': got 'maybe'.*1, true, yes or on; 0, false, no or off"):
        build(env={"TRINITY_VERIFY": "maybe"})


@pytest.mark.parametrize("bad", ["lots", "12 parsecs", -1, 0.5, True, [1], pytest.param(10**400, id="10**400")])
def test_bad_memory_budgets(bad):
    with pytest.raises(ValueError) as info:
        build({"memory_budget": bad})
    assert "'memory_budget'" in str(info.value)


@pytest.mark.parametrize("bad", [-1, -0.5, "-1", "-5GiB", " -2e3 "])
def test_negative_memory_budget_says_it_cannot_be_negative(bad):
    with pytest.raises(ValueError) as info:
        build({"memory_budget": bad})
    msg = str(info.value)
    assert "'memory_budget'" in msg and repr(bad) in msg and "cannot be negative" in msg and "None" in msg


@pytest.mark.parametrize("zero", [0, 0.0, "0", "0GiB", "0 MB"])
def test_zero_memory_budget_is_refused_with_the_options(zero):
    """A fresh-user trial: memory_budget=0 was accepted and refused only at the compile."""
    with pytest.raises(ValueError) as info:
        build({"memory_budget": zero})
    msg = str(info.value)
    assert "'memory_budget'" in msg and repr(zero) in msg and "0 bytes cannot be met" in msg and "None" in msg


def test_fractional_memory_budget_suggests_the_percentage():
    with pytest.raises(ValueError) as info:
        build({"memory_budget": 0.5})
    assert "'memory_budget'" in str(info.value) and "'50%'" in str(info.value)
    with pytest.raises(ValueError) as info:
        build({"memory_budget": 1.5})  # not a fraction: no percentage suggested
    assert "%'" not in str(info.value).split("None (no limit)")[-1]
    # The string too (a fresh-user trial: '0.5' got no hint where 0.5 did).
    with pytest.raises(ValueError) as info:
        build({"memory_budget": "0.5"})
    assert "got '0.5'" in str(info.value) and "(a fraction is written as a percentage: '50%')" in str(info.value)


@pytest.mark.parametrize("bad", [-1, "-1", " -4KiB"])
def test_negative_min_offload_bytes_says_sizes_are_not_negative(bad):
    with pytest.raises(ValueError) as info:
        build({"min_offload_bytes": bad})
    msg = str(info.value)
    assert "'min_offload_bytes'" in msg and repr(bad) in msg and "must be >= 0 bytes" in msg


def test_memory_budget_describe():
    assert MemoryBudget("bytes", 2**30).describe() == f"1.00 GiB ({2**30} bytes)"
    # memory_budget=50 (or "50") is 50 bytes: the messages that name it say how 50% is written.
    assert build({"memory_budget": "50"}).memory_budget == MemoryBudget("bytes", 50.0)
    assert MemoryBudget("bytes", 50).describe() == "50 B (50 bytes; a percentage is written with '%': '50%')"
    assert MemoryBudget("bytes", 101).describe() == "101 B (101 bytes)"
    assert MemoryBudget("fraction", 0.5).describe() == "50% of the unplanned peak"
    assert MemoryBudget("auto").describe() == "auto"
    assert MemoryBudget("none").describe() == "none"


# ---------------------------------------------------------------------------------- other options


def test_every_option_in_its_allowed_forms_round_trips(tmp_path):
    cases = [
        {"inner": "eager"},
        {"inner": "inductor"},
        {"dump_dir": str(tmp_path)},
        {"dump_dir": tmp_path},
        {"dump_dir": None},
        {"verify": False},
        {"verify": True},
        {"on_infeasible": "warn"},
        {"on_infeasible": "error"},
        {"device": "h100-sxm"},
        {"device": "NVIDIA A100-SXM4-40GB"},
        {"device": None},
        {"peak_flops": 1e12},
        {"peak_flops": 10**12},
        {"peak_flops": "1e12"},
        {"hbm_bytes_per_s": 2e12},
        {"h2d_bytes_per_s": 25e9},
        {"d2h_bytes_per_s": "2.5e10"},
        {"device_memory_bytes": "80GiB"},
        {"host_pool_limit_bytes": "8GiB"},
        {"inductor_config": {"max_autotune": True, "debug": False}},
        {"inductor_config": (("debug", False),)},
        {"inductor_config": {}},
        {"offload": "activations"},
        {"offload": "activations+params", "inner": "eager"},
        {"offload": "all", "inner": "eager"},
        {"num_streams": 1},
        {"num_streams": 4},
    ]
    for options in cases:
        opts = build(options)
        assert_round_trips(opts)
    assert build({"dump_dir": str(tmp_path)}).dump_dir == tmp_path
    assert build({"dump_dir": tmp_path}).to_dict()["dump_dir"] == str(tmp_path)
    assert build({"peak_flops": "1e12"}).peak_flops == 1e12
    assert type(build({"peak_flops": 10**12}).peak_flops) is float
    assert build({"d2h_bytes_per_s": "2.5e10"}).d2h_bytes_per_s == 25e9
    assert build({"device_memory_bytes": "80GiB"}).device_memory_bytes == 80 * 2**30
    cfg = build({"inductor_config": {"max_autotune": True, "debug": False}})
    assert cfg.inductor_config == (("debug", False), ("max_autotune", True))
    assert cfg.to_dict()["inductor_config"] == {"debug": False, "max_autotune": True}


def test_a_full_options_dict_round_trips(tmp_path):
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"flops_fp32": 1e12, "h2d_bytes_per_s": 2e10}))
    options = {
        "memory_budget": "6GiB",
        "inner": "eager",
        "dump_dir": str(tmp_path),
        "verify": False,
        "on_infeasible": "warn",
        "min_offload_bytes": "64KiB",
        "budget_reserve_bytes": "512MiB",
        "host_pool_limit_bytes": "32GB",
        "on_host_pool_full": "error",
        "device": "a100-80gb",
        "peak_flops": 3e14,
        "hbm_bytes_per_s": 2e12,
        "h2d_bytes_per_s": 2.5e10,
        "d2h_bytes_per_s": 2.4e10,
        "device_memory_bytes": "80GiB",
        "inductor_config": {"max_autotune": False},
        "calibration": str(calibration),
        "fault_injection": 7,
        "offload": "all",
        "num_streams": 3,
        "runtime_check": "measure",
        "host_bytes_per_s": 6e10,
        "optimizer_on_device": "auto",
        "strategy": "offload",
        "op_times": "roofline",
        "interconnect": "ib-200g",
        "solver_time_limit": 4,
    }
    opts = build(options)
    assert opts.to_dict() == {
        "memory_budget": 6 * 2**30,
        "inner": "eager",
        "dump_dir": str(tmp_path),
        "verify": False,
        "on_infeasible": "warn",
        "min_offload_bytes": 64 * 1024,
        "budget_reserve_bytes": 512 * 2**20,
        "host_pool_limit_bytes": 32 * 10**9,
        "on_host_pool_full": "error",
        "device": "a100-80gb",
        "peak_flops": 3e14,
        "hbm_bytes_per_s": 2e12,
        "h2d_bytes_per_s": 2.5e10,
        "d2h_bytes_per_s": 2.4e10,
        "device_memory_bytes": 80 * 2**30,
        "inductor_config": {"max_autotune": False},
        "calibration": str(calibration),
        "fault_injection": 7,
        "offload": "all",
        "num_streams": 3,
        "runtime_check": "measure",
        "host_bytes_per_s": 6e10,
        "optimizer_on_device": "auto",
        "strategy": "offload",
        "op_times": "roofline",
        "interconnect": "ib-200g",
        "solver_time_limit": 4.0,
    }
    assert_round_trips(opts)


def test_num_streams_default_forms_and_errors():
    assert build().num_streams is None and build({"num_streams": None}).num_streams is None
    assert build({"num_streams": 1}).num_streams == 1
    assert build(env={"TRINITY_NUM_STREAMS": "3"}).num_streams == 3
    assert build({"num_streams": 2}, env={"TRINITY_NUM_STREAMS": "3"}).num_streams == 2
    for bad in (0, -1, 1.5, 2.0, True, "two", "0"):
        with pytest.raises(ValueError) as info:
            build({"num_streams": bad})
        assert "'num_streams'" in str(info.value) and repr(bad) in str(info.value)
        assert "int >= 1" in str(info.value)
    with pytest.raises(ValueError, match="TRINITY_NUM_STREAMS"):
        build(env={"TRINITY_NUM_STREAMS": "x"})


def test_options_are_frozen():
    opts = build()
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.inner = "eager"


# ---------------------------------------------------------------------------------- errors


def test_unknown_key_names_it_and_lists_the_allowed_ones():
    with pytest.raises(ValueError) as info:
        build({"memory_budgett": "50%"})
    msg = str(info.value)
    assert "'memory_budgett'" in msg
    for name in EXPECTED_ALLOWED:
        assert name in msg


def test_non_string_key_is_rejected():
    with pytest.raises(ValueError, match="allowed options"):
        build({3: "x"})


def test_options_must_be_a_mapping():
    with pytest.raises(ValueError, match="dict"):
        build([("inner", "eager")])
    with pytest.raises(ValueError, match="dict"):
        build("inner=eager")


@pytest.mark.parametrize(
    "key,bad",
    [
        ("inner", "aot_eager"),
        ("inner", "Eager"),
        ("inner", 1),
        ("inner", None),
        ("on_infeasible", "ignore"),
        ("on_infeasible", True),
        ("on_infeasible", None),
        ("on_host_pool_full", "raise"),
        ("on_host_pool_full", None),
        ("offload", "params"),
        ("offload", "All"),
        ("offload", None),
        ("verify", "yes"),
        ("verify", 1),
        ("verify", None),
        ("dump_dir", ""),
        ("dump_dir", 5),
        ("dump_dir", True),
        ("device", "tpu-v9"),
        ("device", ""),
        ("device", 100),
        ("peak_flops", 0),
        ("peak_flops", -1e12),
        ("peak_flops", "fast"),
        ("peak_flops", True),
        ("peak_flops", float("nan")),
        ("peak_flops", float("inf")),
        ("peak_flops", "inf"),
        pytest.param("peak_flops", 10**400, id="peak_flops-10**400"),
        ("hbm_bytes_per_s", [1]),
        ("h2d_bytes_per_s", "0"),
        ("d2h_bytes_per_s", -5),
        ("inductor_config", "max_autotune=True"),
        ("inductor_config", 3),
        ("inductor_config", (("max_autotune",),)),
    ],
)
def test_wrong_values_raise_naming_the_key(key, bad):
    with pytest.raises(ValueError) as info:
        build({key: bad})
    assert repr(key) in str(info.value)


def test_a_device_name_that_is_not_a_table_key_says_which_entry_it_became():
    with pytest.warns(UserWarning, match=r"device='a100' .* figures of 'a100-80gb'"):
        assert build({"device": "a100"}).device == "a100"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert build({"device": "a100-40gb"}).device == "a100-40gb"  # a key: no warning


def test_bad_device_lists_the_known_devices():
    with pytest.raises(ValueError) as info:
        build({"device": "tpu-v9"})
    msg = str(info.value)
    assert "'tpu-v9'" in msg
    for key in ("h100-sxm", "a100-40gb", "rtx4090", "cpu"):
        assert key in msg


def test_unknown_inductor_setting_is_named():
    with pytest.raises(ValueError) as info:
        build({"inductor_config": {"max_autotune": True, "not_a_real_setting": 1}})
    msg = str(info.value)
    assert "'inductor_config'" in msg and "'not_a_real_setting'" in msg


# ---------------------------------------------------------------------------------- environment


def test_environment_variables(tmp_path):
    env = {
        "TRINITY_MEMORY_BUDGET": "12GiB",
        "TRINITY_INNER": "eager",
        "TRINITY_DUMP_DIR": str(tmp_path),
        "TRINITY_VERIFY": "0",
        "TRINITY_ON_INFEASIBLE": "warn",
        "TRINITY_MIN_OFFLOAD_BYTES": "4MiB",
        "TRINITY_BUDGET_RESERVE_BYTES": "100MB",
        "TRINITY_HOST_POOL_LIMIT_BYTES": "2GB",
        "TRINITY_DEVICE": "h100-pcie",
        "TRINITY_PEAK_FLOPS": "1e12",
        "TRINITY_HBM_BYTES_PER_S": "2e12",
        "TRINITY_H2D_BYTES_PER_S": "25e9",
        "TRINITY_D2H_BYTES_PER_S": "24e9",
        "TRINITY_DEVICE_MEMORY_BYTES": "80GiB",
        "TRINITY_INDUCTOR_CONFIG": '{"max_autotune": true}',
        "UNRELATED": "x",
    }
    opts = build(env=env)
    assert opts.memory_budget == MemoryBudget("bytes", float(12 * 2**30))
    assert opts.inner == "eager"
    assert opts.dump_dir == tmp_path
    assert opts.verify is False
    assert opts.on_infeasible == "warn"
    assert opts.min_offload_bytes == 4 * 2**20
    assert opts.budget_reserve_bytes == 100 * 10**6
    assert opts.host_pool_limit_bytes == 2 * 10**9
    assert opts.device == "h100-pcie"
    assert opts.peak_flops == 1e12
    assert opts.hbm_bytes_per_s == 2e12
    assert opts.h2d_bytes_per_s == 25e9
    assert opts.d2h_bytes_per_s == 24e9
    assert opts.device_memory_bytes == 80 * 2**30
    assert opts.inductor_config == (("max_autotune", True),)
    assert_round_trips(opts)


def test_explicit_options_win_over_the_environment():
    env = {"TRINITY_MEMORY_BUDGET": "12GiB", "TRINITY_INNER": "eager", "TRINITY_VERIFY": "false"}
    opts = build({"memory_budget": "50%", "verify": True}, env=env)
    assert opts.memory_budget == MemoryBudget("fraction", 0.5)
    assert opts.verify is True
    assert opts.inner == "eager"  # not given explicitly: from the environment


def test_explicit_none_wins_over_the_environment():
    env = {"TRINITY_MEMORY_BUDGET": "12GiB", "TRINITY_DEVICE": "l4"}
    opts = build({"memory_budget": None, "device": None}, env=env)
    assert opts.memory_budget == MemoryBudget("none")
    assert opts.device is None


def test_empty_environment_values_are_ignored():
    assert build(env={"TRINITY_INNER": "", "TRINITY_MEMORY_BUDGET": ""}) == TrinityOptions()


@pytest.mark.parametrize(
    "text,expected",
    [
        ("1", True),
        ("true", True),
        ("YES", True),
        ("on", True),
        ("0", False),
        ("False", False),
        ("no", False),
        (" off ", False),
    ],
)
def test_verify_from_environment(text, expected):
    assert build(env={"TRINITY_VERIFY": text}).verify is expected


@pytest.mark.parametrize(
    "var,text",
    [
        ("TRINITY_VERIFY", "maybe"),
        ("TRINITY_INNER", "aot_eager"),
        ("TRINITY_MEMORY_BUDGET", "150%"),
        ("TRINITY_MIN_OFFLOAD_BYTES", "lots"),
        ("TRINITY_PEAK_FLOPS", "fast"),
        ("TRINITY_DEVICE", "tpu-v9"),
        ("TRINITY_INDUCTOR_CONFIG", "not json"),
        ("TRINITY_INDUCTOR_CONFIG", '{"not_a_real_setting": 1}'),
    ],
)
def test_bad_environment_values_name_the_variable(var, text):
    with pytest.raises(ValueError) as info:
        build(env={var: text})
    assert var in str(info.value)


def test_process_environment_is_the_default(monkeypatch):
    monkeypatch.setenv("TRINITY_INNER", "eager")
    monkeypatch.setenv("TRINITY_MEMORY_BUDGET", "25%")
    opts = TrinityOptions.from_user({})
    assert opts.inner == "eager"
    assert opts.memory_budget == MemoryBudget("fraction", 0.25)
    # An explicit env mapping replaces os.environ entirely.
    assert TrinityOptions.from_user({}, env={}).inner == "inductor"


# ---------------------------------------------------------------------------------- fuzz

_JUNK_KEYS = st.text(max_size=12).filter(lambda k: k not in EXPECTED_ALLOWED)
_VALUES = st.one_of(
    st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.none(),
    st.booleans(),
    st.sampled_from(
        [
            "50%",
            "1.5GB",
            "12GiB",
            "800MB",
            "auto",
            "none",
            "eager",
            "inductor",
            "warn",
            "error",
            "h100-sxm",
            "NVIDIA GeForce RTX 4090",
            "1e12",
            "0",
            "0%",
            "150%",
            "abc%",
            "/tmp/trinity",
        ]
    ),
    st.floats(min_value=1e-3, max_value=100.0).map(lambda f: f"{f}%"),
)
_KEYS = st.one_of(st.sampled_from(EXPECTED_ALLOWED), st.sampled_from(EXPECTED_ALLOWED), _JUNK_KEYS, st.integers(0, 3))
_OPTION_DICTS = st.dictionaries(_KEYS, _VALUES, max_size=6)


def _fails_alone(key, value) -> bool:
    try:
        build({key: value})
    except ValueError:
        return True
    return False


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_OPTION_DICTS)
def test_fuzz_options_either_round_trip_or_name_the_offending_key(options):
    offending = [k for k, v in options.items() if _fails_alone(k, v)]
    try:
        opts = build(options)
    except ValueError as exc:
        msg = str(exc)
        assert offending, f"{options} raised {msg!r} though every key is valid on its own"
        assert any(repr(k) in msg for k in offending), f"{msg!r} names none of {offending}"
        return
    assert not offending, f"{options} was accepted though {offending} are rejected on their own"
    for key, value in options.items():
        assert getattr(opts, key) is not None or value is None or key == "memory_budget"
    assert_round_trips(opts)
    # Every float field holds a finite positive number or None.
    for name in ("peak_flops", "hbm_bytes_per_s", "h2d_bytes_per_s", "d2h_bytes_per_s"):
        v = getattr(opts, name)
        assert v is None or (isinstance(v, float) and math.isfinite(v) and v > 0)
    for name in ("min_offload_bytes", "budget_reserve_bytes"):
        v = getattr(opts, name)
        assert type(v) is int and v >= 0
    assert isinstance(opts.dump_dir, (Path, type(None)))


def test_num_streams_default_two_where_the_stream_pass_runs():
    assert build().num_streams is None
    assert build({"inner": "eager"}).compute_streams == 2
    assert build({"inner": "inductor"}).compute_streams == 1  # Inductor: one compute stream, no warning
    assert build({"inner": "eager", "offload": "all"}).compute_streams == 1  # not combined yet
    assert build({"inner": "inductor", "num_streams": 3}).compute_streams == 3  # explicit: warned later
    assert build({"inner": "eager", "num_streams": 1}).compute_streams == 1
    assert build(env={"TRINITY_NUM_STREAMS": "3"}).num_streams == 3


def test_parameter_offload_with_inductor_is_refused_up_front():
    with pytest.raises(ValueError, match=r"'offload': 'all' needs inner='eager'.*inner='inductor'"):
        build({"offload": "all"})  # inner defaults to "inductor"
    assert build({"offload": "all", "inner": "eager"}).offload == "all"


@pytest.mark.parametrize("value, expected", [("auto", "auto"), (0.25, 0.25), ("0.5", 0.5), (1, 1.0), (0.0, 0.0)])
def test_optimizer_on_device_values(value, expected):
    opts = build({"offload": "all", "inner": "eager", "optimizer_on_device": value})
    assert opts.optimizer_on_device == expected
    assert_round_trips(opts)


@pytest.mark.parametrize("value", [1.5, -0.1, "half", True, None, [0.5]])
def test_optimizer_on_device_bad_values_name_the_allowed_ones(value):
    with pytest.raises(ValueError, match=r"'optimizer_on_device': got .*expected 'auto' or a number from 0.0 to 1.0"):
        build({"offload": "all", "inner": "eager", "optimizer_on_device": value})


def test_optimizer_on_device_needs_offload_all():
    with pytest.raises(ValueError, match=r"'optimizer_on_device': 0.5 needs offload='all'.*offload='activations'"):
        build({"optimizer_on_device": 0.5})
    assert build({"optimizer_on_device": 0.0}).optimizer_on_device == 0.0
    env = build({"offload": "all", "inner": "eager"}, env={"TRINITY_OPTIMIZER_ON_DEVICE": "auto"})
    assert env.optimizer_on_device == "auto"


def test_op_times_forms_and_errors():
    assert build({"op_times": "measured"}).op_times == "measured"
    assert build(env={"TRINITY_OP_TIMES": "measured"}).op_times == "measured"
    assert_round_trips(build({"op_times": "measured"}))
    for bad in ("profile", "", None, 1, True):
        with pytest.raises(ValueError, match=r"'op_times'.*'roofline' or 'measured'") as info:
            build({"op_times": bad})
        assert repr(bad) in str(info.value)
    # Measured times are this machine's: they cannot stand for a table device's.
    with pytest.raises(
        ValueError,
        match=r"cannot plan for the table device 'h100-sxm'.*\(op_times from options; device from TRINITY_DEVICE\)",
    ):
        build({"op_times": "measured"}, env={"TRINITY_DEVICE": "h100-sxm"})
    # The host CPU's entry is this machine (where the graph runs on the CPU): allowed.
    assert build({"op_times": "measured", "device": "cpu"}).device == "cpu"


def test_solver_time_limit_forms_and_errors(monkeypatch):
    from offload_compiler.passes import plan_recompute

    assert build().solver_time_limit == plan_recompute.SOLVER_TIME_LIMIT_S == 0.5
    assert build({"solver_time_limit": 5}).solver_time_limit == 5.0
    assert build(env={"TRINITY_SOLVER_TIME_LIMIT": "2.5"}).solver_time_limit == 2.5
    assert_round_trips(build({"solver_time_limit": 3}))
    for bad in (0, -1, "soon", True, float("inf"), 3601):
        with pytest.raises(ValueError, match=r"'solver_time_limit': got .*a number of seconds, > 0 and at most 3600"):
            build({"solver_time_limit": bad})


def test_interconnect_forms_and_errors(tmp_path):
    assert build().interconnect is None
    assert build({"interconnect": "nvlink"}).interconnect == "nvlink"
    assert build(env={"TRINITY_INTERCONNECT": "eth-25g"}).interconnect == "eth-25g"
    assert_round_trips(build({"interconnect": "pcie"}))
    link = tmp_path / "collectives.json"
    link.write_text('{"link": {"name": "loopback", "bytes_per_s": 1e9, "alpha_s": 2e-5}}')
    assert build({"interconnect": str(link)}).interconnect == str(link)
    for bad in ("infiniband", "", 3, True):
        with pytest.raises(ValueError, match=r"'interconnect'") as info:
            build({"interconnect": bad})
        assert repr(bad) in str(info.value) or "infiniband" in str(info.value)
    with pytest.raises(ValueError, match=r"'interconnect'.*cannot be read"):
        build({"interconnect": str(tmp_path / "missing.json")})


def test_runtime_check_forms_and_errors():
    assert build().runtime_check == "replan"
    for value in ("replan", "measure", "off"):
        assert build({"runtime_check": value}).runtime_check == value
        assert_round_trips(build({"runtime_check": value}))
    assert build(env={"TRINITY_RUNTIME_CHECK": "off"}).runtime_check == "off"
    for bad in ("on", True, None, "Replan"):
        with pytest.raises(ValueError, match=r"'runtime_check'.*'replan', 'measure', 'off'"):
            build({"runtime_check": bad})
    with pytest.raises(ValueError, match="TRINITY_RUNTIME_CHECK"):
        build(env={"TRINITY_RUNTIME_CHECK": "sometimes"})


def test_a_conflict_between_options_says_where_each_value_came_from():
    # Found by the environment fuzz test: TRINITY_OPTIMIZER_ON_DEVICE=1 alone was refused with a
    # message that named no variable (offload came from the default).
    with pytest.raises(
        ValueError,
        match=r"needs offload='all'.*\(optimizer_on_device from TRINITY_OPTIMIZER_ON_DEVICE; offload from the default\)",
    ):
        build(env={"TRINITY_OPTIMIZER_ON_DEVICE": "1"})
    with pytest.raises(ValueError, match=r"needs inner='eager'.*\(offload from TRINITY_OFFLOAD; inner from options\)"):
        build({"inner": "inductor"}, env={"TRINITY_OFFLOAD": "all"})
    with pytest.raises(
        ValueError, match=r"'recompute' is not combined.*\(strategy from options; offload from options\)"
    ):
        build({"strategy": "recompute", "offload": "all", "inner": "eager"})
