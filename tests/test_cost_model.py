"""decoding.cost_model: the step-cost curve (interpolation, calibration, the per-machine cache)
and its use by the tree-sizing drafter."""
import json
import os

import pytest
import torch

from specdec_kernels.decoding import Generator, SpecSchedule
from specdec_kernels.drafting.ngram import NgramTreeDrafter
from specdec_kernels.decoding import cost_model
from specdec_kernels.decoding.cost_model import (RelativeStepCost, StepCost, as_step_cost, best_chain_length,
                                                 best_node_count, calibrate, chain_payoffs, chain_tokens, payoff,
                                                 relative_cost, row_price, step_cost_for, tree_payoffs, with_seconds)
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


def test_a_curve_taken_in_place_is_seen_at_once():
    """A refresh puts the new table into the object every drafter holds (StepCost.take):
    the next query answers from it, not from what was worked out before (live refinements
    dropped unless kept)."""
    c = StepCost({1: {1: 1.0, 4: 2.0}})
    for _ in range(StepCost.LIVE_MIN):
        c.observe(2, 1, 2.0)
    assert c.seconds(2) == pytest.approx(2.0) and c(2) == pytest.approx(2.0)
    c.take(StepCost({1: {1: 0.5, 4: 0.5}}), keep_live=True)
    assert c.seconds(2) == pytest.approx(0.5 * 2.0 / (4 / 3))  # the new table, the live ratio kept
    c.take(StepCost({1: {1: 0.5, 4: 0.5}}))
    assert c.seconds(2) == 0.5 and c.live == {}


def test_live_steps_refine_the_curve():
    """Observed steps correct the table per row count once seen LIVE_MIN times: a three-row
    step observed at 1.5x a one-row one gives cost(3) = 1.5 where the table says 1.1; row
    counts not observed take the nearest observed ratio below them; the table and its JSON
    are unchanged."""
    c = StepCost({1: {1: 1.0, 4: 1.15}})
    assert c(3) == pytest.approx(1.1)
    for _ in range(StepCost.LIVE_MIN - 1):
        c.observe(1, 1, 1.2)
        c.observe(3, 1, 1.8)
    assert c(3) == pytest.approx(1.1) and c.seconds(1) == pytest.approx(1.0)  # not enough yet
    c.observe(1, 1, 1.2)
    c.observe(3, 1, 1.8)
    assert c.seconds(1) == pytest.approx(1.2) and c(3) == pytest.approx(1.5)
    assert c(2) == pytest.approx(1.05)  # no 2-row steps seen: the one-row ratio, the table's shape
    assert c(5) == pytest.approx(1.8 * (1.15 + 0.05) / 1.1 / 1.2)  # 3 rows' ratio carries up
    assert c(3, 2) == pytest.approx(1.1 / 1.05)  # batch 2: nothing observed for it, the table alone
    assert c.curve_seconds(3) == pytest.approx(1.1) and "live" not in json.dumps(c.to_json())
    for _ in range(40):  # newer observations outweigh older ones
        c.observe(3, 1, 1.32)
    assert c(3) == pytest.approx(1.1, rel=0.02)


def test_as_step_cost_accepts_tables_and_callables():
    table = as_step_cost([1.0, 1.1, 1.3])
    assert table(2) == 1.1 and table(5) == pytest.approx(1.7)  # + the last step per row
    assert as_step_cost(lambda r: 2.0 * r)(3, 4) == 6.0
    c = StepCost({1: {1: 1.0, 2: 2.0}})
    assert as_step_cost(c) is c


def fake_point(seconds_per_row=1e-3, noisy=()):
    """A stand-in for ``cost_model._time_point``: five repeats of a deterministic cost linear
    in the rows (``noisy``: (batch, rows per request) whose repeats disagree), and the calls."""
    calls = []

    def time_point(model, batch, r, context, repeats):
        calls.append((batch, r))
        t = seconds_per_row * (1 + 0.1 * (batch * r - 1))
        return [t, 5 * t, t, 9 * t, t / 3] if (batch, r) in noisy else [t] * 5

    return time_point, calls


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty per-user cost cache and memo."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cost_model, "_MEMO", {})
    return tmp_path / "cost"


