"""The measured cost of a verification step (seconds against verified rows and batch size),
and the one pay-off model every drafter and trainer sizes its drafts by.

Speculation pays when verifying R drafted rows costs about as much as decoding one, and how
much more R rows cost depends on the model, its weight format (fp32 matrices vs GGUF blocks:
the quantised GEMM streams each weight block once for all rows), the thread count and the
CPU. So the tree-sizing drafters do not use a table measured on one machine; they use a
``StepCost`` curve measured for the loaded model:

- ``calibrate(model)`` times real target forwards (+ LM head) of R rows per request over a
  few R and batch sizes (medians of a few repeats; eight points always, more while ~2 s
  last; a status line on stderr while it runs) and interpolates;
- ``step_cost_for(model)`` returns the curve for the model, weight format, torch thread count
  and CPU, cached per process and on disk in the user's cache directory
  (``$XDG_CACHE_HOME/specdec_kernels/cost/<key>.json``, ``~/.cache`` by default;
  ``SPECDEC_CACHE_DIR`` overrides the root), so calibration runs once per machine;
- or pass your own: ``StepCost({1: {1: 0.010, 8: 0.012}})`` or any callable
  ``rows -> cost relative to a one-row step`` to a drafter (``step_cost=``), or to the
  Generator (``Generator(..., step_cost=)``, the one place drafters read it from:
  ``Generator.drafter_step_cost`` resolves, and if need be measures, the curve; no drafter
  measures it). A relative curve gets the seconds of a one-row step
  (:class:`RelativeStepCost`, :func:`with_seconds`) to weigh measured drafting time.

The pay-off model (the end of this module): a draft's value is its expected emitted tokens
per unit time, ``tokens / (cost(rows, batch) + draft cost)`` (:func:`payoff`), costs relative
to a step of one row per request. :func:`chain_tokens` gives a chain's expected tokens from
its acceptance rate(s); :func:`best_chain_length` sizes a chain (the draft-model drafters,
the draft trainer), :func:`best_node_count` a tree from its nodes' probabilities (the
prompt-lookup tree, EAGLE, the Medusa trainer), :func:`row_price` says what one more row
must bring (EAGLE's beam and its prompt-lookup branch).

A curve measured on a busy machine can be nonsense (issue 28: 1 row 1.18 s, 4 rows 0.135 s,
64 rows 1.75 s, cached and reused forever). So: a calibration checks its own measurements
(``curve_problems``) and measures the failing points again, and only a curve that passes is
cached; a cached entry is checked again when read (``_read_cached``); and ``LiveCheck``
compares the verification steps a Generator times with the curve and measures it again,
in place, when they disagree. Each entry records when it was made and how noisy it was.

``models.skinny_rows.skinny_linear_rows`` (which fp32 row counts go to skinny_linear) keeps
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

__all__ = ["StepCost", "calibrate", "step_cost_for", "cache_dir", "cache_path", "cost_key", "cpu_model",
           "as_step_cost", "curve_problems", "LiveCheck", "draft_token_seconds", "RelativeStepCost", "with_seconds",
           "relative_cost", "payoff", "chain_tokens", "chain_payoffs", "tree_payoffs", "best_size",
           "best_chain_length", "best_node_count", "row_price"]

# (batch, rows per request) timed, in this order: the first CALIBRATION_MIN_POINTS always
# (the curve's shape: one row, a small tree, a large one, batch 4, and two rows — on a CPU
# where past one row the products are compute-bound the first extra row is not the average
# of the first three: the 1.5B on AVX2 costs 1.3x at 2 rows, 2.2x at 3, 2.4x at 4, and
# the one-token drafts are the most common decision; and eight rows, about the size of the
# trees drafted on code prompts (4-10 nodes a step on average), measured rather than read
# off the line from 4 to 16 rows, whose shape differs by kernel path: AVX-512 VNNI register
# tiles of up to 8 rows, AVX2 compute-bound from 3), the rest while the time budget lasts.
# Past the last row count the curve extends its last segment.
CALIBRATION_POINTS = ((1, 1), (1, 16), (1, 4), (1, 64), (4, 1), (4, 4), (1, 2), (1, 8), (1, 32), (4, 16))
CALIBRATION_MIN_POINTS = 8
CALIBRATION_BUDGET_S = 2.0  # seconds of timed forwards at most (one more point may start before it ends)
POINT_BUDGET_S = 0.25  # past this, a point stops repeating (at least two timed runs after the warm-up)
CALIBRATION_ATTEMPTS = 2  # rounds of measuring the points a check rejects (the first included)
NOISE_LIMIT = 0.5  # a point whose repeats spread more than this (spread(): middle range / median) is noise
MONOTONE_SLACK = 0.15  # more rows may cost this much less than fewer (timer noise), no more
SUPERLINEAR_LIMIT = 1.5  # R rows may cost this much more than R one-row steps, no more


class StepCost:
    """Seconds of one verification step (target forward + LM head) over ``rows`` verified
    rows in all, for a batch of ``batch`` requests.

    ``table``: {batch: {total rows: seconds}} (at least one batch with one point). Between
    measured row counts the cost is piecewise linear; past the last one it extends the last
    segment (slope >= 0); between measured batch sizes it is linear in the batch; outside,
    the nearest measured batch is used. Calling the object, ``cost(rows, batch=1)``, gives the
    cost relative to a one-row-per-request step of that batch (1.0 at ``rows == batch``),
    which is what the drafters weigh expected tokens against.

    Live steps refine it (:meth:`observe`, fed by :class:`LiveCheck` with the Generator's
    verification steps): per batch size and row count (exact up to 8 rows, then powers of
    two), a decayed mean of (observed seconds / the table's); once a row count has
    ``LIVE_MIN`` observations its seconds are the table's times that ratio (a row count not
    observed enough takes the ratio of the nearest observed one below it, else none). Why:
    the table is measured once per machine in a few seconds, and its small row counts —
    where most sizing decisions fall — can be off by 5–10%; a three-row step of the 1.5B took
    1.24x a one-row step in the decode loop against the cached table's 1.15x, and sampled
    EAGLE trees that the table said would pay lost 5–9% on open questions. The table itself
    (:meth:`curve_seconds`, what is cached) is not changed.
    """

    LIVE_MIN = 4  # observations of a (batch, row count) before they correct it
    LIVE_DECAY = 0.9  # weight of the older observations at each new one

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
        self.live = {}  # (batch, row bucket) -> [decayed sum of observed / table ratios, decayed count, count]
        # (rows, batch) -> seconds, until the next observation or a new table: a step's
        # sizing weighs the same few row counts many times over.
        self._seconds = {}

    def take(self, fresh: "StepCost", *, keep_live: bool = False) -> None:
        """Takes ``fresh``'s table and metadata in place (a refresh: every holder of this
        object sees them); its live refinements too unless ``keep_live``."""
        self.table, self.meta = fresh.table, fresh.meta
        if not keep_live:
            self.live = {}
        self._seconds = {}

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
        """Seconds of a step verifying ``rows`` rows in all over ``batch`` requests: the
        table's, refined by the live steps observed (class docstring)."""
        seconds = self._seconds.get((rows, batch))
        if seconds is None:
            seconds = self._seconds[rows, batch] = self.curve_seconds(rows, batch) * self.live_ratio(rows, batch)
        return seconds

    @staticmethod
    def _row_bucket(rows: int) -> int:
        """Row counts 1..8 apart, then 9-16, 17-32, ... together."""
        return rows if rows <= 8 else 4 + (rows - 1).bit_length()

    def observe(self, rows: int, batch: int, seconds: float) -> None:
        """Record a live step: ``rows`` rows in all for ``batch`` requests took ``seconds``."""
        self._seconds = {}
        entry = self.live.setdefault((batch, self._row_bucket(rows)), [0.0, 0.0, 0])
        entry[0] = self.LIVE_DECAY * entry[0] + seconds / self.curve_seconds(rows, batch)
        entry[1] = self.LIVE_DECAY * entry[1] + 1.0
        entry[2] += 1

    def live_ratio(self, rows: int, batch: int = 1) -> float:
        """Observed / table seconds at ``rows`` rows and batch ``batch`` (class docstring); 1.0
        where nothing was observed enough."""
        for bucket in range(self._row_bucket(rows), 0, -1):
            entry = self.live.get((batch, bucket))
            if entry is not None and entry[2] >= self.LIVE_MIN:
                return entry[0] / entry[1]
        return 1.0

    def curve_seconds(self, rows: int, batch: int = 1) -> float:
        """The table's seconds of a step verifying ``rows`` rows in all over ``batch`` requests."""
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
    a StepCost or RelativeStepCost (as they are), a callable of ``rows`` (relative cost;
    batch ignored), a dict {rows: relative cost} (interpolated as a one-batch StepCost), or
    a sequence of relative costs at 1, 2, ... rows (+ the last step per row past its end)."""
    if isinstance(cost, (StepCost, RelativeStepCost)):
        return cost
    if isinstance(cost, Mapping):
        return StepCost({1: cost})
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
def _time_point(model, batch: int, rows_per_request: int, context: int, repeats: int) -> list:
    """Seconds of each timed forward + logits of ``rows_per_request`` new rows (a chain,
    causal) for ``batch`` requests, with ``context`` cached positions each (the cached K/V
    are whatever the fresh cache holds: the cost does not depend on their values). A warm-up
    run first (caches, allocations), then ``repeats`` timed runs, at least two however long
    they take (two are needed to see whether they agree), fewer than ``repeats`` once the
    point has taken POINT_BUDGET_S."""
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
        for i in range(max(repeats, 2) + 1):
            if len(times) >= 2 and time.perf_counter() - start > POINT_BUDGET_S:
                break  # a large step measured twice is enough: its noise is small against its length
            new = cache.append_slots(slots, [rows_per_request] * batch)
            block_table, prefix_lens = cache.batch_view(slots)
            t0 = time.perf_counter()
            model.forward_logits(tokens, positions, cache, Batch(block_table, prefix_lens, new.qo_indptr,
                                                                 new.slot_mapping, None))
            if i > 0:
                times.append(time.perf_counter() - t0)
    return times


def _time_step(model, batch: int, rows_per_request: int, context: int, repeats: int) -> float:
    """Median seconds of one point (:func:`_time_point`)."""
    return statistics.median(_time_point(model, batch, rows_per_request, context, repeats))


def spread(times: list) -> float:
    """How much repeated timings of one point disagree, relative to their median: the range
    of the middle half for four or more (one preempted run on a shared machine is not
    disagreement), of all of them for two or three."""
    if len(times) < 2:
        return 0.0
    t, cut = sorted(times), (len(times) // 4 if len(times) >= 4 else 0)
    return (t[len(t) - 1 - cut] - t[cut]) / statistics.median(t)


def curve_problems(table: Mapping, spreads: Mapping | None = None) -> list:
    """Why a measured table {batch: {rows: seconds}} is not to be trusted ([] if it is):

    - repeats of a point disagree by more than NOISE_LIMIT (``spreads``: {(batch, rows):
      spread}, see :func:`spread`);
    - more rows cost less than fewer, beyond MONOTONE_SLACK (a verification step does all
      the work of a smaller one, and more);
    - R rows cost more than SUPERLINEAR_LIMIT x R separate one-row steps (a forward over R
      rows reads every weight once, not R times).
    The issue that added these checks saw 1 row 1.18 s, 4 rows 0.135 s, 64 rows 1.75 s on a
    machine with a busy core: the first two checks reject it."""
    problems = []
    for (b, r), sp in sorted((spreads or {}).items()):
        if sp > NOISE_LIMIT:
            problems.append(f"batch {b}, {r} rows: repeats disagree by {sp:.0%}")
    for b, points in sorted(table.items()):
        pts = sorted((int(r), float(sec)) for r, sec in points.items())
        for (r0, s0), (r1, s1) in zip(pts, pts[1:]):
            if s1 < s0 * (1 - MONOTONE_SLACK):
                problems.append(f"batch {b}: {r1} rows ({s1 * 1e3:.1f} ms) faster than {r0} ({s0 * 1e3:.1f} ms)")
        r0, s0 = pts[0]
        for r1, s1 in pts[1:]:
            if s1 > SUPERLINEAR_LIMIT * (r1 / r0) * s0:
                problems.append(f"batch {b}: {r1} rows ({s1 * 1e3:.1f} ms) cost more than {r1 / r0:.0f} steps of "
                                f"{r0} ({s0 * 1e3:.1f} ms)")
    return problems


def _monotone(table: dict) -> dict:
    """The table with each batch's seconds made non-decreasing in the rows (running max):
    what a curve that failed its checks is used as, in this process only."""
    out = {}
    for b, points in table.items():
        top, out[b] = 0.0, {}
        for r in sorted(points):
            top = max(top, points[r])
            out[b][r] = top
    return out


def calibrate(model, *, points=None, context: int = 64, repeats: int = 5, budget_s: float | None = None,
              min_points: int | None = None, attempts: int | None = None, progress=None) -> StepCost:
    """Measure ``model``'s step cost: for each (batch size, rows per request) in ``points``
    (default CALIBRATION_POINTS), the median of ``repeats`` forwards + LM head. The first
    ``min_points`` (default CALIBRATION_MIN_POINTS) are always measured; later ones only while
    fewer than ``budget_s`` seconds (default CALIBRATION_BUDGET_S) have been spent.

    Then the measurements check themselves (:func:`curve_problems`): the points at fault are
    measured again, up to ``attempts`` (default CALIBRATION_ATTEMPTS) rounds in all. A curve
    that still fails has ``meta["problems"]`` (and is made monotone so that it can be used);
    ``step_cost_for`` does not cache it. ``meta`` records when the curve was made
    (``created``), how noisy it was (``noise``: the largest spread of a point's repeats) and
    how long it took. ``progress(text)``: called with a short status line now and then."""
    points = points or CALIBRATION_POINTS
    budget_s = CALIBRATION_BUDGET_S if budget_s is None else budget_s
    min_points = CALIBRATION_MIN_POINTS if min_points is None else min_points
    attempts = CALIBRATION_ATTEMPTS if attempts is None else attempts
    start = time.perf_counter()
    table: dict = {}
    spreads: dict = {}

    def measure(batch, r):
        times = _time_point(model, batch, r, context, repeats)
        table.setdefault(batch, {})[batch * r] = statistics.median(times)
        spreads[(batch, batch * r)] = spread(times)

    measured = []
    for i, (batch, r) in enumerate(points):
        if i >= max(min_points, 1) and time.perf_counter() - start > budget_s:
            break
        measure(batch, r)
        measured.append((batch, r))
        if progress is not None:
            progress(f"{len(measured)} points, {time.perf_counter() - start:.1f} s")
    problems = curve_problems(table, spreads)
    for attempt in range(1, attempts):
        if not problems:
            break
        # Measure again every point a problem names (cheap ones are noisy, so all of a failing batch).
        bad = {(b, r) for b, r in measured if any(p.startswith((f"batch {b},", f"batch {b}:")) for p in problems)}
        if progress is not None:
            progress(f"measuring {len(bad)} points again ({problems[0]})")
        for b, r in sorted(bad):
            measure(b, r)
        problems = curve_problems(table, spreads)
    meta = {"model": model.name, "weights": weight_format(model), "threads": torch.get_num_threads(),
            "cpu": cpu_model(), "torch": torch.__version__, "context": context, "repeats": repeats,
            "seconds": round(time.perf_counter() - start, 3), "noise": round(max(spreads.values(), default=0.0), 4),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "measured": True}
    if problems:
        meta["problems"] = problems
        table = _monotone(table)
    if progress is not None:
        progress(f"{len(table and measured)} points in {meta['seconds']:.1f} s"
                 + (f"; it failed its checks ({problems[0]}), so it is not cached" if problems else ""))
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


def kernels_build() -> str:
    """The C++ extension's file size and modification time: a rebuilt or upgraded extension (its
    kernels' speed changed) gets curves of its own."""
    import importlib.util

    st = os.stat(importlib.util.find_spec("._C", __name__.rsplit(".", 2)[0]).origin)
    return f"{st.st_size}:{st.st_mtime_ns}"


def cost_key(model) -> str:
    """File-name-safe key: model name, weight format, torch threads, device, a hash of the CPU
    model, of the kernel paths this process takes (a curve measured with AMX on is not the
    curve with it off) and of the extension's build (``kernels_build``)."""
    from .._C import cpu_paths

    paths = ",".join(k for k, on in sorted(cpu_paths().items()) if on)
    cpu = hashlib.sha1(f"{cpu_model()}|{paths}|{kernels_build()}".encode()).hexdigest()[:10]
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(model.name))
    return f"{name}-{weight_format(model)}-t{torch.get_num_threads()}-{model.device.type}-{cpu}"


