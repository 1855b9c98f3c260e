"""The measured cost of a verification step: seconds against verified rows and batch size.

Speculation pays when verifying R drafted rows costs about as much as decoding one, and how
much more R rows cost depends on the model, its weight format (fp32 matrices vs GGUF blocks:
the quantised GEMM streams each weight block once for all rows), the thread count and the
CPU. So the tree-sizing drafters do not use a table measured on one machine; they use a
``StepCost`` curve measured for the loaded model:

- ``calibrate(model)`` times real target forwards (+ LM head) of R rows per request over a
  few R and batch sizes (medians of a few repeats; six points always, more while ~2 s
  last) and interpolates;
- ``step_cost_for(model)`` returns the curve for the model, weight format, torch thread count
  and CPU, cached per process and on disk in the user's cache directory
  (``$XDG_CACHE_HOME/specdec_kernels/cost/<key>.json``, ``~/.cache`` by default;
  ``SPECDEC_CACHE_DIR`` overrides the root), so calibration runs once per machine;
- or pass your own: ``StepCost({1: {1: 0.010, 8: 0.012}})`` or any callable
  ``rows -> cost relative to a one-row step`` to a drafter (``step_cost=``), or set
  ``Generator.step_cost``.

``ops.skinny_linear_rows`` (which fp32 row counts go to skinny_linear rather than MKL) keeps
its rule: on the default native weights ``ops.linear`` sends every row count to
``quantized_linear`` and never consults it; on fp32 weights a per-machine crossover measured
on a loaded machine could move between runs and silently change which kernel — and so which
rounding — a product gets; and the step-cost curve here already measures the rule's effect
(e.g. a jump where a row count leaves skinny_linear), so the drafters see it without a table.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from bisect import bisect_left
from typing import Callable, Mapping

import torch

__all__ = ["StepCost", "calibrate", "step_cost_for", "cache_dir", "cost_key", "cpu_model", "as_step_cost",
           "draft_token_seconds"]

# (batch, rows per request) timed, in this order: the first CALIBRATION_MIN_POINTS always
# (the curve's shape: one row, a small tree, a large one, and batch 4), the rest while the
# time budget lasts. Past the last row count the curve extends its last segment.
CALIBRATION_POINTS = ((1, 1), (1, 16), (1, 4), (1, 64), (4, 1), (4, 4), (1, 8), (1, 2), (1, 32), (4, 16))
CALIBRATION_MIN_POINTS = 6
CALIBRATION_BUDGET_S = 2.0  # seconds of timed forwards at most (one more point may start before it ends)
POINT_BUDGET_S = 0.25  # past this, a point stops repeating (at least one timed run after the warm-up)


class StepCost:
    """Seconds of one verification step (target forward + LM head) over ``rows`` verified
    rows in all, for a batch of ``batch`` requests.

    ``table``: {batch: {total rows: seconds}} (at least one batch with one point). Between
    measured row counts the cost is piecewise linear; past the last one it extends the last
    segment (slope >= 0); between measured batch sizes it is linear in the batch; outside,
    the nearest measured batch is used. Calling the object, ``cost(rows, batch=1)``, gives the
    cost relative to a one-row-per-request step of that batch (1.0 at ``rows == batch``),
    which is what the drafters weigh expected tokens against.
    """

    def __init__(self, table: Mapping, *, meta: dict | None = None):
        parsed = {}
        for b, points in table.items():
            pts = sorted((int(r), float(s)) for r, s in points.items())
            if not pts or int(b) < 1 or any(r < 1 or s <= 0 for r, s in pts):
                raise ValueError(f"table[{b}] must map row counts >= 1 to positive seconds, got {dict(points)}")
            parsed[int(b)] = pts
        if not parsed:
            raise ValueError("table must hold at least one batch size")
        self.table = parsed
        self.meta = dict(meta or {})

    @staticmethod
    def _interp(points: list, rows: float) -> float:
        xs = [r for r, _ in points]
        if len(points) == 1:
            return points[0][1] * max(rows, 1) / xs[0] if rows > xs[0] else points[0][1]
        i = bisect_left(xs, rows)
        if i < len(xs) and xs[i] == rows:
            return points[i][1]
        if i == 0:
            (x0, y0), (x1, y1) = points[0], points[1]
            return max(y0 - (x0 - rows) * max((y1 - y0) / (x1 - x0), 0.0), 1e-9)
        if i >= len(xs):  # past the end: the last segment extended from the last point (never falling)
            (x0, y0), (x1, y1) = points[-2], points[-1]
            return y1 + (rows - x1) * max((y1 - y0) / (x1 - x0), 0.0)
        (x0, y0), (x1, y1) = points[i - 1], points[i]
        return y0 + (rows - x0) * (y1 - y0) / (x1 - x0)

    def seconds(self, rows: int, batch: int = 1) -> float:
        """Seconds of a step verifying ``rows`` rows in all over ``batch`` requests."""
        batches = sorted(self.table)
        if batch <= batches[0]:
            return self._interp(self.table[batches[0]], rows)
        if batch >= batches[-1]:
            return self._interp(self.table[batches[-1]], rows)
        j = bisect_left(batches, batch)
        b0, b1 = batches[j - 1], batches[j]
        if b1 == batch:
            return self._interp(self.table[b1], rows)
        w = (batch - b0) / (b1 - b0)
        return (1 - w) * self._interp(self.table[b0], rows) + w * self._interp(self.table[b1], rows)

    def __call__(self, rows: int, batch: int = 1) -> float:
        """Cost of ``rows`` rows relative to a step of one row per request (batch ``batch``)."""
        return self.seconds(rows, batch) / self.seconds(batch, batch)

    def to_json(self) -> dict:
        return {"table": {str(b): {str(r): s for r, s in pts} for b, pts in self.table.items()}, "meta": self.meta}

    @classmethod
    def from_json(cls, data: dict) -> "StepCost":
        return cls(data["table"], meta=data.get("meta"))

    def __repr__(self) -> str:
        pts = ", ".join(f"{r}: {s * 1e3:.1f} ms" for r, s in self.table[min(self.table)])
        return f"StepCost(batch {min(self.table)}: {{{pts}}}, {len(self.table)} batch sizes)"


def as_step_cost(cost) -> Callable:
    """A drafter's ``step_cost`` argument as a callable ``(rows, batch=1) -> relative cost``:
    a StepCost, a callable of ``rows`` (relative cost; batch ignored), or a sequence of
    relative costs at 1, 2, ... rows (+ the last step per row past its end)."""
    if isinstance(cost, StepCost):
        return cost
    if callable(cost):
        return lambda rows, batch=1: cost(rows)
    table = tuple(float(c) for c in cost)
    if not table:
        raise ValueError("a cost table needs at least one entry")
    per_row = table[-1] - table[-2] if len(table) > 1 else 0.0

    def lookup(rows, batch=1):
        return table[rows - 1] if rows <= len(table) else table[-1] + per_row * (rows - len(table))

    return lookup


# ---- calibration ------------------------------------------------------------------------
def _time_step(model, batch: int, rows_per_request: int, context: int, repeats: int) -> float:
    """Median seconds of forward + logits of ``rows_per_request`` new rows (a chain, causal)
    for ``batch`` requests (``repeats`` timed runs after a warm-up, fewer once the point has
    taken POINT_BUDGET_S) with ``context`` cached positions each (the cached K/V are whatever
    the fresh cache holds: the cost does not depend on their values)."""
    from ..models.llama import Batch

    cache = model.new_cache(batch, context + rows_per_request + 1)
    slots = [cache.add_request(context) for _ in range(batch)]
    cache.append_slots(slots, [context] * batch)
    cache.commit(slots, [context] * batch)
    tokens = torch.randint(0, model.config.vocab_size, (batch * rows_per_request,),
                           generator=torch.Generator().manual_seed(0))
    positions = (context + torch.arange(rows_per_request)).repeat(batch)
    times = []
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(repeats + 1):
            if len(times) >= 1 and time.perf_counter() - start > POINT_BUDGET_S:
                break  # a large step measured once is enough: its noise is small against its length
            new = cache.append_slots(slots, [rows_per_request] * batch)
            block_table, prefix_lens = cache.batch_view(slots)
            t0 = time.perf_counter()
            hidden = model.forward(tokens, positions, cache, Batch(block_table, prefix_lens, new.qo_indptr,
                                                                   new.slot_mapping, None))
            model.logits(hidden)
            if i > 0:  # the first run warms caches/allocations
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def calibrate(model, *, points=None, context: int = 64, repeats: int = 3, budget_s: float | None = None,
              min_points: int | None = None) -> StepCost:
    """Measure ``model``'s step cost: for each (batch size, rows per request) in ``points``
    (default CALIBRATION_POINTS), the median of ``repeats`` forwards + LM head. The first
    ``min_points`` (default CALIBRATION_MIN_POINTS) are always measured; later ones only while
    fewer than ``budget_s`` seconds (default CALIBRATION_BUDGET_S) have been spent."""
    points = points or CALIBRATION_POINTS
    budget_s = CALIBRATION_BUDGET_S if budget_s is None else budget_s
    min_points = CALIBRATION_MIN_POINTS if min_points is None else min_points
    start = time.perf_counter()
    table: dict = {}
    for i, (batch, r) in enumerate(points):
        if i >= max(min_points, 1) and time.perf_counter() - start > budget_s:
            break
        table.setdefault(batch, {})[batch * r] = _time_step(model, batch, r, context, repeats)
    meta = {"model": model.name, "weights": weight_format(model), "threads": torch.get_num_threads(),
            "cpu": cpu_model(), "torch": torch.__version__, "context": context, "repeats": repeats,
            "seconds": round(time.perf_counter() - start, 3), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    return StepCost(table, meta=meta)


# ---- cache ------------------------------------------------------------------------------
def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, platform.processor() elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def weight_format(model) -> str:
    return getattr(model, "weight_format", None) or str(model.dtype).replace("torch.", "")


def cost_key(model) -> str:
    """File-name-safe key: model name, weight format, torch threads, a hash of the CPU model."""
    cpu = hashlib.sha1(cpu_model().encode()).hexdigest()[:10]
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(model.name))
    return f"{name}-{weight_format(model)}-t{torch.get_num_threads()}-{model.device.type}-{cpu}"


def cache_dir() -> str:
    """Where measured cost curves are kept: $SPECDEC_CACHE_DIR, else
    $XDG_CACHE_HOME/specdec_kernels, else ~/.cache/specdec_kernels; then /cost."""
    from .._platform import package_cache_dir

    return package_cache_dir("cost")


_MEMO: dict = {}


def step_cost_for(model, *, recalibrate: bool = False) -> StepCost:
    """The step-cost curve of ``model`` (its weights, this thread count and CPU): from this
    process's memo, else the user's cache directory, else measured now (``calibrate``, ~2 s)
    and saved there. A cache file that cannot be read is measured again; one that cannot be
    written is only kept in memory."""
    key = cost_key(model)
    if not recalibrate and key in _MEMO:
        return _MEMO[key]
    path = os.path.join(cache_dir(), key + ".json")
    cost = None
    if not recalibrate and os.path.exists(path):
        try:
            with open(path) as f:
                cost = StepCost.from_json(json.load(f))
        except (OSError, ValueError, KeyError, TypeError):
            cost = None
    if cost is None:
        cost = calibrate(model)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(cost.to_json(), f, indent=1)
            os.replace(tmp, path)
        except OSError:
            pass
    _MEMO[key] = cost
    return cost


def draft_token_seconds(model, *, context: int = 64, repeats: int = 9) -> float:
    """Median seconds of one draft token of ``model`` (a Llama used as a drafter): a one-row
    forward at a ``context``-token prefix plus its LM head — what each depth of a draft-model
    chain costs (the calibration's own timing, at one row). Measured, never tabled: it depends
    on the draft's depth, weight format and vocabulary, the thread count and the CPU."""
    return _time_step(model, 1, 1, context, repeats)
