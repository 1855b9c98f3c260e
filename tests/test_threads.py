"""specdec_kernels.threads: the default thread count is the allowed cores that are not busy."""
import os

import pytest
import torch

from specdec_kernels import threads


def stat(ticks):
    """/proc/stat text for per-CPU (busy, idle) tick counts."""
    lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
    lines += [f"cpu{c} {busy} 0 0 {idle} 0 0 0 0 0 0" for c, (busy, idle) in ticks.items()]
    return "\n".join(lines) + "\nintr 0\n"


@pytest.fixture
def fake_machine(monkeypatch, tmp_path):
    """Four allowed CPUs; CPU 2 stays busy between the probe's two readings."""
    monkeypatch.setattr(threads, "allowed_cpus", lambda: [0, 1, 2, 3])
    readings = iter([{0: (10, 90), 1: (10, 90), 2: (10, 90), 3: (10, 90)},
                     {0: (11, 93), 1: (10, 94), 2: (14, 90), 3: (12, 92)}])
    path = tmp_path / "stat"

    def cpu_times(p="/proc/stat"):
        path.write_text(stat(next(readings)))
        return real(str(path))

    real = threads._cpu_times
    monkeypatch.setattr(threads, "_cpu_times", cpu_times)


def test_busy_cores_are_left_out(fake_machine):
    choice = threads.choose_threads(cap=8)
    assert choice.threads == 3 and choice.reason == "4 allowed, 1 busy by probe"
    assert choice.describe() == "3 threads (4 allowed, 1 busy by probe)"


def test_at_most_torch_default_and_at_least_one(fake_machine, monkeypatch):
    assert threads.choose_threads(cap=2) == threads.ThreadChoice(2, "4 allowed, 1 busy by probe, torch's default 2")
    monkeypatch.setattr(threads, "busy_cpus", lambda cpus, probe_s=0: (cpus, "probe"))  # every core busy
    assert threads.choose_threads(cap=8).threads == 1


def test_niced_work_leaves_a_core_free_unless_we_are_niced(monkeypatch, tmp_path):
    """CPU 1 spends the probe on niced work (the "nice" column): it yields to a process at
    nice 0, so that core is ours; a niced process of our own competes with it as equals."""
    monkeypatch.setattr(threads, "allowed_cpus", lambda: [0, 1])
    path = tmp_path / "stat"
    readings = iter(["cpu0 10 0 0 90 0 0 0 0\ncpu1 10 0 0 90 0 0 0 0\n",
                     "cpu0 11 0 0 93 0 0 0 0\ncpu1 10 4 0 90 0 0 0 0\n"] * 2)
    real = threads._cpu_times

    def cpu_times(p="/proc/stat"):
        path.write_text("cpu  0 0 0 0 0 0 0 0\n" + next(readings))
        return real(str(path))

    monkeypatch.setattr(threads, "_cpu_times", cpu_times)
    monkeypatch.setattr(os, "getpriority", lambda which, who: 0)
    assert threads.choose_threads(cap=2) == threads.ThreadChoice(2, "2 allowed, 0 busy by probe")
    monkeypatch.setattr(os, "getpriority", lambda which, who: 10)
    assert threads.choose_threads(cap=2) == threads.ThreadChoice(1, "2 allowed, 1 busy by probe")


def test_load_average_without_proc_stat(monkeypatch):
    monkeypatch.setattr(threads, "allowed_cpus", lambda: [0, 1])
    monkeypatch.setattr(threads, "_cpu_times", lambda p="/proc/stat": (_ for _ in ()).throw(OSError("no /proc")))
    monkeypatch.setattr(os, "getloadavg", lambda: (1.1, 1.0, 1.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert threads.choose_threads(cap=2) == threads.ThreadChoice(1, "2 allowed, 1 busy by load average")


def test_the_real_probe_is_cheap_and_sane():
    import time

    t0 = time.perf_counter()
    choice = threads.choose_threads()
    assert time.perf_counter() - t0 < 0.5  # ~40 ms of sleep
    assert 1 <= choice.threads <= max(1, torch.get_num_threads())


def test_apply_threads_sets_torch(monkeypatch):
    before = torch.get_num_threads()
    try:
        assert threads.apply_threads(1) == threads.ThreadChoice(1, "--threads")
        assert torch.get_num_threads() == 1
        monkeypatch.setattr(threads, "choose_threads", lambda cap=None: threads.ThreadChoice(2, "test"))
        assert threads.apply_threads(0).threads == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