def cache_dir() -> str:
    """Where measured cost curves are kept: $SPECDEC_CACHE_DIR, else
    $XDG_CACHE_HOME/specdec_kernels, else ~/.cache/specdec_kernels; then /cost."""
    from .._platform import package_cache_dir

    return package_cache_dir("cost")


def cache_path(model) -> str:
    return os.path.join(cache_dir(), cost_key(model) + ".json")


def _read_cached(model, path: str) -> StepCost | None:
    """The cached curve at ``path`` if it is one to trust: readable, for this model, weight
    format, thread count and CPU, made by a calibration that passed its checks, and passing
    them again (a file edited or written by an older version is measured again)."""
    try:
        with open(path) as f:
            cost = StepCost.from_json(json.load(f))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    m = cost.meta
    same = (m.get("threads") == torch.get_num_threads() and m.get("cpu") == cpu_model()
            and m.get("weights") == weight_format(model) and m.get("model") == model.name)
    table = {b: dict(pts) for b, pts in cost.table.items()}
    if not same or not m.get("measured") or m.get("problems") or curve_problems(table):
        return None
    return cost


def _save(cost: StepCost, path: str) -> bool:
    """Write ``cost`` to ``path`` atomically; False (kept in memory only) if it failed its
    checks or the folder cannot be written."""
    if cost.meta.get("problems"):
        return False
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(cost.to_json(), f, indent=1)
        os.replace(tmp, path)
        return True
    except OSError:
        return False