def test_calibration_times_real_forwards(monkeypatch):
    monkeypatch.setattr(cost_model, "CALIBRATION_BUDGET_S", 600.0)  # every point, however loaded the machine
    model = Llama.random(tiny_config(num_layers=2), seed=0)
    calls = []
    real = cost_model._time_point
    monkeypatch.setattr(cost_model, "_time_point", lambda *a, **k: calls.append(a[1:3]) or real(*a, **k))
    lines = []
    cost = calibrate(model, progress=lines.append)
    # Every point once (a point the checks reject on this machine is measured once more).
    assert calls[: len(cost_model.CALIBRATION_POINTS)] == list(cost_model.CALIBRATION_POINTS)
    assert len(calls) <= 2 * len(cost_model.CALIBRATION_POINTS)
    assert all(s > 0 for pts in cost.table.values() for _, s in pts)
    assert sorted(cost.table) == [1, 4] and [r for r, _ in cost.table[4]] == [4, 16, 64]
    assert [r for r, _ in cost.table[1]] == [1, 2, 4, 8, 16, 32, 64]
    m = cost.meta
    assert m["threads"] == torch.get_num_threads() and m["cpu"] == cost_model.cpu_model() and m["measured"]
    assert m["noise"] >= 0 and m["created"].endswith("Z") and m["seconds"] > 0
    assert lines and "points in" in lines[-1]


def test_curve_is_cached_per_machine(cache, monkeypatch):
    fake, calls = fake_point()
    monkeypatch.setattr(cost_model, "_time_point", fake)
    model = Llama.random(tiny_config(num_layers=2), seed=0)
    cost = step_cost_for(model, progress=False)
    assert cost.meta["cached"] and "problems" not in cost.meta
    files = os.listdir(cache)
    assert files == [cost_model.cost_key(model) + ".json"]
    assert model.name in files[0] and f"-t{torch.get_num_threads()}-" in files[0]
    # The same process: the memo; a new process (memo cleared): the file, no new measurement.
    n = len(calls)
    assert step_cost_for(model) is cost
    monkeypatch.setattr(cost_model, "_MEMO", {})
    again = step_cost_for(model)
    assert len(calls) == n and again.table == cost.table
    # A corrupt file is measured again.
    (cache / files[0]).write_text("{not json")
    monkeypatch.setattr(cost_model, "_MEMO", {})
    step_cost_for(model, progress=False)
    assert len(calls) > n
    # --recalibrate measures again whatever is cached, into the object every caller holds.
    held, n = step_cost_for(model), len(calls)
    assert step_cost_for(model, recalibrate=True, progress=False) is held and len(calls) > n


def test_a_rebuilt_extension_measures_its_own_curve(cache, monkeypatch):
    """A curve belongs to the kernels that were timed: another build of the extension (its file
    size or time changed: an upgrade, a rebuild with faster kernels) is measured anew."""
    fake, calls = fake_point()
    monkeypatch.setattr(cost_model, "_time_point", fake)
    model = Llama.random(tiny_config(num_layers=2), seed=0)
    step_cost_for(model, progress=False)
    key, n = cost_model.cost_key(model), len(calls)
    monkeypatch.setattr(cost_model, "kernels_build", lambda: "another build")
    monkeypatch.setattr(cost_model, "_MEMO", {})
    assert cost_model.cost_key(model) != key
    step_cost_for(model, progress=False)
    assert len(calls) > n and len(os.listdir(cache)) == 2


@pytest.mark.parametrize("poison", ["non-monotone", "other threads", "other cpu", "failed its checks"])
def test_a_poisoned_cache_entry_is_detected_on_load(cache, monkeypatch, poison):
    fake, calls = fake_point()
    monkeypatch.setattr(cost_model, "_time_point", fake)
    model = Llama.random(tiny_config(num_layers=2), seed=0)
    path = cache / (cost_model.cost_key(model) + ".json")
    data = step_cost_for(model, progress=False).to_json()
    if poison == "non-monotone":  # the curve issue 28 found cached: 1 row 1.18 s, 4 rows 0.135 s, 64 rows 1.75 s
        data["table"] = {"1": {"1": 1.18, "4": 0.135, "64": 1.75}}
    elif poison == "other threads":
        data["meta"]["threads"] += 1
    elif poison == "other cpu":
        data["meta"]["cpu"] = "another CPU"
    else:
        data["meta"]["problems"] = ["batch 1, 1 rows: repeats disagree by 900%"]
    path.write_text(json.dumps(data))
    monkeypatch.setattr(cost_model, "_MEMO", {})
    n = len(calls)
    cost = step_cost_for(model, progress=False)
    assert len(calls) > n  # measured again
    assert cost.seconds(1) == pytest.approx(1e-3) and json.loads(path.read_text())["table"] == cost.to_json()["table"]


