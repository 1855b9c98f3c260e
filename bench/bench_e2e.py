"""End-to-end benchmark (see specdec_kernels/decoding/benchmark.py), run from the repo root:

    python bench/bench_e2e.py [--prompts ../shared/data/spec_bench_dev.jsonl] [--max-prompts N] [--max-new-tokens N]

Writes bench/results/<name>.json and <name>_speedup.png (--out-name; default e2e, or
e2e_spec_bench for a spec_bench*.jsonl prompt file).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402,F401  (loads libtorch before the extension)

from specdec_kernels.decoding.benchmark import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