class StderrProgress:
    """A ``progress`` callback for :func:`calibrate`: one status line on stderr, rewritten in
    place on a terminal; elsewhere (a log) only the last status, once, at ``done``."""

    def __init__(self, model):
        import sys

        self.stream = sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.label = (f"[measuring the step cost of {model.name} at {torch.get_num_threads()} threads "
                      f"(once per machine, cached in {cache_dir()}): ")
        self.last = ""

    def __call__(self, text: str) -> None:
        self.last = text
        if self.tty:
            self.stream.write(f"\r{self.label}{text}]\033[K")
            self.stream.flush()

    def done(self) -> None:
        if self.tty:
            self.stream.write("\n")
        elif self.last:
            self.stream.write(f"{self.label}{self.last}]\n")
        self.stream.flush()


_MEMO: dict = {}


def step_cost_for(model, *, recalibrate: bool = False, progress=None) -> StepCost:
    """The step-cost curve of ``model`` (its weights, this thread count and CPU): from this
    process's memo, else the user's cache directory (if the entry passes its checks,
    ``_read_cached``), else measured now (``calibrate``, ~2 s) and saved there if the
    measurement passed its own checks. ``recalibrate``: measure again whatever is cached.
    ``progress``: a callback for status lines (default: one line on stderr while measuring,
    :class:`StderrProgress`; ``False``: none). The returned object is the one every caller
    shares: a refresh (:class:`LiveCheck`) updates it in place."""
    key = cost_key(model)
    if not recalibrate and key in _MEMO:
        return _MEMO[key]
    path = os.path.join(cache_dir(), key + ".json")
    cost = None if recalibrate else _read_cached(model, path)
    if cost is None:
        show = StderrProgress(model) if progress is None else (progress or None)
        fresh = calibrate(model, progress=show)
        if isinstance(show, StderrProgress):
            show.done()
        fresh.meta["cached"] = _save(fresh, path)
        cost = _MEMO.get(key)
        if cost is None:
            cost = fresh
        else:  # keep the object others hold
            cost.take(fresh, keep_live=True)
    _MEMO[key] = cost
    return cost


