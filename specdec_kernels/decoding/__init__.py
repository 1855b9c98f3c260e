"""The speculative decode loop: the Generator, the interface drafters implement
(``drafter``), the registry that builds them by name (``registry``), speculation-length
schedules, the pay-off model (``cost_model``), statistics. The drafting methods themselves
are in ``specdec_kernels.drafting``."""
from .drafter import Draft, Drafter
from .generator import Generator, Request, SamplingParams
from .registry import DRAFTERS, make_drafter
from .schedule import SpecSchedule
from .stats import RequestStats

__all__ = ["Draft", "Drafter", "Generator", "Request", "SamplingParams", "DRAFTERS", "make_drafter", "SpecSchedule",
           "RequestStats"]
