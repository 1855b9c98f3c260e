"""Which kernel the model's dense products use at which row count (``ops.linear``'s
``skinny_rows``): a rule measured on the development machine, kept here with the model
rather than in the op layer, which only does what it is told.

The rule is fixed, not measured at run time (``decoding.cost_model`` measures step costs):
a crossover found anew in each process could send a product to a different kernel — and
so a different rounding — from one run to the next. Block (GGUF) weights do not use it:
every row count goes to their block kernel.
"""
from __future__ import annotations

import torch

# Largest number of rows for which the model uses skinny_linear instead of F.linear on CPU.
# Measured with `python bench/bench_medusa.py --threads 1` (its skinny_linear part is now
# bench/bench_linear.py) on the 2-core dev machine (torch 2.13, MKL/oneDNN, a CPU with
# AVX-512 and AMX) over the SmolLM2 layer shapes [1536, 576], [576, 1536], [576, 576],
# [192, 576], [49152, 576], with "cold" weights (each call takes the next of a pool of
# copies larger than the 300 MB L3, as in a decode step where the other layers evicted
# this one; bench/results/linear.json). fp32: F.linear time / skinny_linear time =
# 1.1-1.8x at M = 4 and 8 on every shape, 0.84-1.03x at M = 1-2 on the small shapes but
# 1.0-1.7x on the LM head, mixed from M = 16 (MKL's AVX-512 GEMM wins once the kernel is
# compute bound). bf16: oneDNN's bf16 GEMM (AMX) wins from M = 4 (skinny_linear 1.1-1.5x
# faster at M = 1-2). With the weight hot in L2 (a microbenchmark calling one small layer
# in a loop) F.linear wins on [576, 576] and [192, 576] at every M. (2-thread wall-clock
# medians on the shared machine were dominated by preemption.)
SKINNY_LINEAR_MAX_ROWS = 8
SKINNY_LINEAR_MAX_ROWS_BF16 = 2


def skinny_linear_rows(dtype: torch.dtype, num_threads: int | None = None) -> tuple[int, int]:
    """(min_rows, max_rows): the model's products use skinny_linear for min_rows <= rows <= max_rows,
    for ``dtype`` and ``num_threads`` torch threads (default: torch.get_num_threads()).

    fp32 with one thread, measured on the whole SmolLM2-135M forward (30 layers + LM head,
    fresh weights each product as in decoding; one process, medians of 5, 2-core shared
    machine, torch 2.13): F.linear / skinny_linear time = 0.90 at T = 1 row (55 vs 61 ms),
    0.94 at 2, 1.00 at 3, 1.54 at 5 (100 vs 65 ms), 1.52-1.65 at 8 (114 vs 69 ms), 1.68 at
    12 (143 vs 85 ms), 0.92 at 20 (121 vs 131 ms) — MKL's single-threaded GEMV is the best
    at 1-2 rows but its small-M GEMM is not, so skinny for 3..15 rows. (Greedy
    autoregressive decoding alone: 32 vs 26 tokens/s with F.linear.) Re-measured for 8-24
    rows (linears only, quiet machine): F.linear / skinny = 89/58 ms at 8, 105/64 at 12,
    109/71 at 13, 115/85 at 14, 91/90 at 16, 92/99 at 20, 100/129 at 24 — the range ended at
    12 before, which made a 13-row verification step 2x slower than a 12-row one.
    Otherwise (bf16, or several threads): 1..SKINNY_LINEAR_MAX_ROWS (fp32) /
    SKINNY_LINEAR_MAX_ROWS_BF16, the per-shape measurement in the comment above them.
    """
    max_rows = SKINNY_LINEAR_MAX_ROWS if dtype == torch.float32 else SKINNY_LINEAR_MAX_ROWS_BF16
    threads = num_threads if num_threads is not None else torch.get_num_threads()
    if threads <= 1 and dtype == torch.float32:
        return 3, 15
    return 1, max_rows