class LiveCheck:
    """Compares a measured curve with the verification steps Generators time, and measures
    the curve again when they disagree: the median ratio of the last WINDOW steps' seconds to
    the curve's is outside [1 / LIVE_TOLERANCE, LIVE_TOLERANCE] (a curve measured while the
    machine was busier or quieter than now, or written by hand into the cache). The refresh
    updates the shared curve in place (every drafter holding it sees the new one) and
    rewrites the cache file. After a refresh, another one needs the live steps to have
    agreed with the new curve first and REFRESH_INTERVAL_S to have passed: a difference the
    new curve shows too (e.g. a context far longer than the 64 positions it is measured at)
    is not staleness, and must not make calibration a recurring cost. Every step also goes
    to the curve's :meth:`StepCost.observe`, which refines its small differences (a refresh
    drops those). One check per curve object (:meth:`for_cost`), shared by the Generators
    that use it."""

    WINDOW = 6
    LIVE_TOLERANCE = 2.5
    REFRESH_INTERVAL_S = 60.0
    _BY_CURVE: dict = {}  # id(curve) -> (curve, its LiveCheck)

    def __init__(self, cost: StepCost, model):
        self.cost, self.model = cost, model
        self.ratios: list = []
        self.refreshes = 0
        self.refreshed_at = None
        self.agreed = True  # since the last refresh (vacuously before the first)

    @classmethod
    def for_cost(cls, cost: StepCost, model) -> "LiveCheck":
        held = cls._BY_CURVE.get(id(cost))
        if held is None or held[0] is not cost:
            held = cls._BY_CURVE[id(cost)] = (cost, cls(cost, model))
        return held[1]

    def observe(self, rows: int, batch: int, seconds: float) -> bool:
        """Record one step (``rows`` verified rows in all for ``batch`` requests took
        ``seconds``); True when this made the curve be measured again."""
        self.cost.observe(rows, batch, seconds)
        self.ratios = (self.ratios + [seconds / self.cost.curve_seconds(rows, batch)])[-self.WINDOW:]
        if len(self.ratios) < self.WINDOW:
            return False
        ratio = statistics.median(self.ratios)
        if 1 / self.LIVE_TOLERANCE <= ratio <= self.LIVE_TOLERANCE:
            self.agreed = True
            return False
        if not self.agreed or (self.refreshed_at is not None
                               and time.monotonic() - self.refreshed_at < self.REFRESH_INTERVAL_S):
            return False
        made = self.cost.meta.get("created", "?")
        fresh = calibrate(self.model, progress=None)
        fresh.meta["refreshed_because"] = f"live steps took {ratio:.2f}x the curve's time (curve made {made})"
        fresh.meta["cached"] = _save(fresh, cache_path(self.model))
        self.cost.take(fresh)
        self.ratios, self.agreed, self.refreshed_at = [], False, time.monotonic()
        self.refreshes += 1
        return True