def test_calibration_checks_itself(cache, monkeypatch):
    model = Llama.random(tiny_config(num_layers=1), seed=0)
    # A point whose repeats disagree is measured again; when it agrees then, the curve is cached.
    fake, calls = fake_point()
    flaky = {"left": 1}

    def once_noisy(model, batch, r, context, repeats):
        if (batch, r) == (1, 4) and flaky["left"]:
            flaky["left"] -= 1
            calls.append((batch, r))
            return [1e-3, 9e-3, 1e-3, 8e-3, 3e-4]
        return fake(model, batch, r, context, repeats)

    monkeypatch.setattr(cost_model, "_time_point", once_noisy)
    cost = step_cost_for(model, progress=False)
    assert calls.count((1, 4)) == 2 and "problems" not in cost.meta and cost.meta["cached"]
    # A point that never agrees: the curve says why, is used in this process, never cached.
    monkeypatch.setattr(cost_model, "_MEMO", {})
    for f in cache.iterdir():
        f.unlink()
    fake, calls = fake_point(noisy={(1, 16)})
    monkeypatch.setattr(cost_model, "_time_point", fake)
    cost = step_cost_for(model, progress=False)
    assert cost.meta["problems"][0].startswith("batch 1, 16 rows: repeats disagree by")
    assert cost.meta["cached"] is False and list(cache.iterdir()) == []
    assert calls.count((1, 16)) == cost_model.CALIBRATION_ATTEMPTS
    assert cost.meta["noise"] > cost_model.NOISE_LIMIT


def test_curve_checks():
    assert cost_model.curve_problems({1: {1: 0.01, 4: 0.012, 16: 0.03}, 4: {4: 0.02, 16: 0.03}}) == []
    issue = cost_model.curve_problems({1: {1: 1.18, 4: 0.135, 64: 1.75}})
    assert issue == ["batch 1: 4 rows (135.0 ms) faster than 1 (1180.0 ms)"]
    assert cost_model.curve_problems({1: {1: 0.01, 2: 0.0095}}) == []  # within the timer's noise
    assert cost_model.curve_problems({1: {1: 0.01, 4: 0.1}}) == [
        "batch 1: 4 rows (100.0 ms) cost more than 4 steps of 1 (10.0 ms)"]
    assert cost_model.curve_problems({1: {1: 0.01}}, {(1, 1): 0.8}) == ["batch 1, 1 rows: repeats disagree by 80%"]
    assert cost_model.spread([1.0, 1.0, 1.0, 1.0, 50.0]) == 0.0  # one preempted run of five is not disagreement
    assert cost_model.spread([1.0, 2.0]) == pytest.approx(2 / 3)


def test_a_poisoned_cache_is_refreshed_by_live_step_times(cache, monkeypatch):
    """A cached curve that passes every check but is 100x too slow (measured while the
    machine was busy, or written by hand): the Generator's verification steps disagree with
    it, so it is measured again, in place, and the cache file is rewritten."""
    model = Llama.random(tiny_config(num_layers=2), seed=0)
    path = cache / (cost_model.cost_key(model) + ".json")
    fake, calls = fake_point(seconds_per_row=1.0)  # 1 s a row: ~1000x what a tiny model's step takes
    monkeypatch.setattr(cost_model, "_time_point", fake)
    poisoned = step_cost_for(model, progress=False)
    assert path.exists() and poisoned.seconds(1) == pytest.approx(1.0)
    monkeypatch.setattr(cost_model, "_MEMO", {})
    fake, calls = fake_point(seconds_per_row=2e-4)  # what the refresh measures
    monkeypatch.setattr(cost_model, "_time_point", fake)
    gen = Generator(model, NgramTreeDrafter(), SpecSchedule("max"))
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    ar = Generator(model).generate([prompt], 24)[0].output
    out = gen.generate([prompt], 24)[0]
    assert out.output == ar
    assert calls, "the poisoned curve was not measured again"
    cost = gen.step_cost
    assert cost.curve_seconds(1) == pytest.approx(2e-4) and "live steps took" in cost.meta["refreshed_because"]
    assert json.loads(path.read_text())["meta"]["refreshed_because"] == cost.meta["refreshed_because"]
    # At most one refresh per interval: the next disagreement (fake vs real times) measures nothing.
    n = len(calls)
    gen.generate([prompt], 24)
    assert len(calls) == n
    # A curve the caller gave is theirs: never checked or replaced.
    given = StepCost({1: {1: 5.0, 64: 5.0}})
    Generator(model, NgramTreeDrafter(), SpecSchedule("max"), step_cost=given).generate([prompt], 24)
    assert given.seconds(1) == 5.0 and len(calls) == n


