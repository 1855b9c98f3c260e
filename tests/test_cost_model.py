"""decoding.cost_model: the step-cost curve (interpolation, calibration, the per-machine cache)
and its use by the tree-sizing drafter."""
import json
import os

import pytest
import torch

from specdec_kernels.decoding import Generator, NgramTreeDrafter, SpecSchedule
from specdec_kernels.decoding import cost_model
from specdec_kernels.decoding.cost_model import StepCost, as_step_cost, calibrate, step_cost_for
from specdec_kernels.models import Llama, tiny_config


def test_step_cost_interpolates_rows_and_batches():
    c = StepCost({1: {1: 0.010, 4: 0.013, 16: 0.025}, 4: {4: 0.020, 16: 0.030}})
    assert c.seconds(1) == pytest.approx(0.010)
    assert c.seconds(2) == pytest.approx(0.011)  # linear between 1 and 4 rows
    assert c.seconds(10) == pytest.approx(0.019)
    assert c.seconds(32) == pytest.approx(0.041)  # the last segment extended
    assert c(4) == pytest.approx(1.3)  # relative to one row at batch 1
    assert c.seconds(16, batch=4) == pytest.approx(0.030)
    assert c.seconds(16, batch=8) == pytest.approx(0.030)  # past the largest batch: the nearest
    assert c.seconds(16, batch=2) == pytest.approx((2 * 0.025 + 0.030) / 3)  # linear in the batch
    assert c(16, 4) == pytest.approx(1.5)  # relative to 4 rows at batch 4
    # A falling last segment (noise) is not extrapolated downwards.
    assert StepCost({1: {1: 0.01, 2: 0.009}}).seconds(10) == pytest.approx(0.009)
    # Round trip through JSON.
    again = StepCost.from_json(json.loads(json.dumps(c.to_json())))
    assert again.seconds(10) == c.seconds(10) and again.seconds(7, 3) == c.seconds(7, 3)
    with pytest.raises(ValueError, match="positive seconds"):
        StepCost({1: {1: 0.0}})
    with pytest.raises(ValueError, match="at least one batch"):
        StepCost({})


def test_as_step_cost_accepts_tables_and_callables():
    table = as_step_cost([1.0, 1.1, 1.3])
    assert table(2) == 1.1 and table(5) == pytest.approx(1.7)  # + the last step per row
    assert as_step_cost(lambda r: 2.0 * r)(3, 4) == 6.0
    c = StepCost({1: {1: 1.0, 2: 2.0}})
    assert as_step_cost(c) is c


def test_calibration_times_real_forwards_and_is_cached_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cost_model, "_MEMO", {})
    monkeypatch.setattr(cost_model, "CALIBRATION_BUDGET_S", 600.0)  # every point, however loaded the machine
    model = Llama.random(tiny_config(num_layers=2), seed=0)
    calls = []
    real = cost_model._time_step
    monkeypatch.setattr(cost_model, "_time_step", lambda *a, **k: calls.append(a[1:3]) or real(*a, **k))
    cost = step_cost_for(model)
    assert calls == list(cost_model.CALIBRATION_POINTS)  # (batch, rows per request), all of them
    assert all(s > 0 for pts in cost.table.values() for _, s in pts)
    assert sorted(cost.table) == [1, 4] and [r for r, _ in cost.table[4]] == [4, 16, 64]
    assert [r for r, _ in cost.table[1]] == [1, 2, 4, 8, 16, 32, 64]
    assert cost.meta["threads"] == torch.get_num_threads() and cost.meta["cpu"] == cost_model.cpu_model()
    files = os.listdir(tmp_path / "cost")
    assert files == [cost_model.cost_key(model) + ".json"]
    assert model.name in files[0] and f"-t{torch.get_num_threads()}-" in files[0]
    # The same process: the memo; a new process (memo cleared): the file, no new measurement.
    n = len(calls)
    assert step_cost_for(model) is cost
    monkeypatch.setattr(cost_model, "_MEMO", {})
    again = step_cost_for(model)
    assert len(calls) == n and again.table == cost.table
    # A corrupt file is measured again.
    (tmp_path / "cost" / files[0]).write_text("{not json")
    monkeypatch.setattr(cost_model, "_MEMO", {})
    step_cost_for(model)
    assert len(calls) > n


def test_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECDEC_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cost_model.cache_dir() == os.path.join(str(tmp_path), "specdec_kernels", "cost")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cost_model.cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "specdec_kernels", "cost")


def test_calibration_stops_at_its_time_budget():
    model = Llama.random(tiny_config(num_layers=1), seed=0)
    # A spent budget still measures the minimum points: the curve keeps its shape.
    cost = calibrate(model, budget_s=0.0, repeats=1)
    assert {b: [r for r, _ in pts] for b, pts in cost.table.items()} == {1: [1, 4, 16, 64], 4: [4, 16]}
    cost = calibrate(model, budget_s=0.0, repeats=1, min_points=1)
    assert cost.table == {1: [(1, cost.seconds(1))]}


def test_drafter_uses_the_injected_or_generator_cost(monkeypatch):
    model = Llama.random(tiny_config(num_layers=2), seed=0)
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    monkeypatch.setattr(cost_model, "calibrate", lambda m, **k: pytest.fail("must not measure"))
    monkeypatch.setattr(cost_model, "_MEMO", {})
    ar = Generator(model).generate([prompt], 12)[0].output
    # Free rows: the drafter keeps its whole trie; steep rows: plain autoregressive steps.
    cheap = Generator(model, NgramTreeDrafter(step_cost=StepCost({1: {1: 1.0, 64: 1.0}})), SpecSchedule("max"))
    steep = Generator(model, NgramTreeDrafter(), SpecSchedule("max"))
    steep.step_cost = lambda rows: float(rows) * 2  # the Generator's cost, picked up at start
    out_cheap = cheap.generate([prompt], 12)[0]
    out_steep = steep.generate([prompt], 12)[0]
    assert out_cheap.output == ar and out_steep.output == ar
    assert sum(out_cheap.stats.drafted_per_pos) > 0
    assert sum(out_steep.stats.drafted_per_pos) == 0
    with pytest.raises(RuntimeError, match="no step cost"):
        NgramTreeDrafter().cost(2)