def draft_token_seconds(model, *, context: int = 64, repeats: int = 9) -> float:
    """Median seconds of one draft token of ``model`` (a Llama used as a drafter): a one-row
    forward at a ``context``-token prefix plus its LM head — what each depth of a draft-model
    chain costs (the calibration's own timing, at one row). Measured, never tabled: it depends
    on the draft's depth, weight format and vocabulary, the thread count and the CPU."""
    return _time_step(model, 1, 1, context, repeats)


# ---- a relative curve with seconds ------------------------------------------------------
class RelativeStepCost:
    """A step-cost curve given in relative costs (``relative``: a callable ``rows -> cost
    relative to a one-row step``, a sequence of such costs at 1, 2, ... rows, or a dict
    {rows: relative cost}), with the seconds of a one-row step so that measured drafting
    time can be weighed against it as against a :class:`StepCost`: ``cost(rows, batch)``
    is the relative cost, ``cost.seconds(rows, batch)`` = one-row seconds x ``cost(rows)``.

    ``one_row_seconds``: seconds, a callable giving them (read at each use: a measured
    curve refreshed by :class:`LiveCheck` changes in place), or None (``seconds`` then
    raises: a drafter that weighs drafting time needs them, see ``Generator.drafter_step_cost``).
    """

    def __init__(self, relative, one_row_seconds=None):
        self.relative = as_step_cost(relative)
        self.one_row_seconds = one_row_seconds

    def __call__(self, rows: int, batch: int = 1) -> float:
        return float(self.relative(rows, batch))

    def seconds(self, rows: int, batch: int = 1) -> float:
        s = self.one_row_seconds
        if s is None:
            raise RuntimeError("a relative step cost needs the seconds of a one-row step to weigh drafting time "
                               "(step_seconds=, or the Generator's curve: Generator.drafter_step_cost)")
        return (s() if callable(s) else s) * float(self.relative(rows, 1))