def test_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECDEC_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cost_model.cache_dir() == os.path.join(str(tmp_path), "specdec_kernels", "cost")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cost_model.cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "specdec_kernels", "cost")


def test_calibration_stops_at_its_time_budget(monkeypatch):
    monkeypatch.setattr(cost_model, "_time_point", fake_point()[0])  # the budget, not the checks, here
    model = Llama.random(tiny_config(num_layers=1), seed=0)
    # A spent budget still measures the minimum points: the curve keeps its shape.
    cost = calibrate(model, budget_s=0.0, repeats=1)
    assert {b: [r for r, _ in pts] for b, pts in cost.table.items()} == {1: [1, 2, 4, 8, 16, 64], 4: [4, 16]}
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


# ---- the pay-off model ------------------------------------------------------------------
MEASURED = StepCost({1: {1: 0.010, 2: 0.0116, 4: 0.0139, 16: 0.037, 64: 0.12}, 4: {4: 0.021, 16: 0.05, 64: 0.16}})
CURVES = [MEASURED, as_step_cost([1.0, 1.08, 1.14, 1.17, 1.24, 1.31]), as_step_cost({1: 1.0, 2: 1.3, 128: 39.1}),
          StepCost({1: {1: 1.0, 64: 1.0}, 4: {4: 1.0, 256: 1.0}}), as_step_cost(lambda rows: 1.0 + 0.09 * (rows - 1))]


def test_chain_tokens():
    for a in (0.0, 0.3, 0.8, 0.99):
        for k in (0, 1, 5):
            assert chain_tokens(a, k) == pytest.approx((1 - a ** (k + 1)) / (1 - a))
    assert chain_tokens([0.5, 0.4, 0.1]) == pytest.approx(1 + 0.5 + 0.2 + 0.02)
    assert chain_tokens([0.5, 0.4, 0.1], 1) == 1.5
    with pytest.raises(ValueError, match="chain length"):
        chain_tokens(0.5)


def test_best_chain_length():
    k, speed = best_chain_length(0.8, 12, as_step_cost(lambda rows: 1.0))  # free drafts and rows: the longest chain
    assert k == 12 and speed > 3
    assert best_chain_length(0.8, 12, as_step_cost(lambda rows: 1.0), draft_cost=0.05)[0] == 8  # a draft token: 5% of a step
    assert best_chain_length(0.1, 12, as_step_cost(lambda rows: 1.0 + rows), draft_cost=0.5) == (0, 1.0)  # nothing pays
    # The batch's rows: free at batch 1, costly at batch 4 (the batch already fills the step).
    curve = StepCost({1: {1: 1.0, 64: 1.0}, 4: {4: 1.0, 5: 50.0, 256: 5000.0}})
    assert best_chain_length(0.9, 6, curve, batch=1)[0] == 6 and best_chain_length(0.9, 6, curve, batch=4)[0] == 0
    # ... through any (rows, batch) callable, e.g. a drafter's ``cost``: the batch is passed on.
    assert best_chain_length(0.9, 6, lambda rows, batch: curve(rows, batch), batch=4)[0] == 0
    assert best_node_count([0.9] * 4, lambda rows, batch: curve(rows, batch), batch=4)[0] == 0
    assert best_node_count([0.9] * 4, lambda rows, batch: curve(rows, batch), batch=1)[0] == 4
    values = chain_payoffs(0.5, 3, as_step_cost([1.0, 1.5, 2.0, 2.5]), width=2)  # a root with one extra child: k + 2 rows
    assert values == [1.0, 1.5 / 2.0, 1.75 / 2.5, 1.875 / 3.0]


