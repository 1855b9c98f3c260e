"""Shared benchmark helpers: timing (median and spread of repeated runs), the machine's
measured copy bandwidth and matmul throughput, and JSON results under bench/results/.

This machine is noisy, so every number is a median of repeated runs, and every kernel's
bandwidth is reported as a fraction of the copy bandwidth measured in the same run.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def code_prompts(row: dict) -> list[tuple[str, str]]:
    """[(category, user text)]: the two chat prompts built from one code-task row
    ({task_id, prompt, canonical_solution, entry_point}: a function's signature and docstring,
    its body, its name; from the caller's --prompts file):

    - "completion": write the body of the function whose signature and docstring are given
      (the answer restates the signature and docstring, which prompt lookup can copy);
    - "edit": the whole function, body included, and a small change to make (rename the
      function): the answer copies most of its input.
    """
    stub, body, name = row["prompt"], row["canonical_solution"], row["entry_point"]
    completion = ("Complete the following Python function. Reply with the complete function in one code "
                  f"block.\n\n```python\n{stub}```")
    edit = (f"Rename the function `{name}` to `{name}_v2` everywhere, docstring examples included, and change "
            f"nothing else. Reply with the complete updated code in one code block.\n\n```python\n{stub}{body}```")
    return [("completion", completion), ("edit", edit)]


def time_fn(fn, *, warmup: int = 3, reps: int = 20, min_time_s: float = 0.0) -> dict:
    """Run ``fn()`` ``warmup`` times, then at least ``reps`` times (and at least
    ``min_time_s`` seconds); return median, min, p25, p75 in microseconds."""
    for _ in range(warmup):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < reps or time.perf_counter() - start < min_time_s:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    return {"median_us": statistics.median(times), "min_us": times[0], "p25_us": q[0], "p75_us": q[2], "reps": len(times)}


def copy_bandwidth_gbs(nbytes: int = 256 * 2**20, reps: int = 15) -> float:
    """Measured copy bandwidth in GB/s (bytes read + bytes written, per second), median
    over ``reps`` copies of a buffer much larger than the caches."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), warmup=2, reps=reps)
    return 2 * nbytes / (t["median_us"] * 1e-6) / 1e9


def matmul_gflops(n: int = 1024, reps: int = 10, dtype=torch.float32) -> float:
    """Measured fp32 matmul throughput in GFLOP/s (median over ``reps``)."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    t = time_fn(lambda: torch.mm(a, b), warmup=2, reps=reps)
    return 2 * n**3 / (t["median_us"] * 1e-6) / 1e9


def machine_info() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def add_out_name(parser, default: str) -> None:
    """``--out-name``: the results file's name, so a run on another machine or with other
    settings does not write over the committed results of the default run."""
    parser.add_argument("--out-name", default=None,
                        help=f"results file name under bench/results/, without .json (default: {default})")


def write_results(name: str, payload: dict, out_dir: str | Path = RESULTS_DIR) -> Path:
    """Write ``payload`` (plus machine info) to <out_dir>/<name>.json (default
    bench/results/); return the path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"machine": machine_info(), **payload}, indent=2) + "\n")
    return path


def print_table(rows: list[dict], columns: list[str]) -> None:
    """Print ``rows`` as an aligned text table with the given columns."""
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