def with_seconds(cost, one_row_seconds=None):
    """``cost`` as a curve with relative costs and seconds: a StepCost as it is (it holds
    seconds; ``one_row_seconds`` is not used), anything else (see :func:`as_step_cost`; a
    dict {rows: relative cost} too) a :class:`RelativeStepCost` with ``one_row_seconds`` (a
    RelativeStepCost that has its seconds is kept as it is)."""
    if isinstance(cost, StepCost):
        return cost
    if isinstance(cost, RelativeStepCost):
        if cost.one_row_seconds is not None or one_row_seconds is None:
            return cost
        return RelativeStepCost(cost.relative, one_row_seconds)
    return RelativeStepCost(cost, one_row_seconds)


# ---- pay-off: expected tokens per unit time ---------------------------------------------
# Every drafter and trainer sizes its drafts with these. Units: costs relative to a step
# that verifies one row per request (a StepCost gives 1.0 at rows == batch); drafting time
# in the same unit (relative_cost). A draft's pay-off is its expected emitted tokens over
# the cost of its step, verification (``cost(rows, batch)``) plus drafting. A step that
# drafts nothing emits one token per request for a one-row-per-request step: pay-off 1 per
# request.

def relative_cost(seconds: float, cost, batch: int = 1) -> float:
    """``seconds`` (e.g. measured drafting time) in the pay-off's unit: over the seconds of
    a one-row-per-request step of ``batch`` requests (``cost``: a StepCost or a
    RelativeStepCost, :func:`with_seconds`)."""
    return seconds / cost.seconds(batch, batch)


