"""Per-request speculative decoding statistics."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestStats:
    steps: int = 0  # verification steps (target forwards), excluding the prefill
    emitted: int = 0  # tokens produced (accepted drafts + one recovered/bonus token per step)
    drafted: int = 0  # draft tree nodes verified (excluding the root)
    accepted: int = 0  # draft tokens accepted
    drafted_per_pos: list = field(default_factory=list)  # steps whose tree reached depth d+1
    accepted_per_pos: list = field(default_factory=list)  # steps that accepted a token at depth d+1
    prefill_tokens: int = 0  # prompt tokens the prefill forward ran (all but the last, the first root)
    time_prefill: float = 0.0  # the target's prefill of the prompt and the drafter's (a draft model's prefill)
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_sample: float = 0.0
    time_compact: float = 0.0

    def record(self, depth: int, nodes: int, accepted: int, emitted: int) -> None:
        self.steps += 1
        self.drafted += nodes
        self.accepted += accepted
        self.emitted += emitted
        for lst, n in ((self.drafted_per_pos, depth), (self.accepted_per_pos, accepted)):
            while len(lst) < n:
                lst.append(0)
            for d in range(n):
                lst[d] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target forward, the bonus token included (1.0 = no speedup)."""
        return self.emitted / self.steps if self.steps else 0.0

    @property
    def acceptance_per_pos(self) -> list:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos + [0] * len(self.drafted_per_pos), self.drafted_per_pos)]

    @property
    def total_time(self) -> float:
        return self.time_draft + self.time_verify + self.time_sample + self.time_compact

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens emitted per second of the decode steps (drafting, verification, sampling,
        compaction), prefill excluded: the generation rate llama.cpp and vLLM report. In a
        batch the steps' times are the whole batch's, so this is the request's share."""
        return self.emitted / self.total_time if self.total_time > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens per second of the prefill (the prompt-processing rate): the target's
        forward and the drafter's own work on the prompt (a draft model's prefill)."""
        return self.prefill_tokens / self.time_prefill if self.time_prefill > 0 else 0.0

    def summary(self) -> dict:
        return {
            "steps": self.steps, "emitted": self.emitted, "drafted": self.drafted, "accepted": self.accepted,
            "mean_accepted_length": round(self.mean_accepted_length, 3),
            "acceptance_per_pos": [round(a, 3) for a in self.acceptance_per_pos],
            "drafted_per_pos": self.drafted_per_pos, "accepted_per_pos": self.accepted_per_pos,
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 3),
            "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 3),
            "time_s": {k: round(getattr(self, "time_" + k), 4) for k in ("prefill", "draft", "verify", "sample", "compact")},
        }

    def format(self) -> str:
        t = self.summary()["time_s"]
        acc = " ".join(f"{a:.2f}" for a in self.acceptance_per_pos[:8])
        return (f"decode {self.decode_tokens_per_s:.1f} tokens/s, prefill {self.prefill_tokens_per_s:.1f} tokens/s "
                f"({self.prefill_tokens} prompt tokens in {t['prefill']:.2f}s); steps {self.steps}, tokens {self.emitted}, mean accepted length {self.mean_accepted_length:.2f} "
                f"(incl. bonus), drafted {self.drafted}, accepted {self.accepted}; acceptance by position [{acc}]; "
                f"time draft {t['draft']:.2f}s verify {t['verify']:.2f}s sample {t['sample']:.3f}s "
                f"compact {t['compact']:.3f}s")
