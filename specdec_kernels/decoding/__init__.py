"""Speculative decode loop, drafters (and the registry of drafters by name), speculation-length
schedules, statistics."""
from .drafters import (Draft, Drafter, MedusaDrafter, ModelDrafter, NgramDrafter, NgramTreeDrafter,
                       SelfSpecDrafter, medusa_heads_for)
from .generator import Generator, Request, SamplingParams
from .registry import DRAFTERS, make_drafter
from .schedule import SpecSchedule
from .stats import RequestStats

__all__ = ["Draft", "Drafter", "MedusaDrafter", "ModelDrafter", "NgramDrafter", "NgramTreeDrafter",
           "SelfSpecDrafter", "medusa_heads_for", "Generator", "Request", "SamplingParams", "DRAFTERS", "make_drafter",
           "SpecSchedule", "RequestStats"]