def payoff(tokens: float, rows: int, cost, *, batch: int = 1, draft_cost: float = 0.0) -> float:
    """Expected tokens per unit time of a step: ``tokens`` expected emitted tokens over
    ``cost(rows, batch) + draft_cost`` (``rows``: verified rows in all, roots included;
    ``cost``: a (rows, batch) -> relative cost callable: a StepCost, a RelativeStepCost, a
    drafter's ``cost`` or ``as_step_cost(...)`` of a curve of rows alone)."""
    return tokens / (cost(rows, batch) + draft_cost)


def chain_tokens(acceptance, length: int | None = None) -> float:
    """Expected tokens one step emits with a chain of drafted tokens (the target's own
    token included): ``acceptance`` a float, the probability that each of ``length`` drafted
    tokens is accepted given the ones before were: 1 + a + ... + a^length; or a sequence of
    those probabilities by depth (a_1, a_2, ...; ``length`` at most its length, default
    all): 1 + a_1 + a_1 a_2 + ..."""
    if isinstance(acceptance, (int, float)):
        if length is None:
            raise ValueError("chain_tokens(acceptance: float, length) needs the chain length")
        return sum(acceptance ** i for i in range(length + 1))
    rates = list(acceptance)[:length] if length is not None else list(acceptance)
    expected, run = 1.0, 1.0
    for a in rates:
        run *= a
        expected += run
    return expected


