"""How many CPU threads a run should use: the cores this process may run on that nobody
else is using.

torch's default is every physical core of the machine. On a machine where another process
keeps a core busy, a thread pool of that size waits at every barrier for the thread that
shares the busy core: every matrix product of a decode step slows down ~10x (measured on 2
cores with one busy: ``F.linear`` 194 -> 2,677 us a call, a decode 22-37 -> 2.5 tokens/s).
So the default is the allowed cores (``os.sched_getaffinity``) minus the busy ones, where
"busy" comes from a ~40 ms look at ``/proc/stat`` (per-core time not idle while we sleep),
or from the load average where ``/proc/stat`` cannot be read, and at most torch's own
default (physical cores, so no two threads share a core's SMT siblings). ``--threads N``
(or ``torch.set_num_threads``) overrides it.

Work of lower priority than ours (niced: ``/proc/stat``'s "nice" column, while this process
runs at nice 0 or below) does not make a core busy: the scheduler hands that core to us
(measured on 2 cores with a ``nice -n 19`` compile on one: the 1.5B decoded 68 tokens/s with
2 threads against 40 with 1).
"""
from __future__ import annotations

import os
import time
from typing import NamedTuple

__all__ = ["ThreadChoice", "choose_threads", "apply_threads"]

PROBE_SECONDS = 0.04  # 4 ticks of the usual 100 Hz per-core counters
BUSY_FRACTION = 0.5  # a core busy more than half of the probe is taken


class ThreadChoice(NamedTuple):
    threads: int
    reason: str  # for the stats line, e.g. "2 allowed, 1 busy"

    def describe(self) -> str:
        return f"{self.threads} thread{'s' if self.threads != 1 else ''} ({self.reason})"


def allowed_cpus() -> list[int]:
    """The logical CPUs this process may run on (all of them where affinity is unknown)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _yields_to_us() -> bool:
    """Whether niced work yields its core to this process: we run at nice 0 or below."""
    try:
        return os.getpriority(os.PRIO_PROCESS, 0) <= 0
    except (AttributeError, OSError):
        return False


def _cpu_times(path: str = "/proc/stat") -> dict[int, tuple[int, int]]:
    """{cpu: (busy ticks, total ticks)} from /proc/stat (idle and iowait count as idle, and so
    does niced time where niced work yields to us)."""
    out = {}
    free_niced = _yields_to_us()
    with open(path) as f:
        for line in f:
            if not line.startswith("cpu") or line.startswith("cpu "):
                continue
            name, *fields = line.split()
            ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
            idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0) + (ticks[1] if free_niced else 0)
            out[int(name[3:])] = (sum(ticks) - idle, sum(ticks))
    return out


def busy_cpus(cpus: list[int], probe_s: float = PROBE_SECONDS) -> tuple[list[int], str]:
    """(the CPUs of ``cpus`` that other work keeps busy, how that was found). This process
    sleeps during the probe, so its own threads do not count."""
    try:
        before = _cpu_times()
        time.sleep(probe_s)
        after = _cpu_times()
        busy = []
        for c in cpus:
            if c in before and c in after:
                work = after[c][0] - before[c][0]
                total = after[c][1] - before[c][1]
                if total > 0 and work / total > BUSY_FRACTION:
                    busy.append(c)
        return busy, "probe"
    except (OSError, ValueError, IndexError):
        pass
    try:  # the 1-minute load average spread over the machine's CPUs: how many of ours are taken
        load = os.getloadavg()[0] * len(cpus) / (os.cpu_count() or len(cpus))
        return cpus[: min(len(cpus), int(load + 0.5))], "load average"
    except (AttributeError, OSError):
        return [], "no load information"


def choose_threads(cap: int | None = None) -> ThreadChoice:
    """The thread count for this process: the allowed CPUs not busy with other work (at least
    one), at most ``cap`` (default torch's own default, the physical cores)."""
    cpus = allowed_cpus()
    busy, how = busy_cpus(cpus)
    if cap is None:
        import torch

        cap = torch.get_num_threads()
    free = max(1, len(cpus) - len(busy))
    threads = max(1, min(free, cap))
    reason = f"{len(cpus)} allowed, {len(busy)} busy by {how}"
    if threads < free:
        reason += f", torch's default {cap}"
    return ThreadChoice(threads, reason)


def apply_threads(requested: int | None) -> ThreadChoice:
    """Set torch's thread count: ``requested`` if given (> 0), else :func:`choose_threads`."""
    import torch

    choice = ThreadChoice(requested, "--threads") if requested else choose_threads()
    torch.set_num_threads(choice.threads)
    return choice
