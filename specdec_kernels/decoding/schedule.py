"""Speculation-length schedules: how many tokens to draft for a request at the next step."""
from __future__ import annotations


class SpecSchedule:
    """``constant``: always ``k``. ``heuristic``: start at ``k``; +2 after a step whose drafts
    were all accepted, -1 otherwise (within [1, max_k]). ``adaptive``: an exponential moving
    average of the acceptance rate (accepted / drafted) moves the length by one per step
    towards the rate ``target`` (up while the average is above it, down while below), within
    [2, 8]. ``max``: always ``max_k`` — for drafters that size their own drafts
    (``NgramTreeDrafter`` keeps only the nodes worth their verification cost, so the length is
    only a cap on its depth)."""

    KINDS = ("constant", "heuristic", "adaptive", "max")

    def __init__(self, kind: str = "constant", k: int = 4, *, max_k: int = 16, target: float = 0.75,
                 ema: float = 0.3, min_k: int = 1):
        if kind not in self.KINDS:
            raise ValueError(f"schedule must be one of {self.KINDS}, got {kind!r}")
        self.kind, self.k0, self.target, self.alpha = kind, k, target, ema
        self.min_k, self.max_k = (2, 8) if kind == "adaptive" else (min_k, max_k)
        self.k0 = min(max(k, self.min_k), self.max_k) if kind != "constant" else k
        self._k: dict[int, int] = {}
        self._rate: dict[int, float] = {}

    def length(self, rid: int) -> int:
        if self.kind == "max":
            return self.max_k
        return self._k.get(rid, self.k0)

    def update(self, rid: int, drafted: int, accepted: int) -> None:
        if self.kind in ("constant", "max") or drafted <= 0:
            return
        k = self.length(rid)
        if self.kind == "heuristic":
            k = k + 2 if accepted >= drafted else k - 1
        else:
            rate = accepted / drafted
            ema = self._rate.get(rid, self.target)
            ema = (1 - self.alpha) * ema + self.alpha * rate
            self._rate[rid] = ema
            k = k + 1 if ema > self.target else k - 1
        self._k[rid] = min(max(k, self.min_k), self.max_k)