def test_best_node_count_and_row_price():
    # Two requests: rows at 1.08, 1.14, 1.17, 1.24 of a 2-row step; 0.9 and 0.8 pay, 0.05 does not.
    cost = StepCost({2: {2: 1.0, 3: 1.14 / 1.08, 4: 1.17 / 1.08, 5: 1.24 / 1.08}})
    n, value = best_node_count([0.9, 0.8, 0.05], cost, batch=2)
    assert n == 2 and value == pytest.approx(3.7 / (1.17 / 1.08))
    assert tree_payoffs([], cost, batch=2) == [2.0]
    assert best_node_count([0.9], cost, batch=2, draft_cost=5.0)[0] == 1  # spent drafting does not stop a node
    assert best_node_count([0.9, 0.8], as_step_cost(lambda rows: 1.0))[0] == 2  # free rows: every node
    # A node pays for its row exactly when its probability beats row_price.
    for curve in CURVES:
        for rows, tokens in ((1, 1.0), (4, 4.6), (9, 5.0)):
            value = payoff(tokens, rows, as_step_cost(curve))
            price = row_price(value, rows, as_step_cost(curve))
            for p in (price * 0.99, price * 1.01):
                if p > 0:
                    assert (payoff(tokens + p, rows + 1, as_step_cost(curve)) > value) == (p > price)


def test_relative_curves_take_their_seconds():
    relative = with_seconds({1: 1.0, 2: 1.3, 128: 39.1}, 0.02)
    assert isinstance(relative, RelativeStepCost) and relative(2) == pytest.approx(1.3)
    assert relative.seconds(2) == pytest.approx(0.026) and relative_cost(0.013, relative, 2) == pytest.approx(0.5)
    assert with_seconds(MEASURED, 5.0) is MEASURED  # a StepCost holds its own seconds
    with pytest.raises(RuntimeError, match="one-row step"):
        with_seconds([1.0, 1.1]).seconds(1)
    model = Llama.random(tiny_config(num_layers=1), seed=0)
    gen = Generator(model, step_cost=[1.0, 1.5])
    own = gen.drafter_step_cost([1.0, 2.0], step_seconds=0.5)
    assert own(2) == 2.0 and own.seconds(2) == 1.0  # the drafter's own curve and seconds
    gen.step_cost = MEASURED
    assert gen.drafter_step_cost() is MEASURED
    rel = gen.drafter_step_cost([1.0, 2.0])  # a relative curve: the seconds of the Generator's curve
    assert rel.seconds(1) == pytest.approx(0.010) and relative_cost(0.010, rel, 1) == pytest.approx(1.0)


# The sizing rules as each drafter and trainer wrote them before the pay-off model (issue 24),
# to show the pay-off functions make the same decisions.
def _old_chain_length(a, cap, cost, width, c, batch):  # ModelDrafter.chain_length
    best_k, best = 0, 1.0
    for k in range(1, cap + 1):
        value = sum(a ** i for i in range(k + 1)) / (cost(batch * (k + width), batch) + k * c)
        if value > best:
            best_k, best = k, value
    return best_k


def _old_select(probs, cost, B, draft_rel):  # NgramTreeDrafter.select (draft_rel 0), EagleDrafter._select
    best_n, best, total = 0, B / (cost(B, B) + draft_rel), float(B)
    for n, p in enumerate(probs, 1):
        total += p
        value = total / (cost(B + n, B) + draft_rel)
        if value > best:
            best_n, best = n, value
    return best_n, best


def _old_pick_tree_size(values, cost_per_node, draft_cost):  # drafting.medusa.training.pick_tree_size
    acc, best = 1.0, (1.0, 0)
    for n, v in enumerate(values, start=1):
        acc += v
        speed = acc / (1 + cost_per_node * n + draft_cost)
        if speed > best[0]:
            best = (speed, n)
    return best[1]


def test_pay_off_sizes_as_the_drafters_did():
    from specdec_kernels.drafting.medusa.training import pick_tree_size

    g = torch.Generator().manual_seed(0)
    for case in range(60):
        cost = CURVES[case % len(CURVES)]
        batch = (1, 2, 4)[case % 3]
        a = float(torch.rand(1, generator=g))
        c = float(torch.rand(1, generator=g)) * 0.2
        for width in (1, 3):
            k, _ = best_chain_length(a, 8, cost, batch=batch, width=width, draft_cost=c)
            assert k == _old_chain_length(a, 8, as_step_cost(cost), width, c, batch)
        probs = sorted(torch.rand(12, generator=g).pow(3).tolist(), reverse=True)
        for draft_rel in (0.0, c):
            assert best_node_count(probs, cost, batch=batch, draft_cost=draft_rel) == \
                _old_select(probs, as_step_cost(cost), batch, draft_rel)
        scored = [((i,), p) for i, p in enumerate(probs)]
        assert pick_tree_size(scored, cost_per_node=c, draft_cost=c / 2)[0] == _old_pick_tree_size(probs, c, c / 2)
