"""The garbage-collector pause the passes run under (offload_compiler.passes.gc_pause)."""

import gc

import pytest

from offload_compiler.passes import liveness
from offload_compiler.passes.gc_pause import paused_gc


@pytest.fixture
def gc_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_pause_restores_nests_and_survives_errors(gc_on):
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner pause leaves the outer one in place
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="boom"):
        with paused_gc():
            raise RuntimeError("boom")
    assert gc.isenabled()


def test_pause_keeps_a_disabled_collector_disabled(gc_on):
    gc.disable()
    with paused_gc():
        pass
    assert not gc.isenabled()


def test_liveness_runs_paused_and_restores(gc_on, monkeypatch):
    from tests.graphs import mlp_pair

    seen = []
    real = liveness._analyze

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(liveness, "_analyze", spy)
    live = liveness.analyze(mlp_pair())
    assert seen == [False]
    assert gc.isenabled()
    assert live.peak_bytes > 0 and live.num_steps == len(live.steps)