def chain_payoffs(acceptance: float, cap: int, cost, *, batch: int = 1, width: int = 1,
                  draft_cost=0.0) -> list:
    """Pay-off per request of chains of k = 0..cap drafted tokens (list index k) at batch
    ``batch``, every request drafting k: ``chain_tokens(acceptance, k) / (cost(batch (k +
    width), batch) + k draft_cost)``. ``width``: rows per request besides the chain (1: the
    root; a top-k tree's extra root children add to it and count as cost only);
    ``draft_cost``: one drafted token's time (:func:`relative_cost`), or a function of k
    giving the time of drafting k tokens (a fixed part per drafting call, say). k = 0 drafts
    nothing (no drafting runs): 1.0. ``cost``: as in :func:`payoff`."""
    drafting = draft_cost if callable(draft_cost) else (lambda k: k * draft_cost)
    payoffs, tokens = [1.0], 1.0
    for k in range(1, cap + 1):
        tokens += acceptance ** k  # chain_tokens(acceptance, k), the same sum in the same order
        payoffs.append(payoff(tokens, batch * (k + width), cost, batch=batch, draft_cost=drafting(k)))
    return payoffs


def tree_payoffs(probs, cost, *, batch: int = 1, draft_cost: float = 0.0) -> list:
    """Pay-off of the batch's step when it verifies the first n of ``probs`` (list index n
    = 0..len(probs)): ``(batch + sum(probs[:n])) / (cost(batch + n, batch) + draft_cost)``.
    ``probs``: the candidate nodes' probabilities of being accepted, over the whole batch,
    most probable first (a node's expected tokens are its probability: its path is accepted
    up to it); each request's root is one of the ``batch`` rows and emits one token.
    ``draft_cost``: the drafting time spent for these candidates (:func:`relative_cost`);
    ``cost``: as in :func:`payoff`."""
    total = float(batch)
    values = [payoff(total, batch, cost, batch=batch, draft_cost=draft_cost)]
    for n, p in enumerate(probs, 1):
        total += p
        values.append(payoff(total, batch + n, cost, batch=batch, draft_cost=draft_cost))
    return values


def best_size(payoffs: list) -> tuple[int, float]:
    """(n, payoffs[n]): the smallest n with the highest pay-off (a larger draft must pay
    strictly more)."""
    best = 0
    for n in range(1, len(payoffs)):
        if payoffs[n] > payoffs[best]:
            best = n
    return best, payoffs[best]


def best_chain_length(acceptance: float, cap: int, cost, *, batch: int = 1, width: int = 1,
                      draft_cost=0.0) -> tuple[int, float]:
    """(k, its pay-off per request): the chain length 0..cap with the best pay-off
    (:func:`chain_payoffs`)."""
    return best_size(chain_payoffs(acceptance, cap, cost, batch=batch, width=width, draft_cost=draft_cost))


def best_node_count(probs, cost, *, batch: int = 1, draft_cost: float = 0.0) -> tuple[int, float]:
    """(n, the step's pay-off): how many of the batch's candidate nodes (``probs``, most
    probable first) to verify (:func:`tree_payoffs`)."""
    return best_size(tree_payoffs(probs, cost, batch=batch, draft_cost=draft_cost))


def row_price(value: float, rows: int, cost, batch: int = 1) -> float:
    """The expected tokens one more verified row must bring to raise a step's pay-off
    ``value`` (its expected tokens per unit cost at ``rows`` rows): ``value x (cost(rows +
    1) - cost(rows))``, since (e + p) / (c + dc) > e / c exactly when p > dc e / c. A node
    pays for its row when its probability exceeds this (0 when rows are free)."""
    return (cost(rows + 1, batch) - cost(rows, batch)) * value
