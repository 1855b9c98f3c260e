"""Speculative decode loop, drafters, speculation-length schedules, statistics."""
from .drafters import (Draft, Drafter, MedusaDrafter, ModelDrafter, NgramDrafter, NgramTreeDrafter,
                       SelfSpecDrafter, medusa_heads_for)
from .generator import Generator, Request, SamplingParams
from .schedule import SpecSchedule
from .stats import RequestStats

__all__ = ["Draft", "Drafter", "MedusaDrafter", "ModelDrafter", "NgramDrafter", "NgramTreeDrafter",
           "SelfSpecDrafter", "medusa_heads_for", "Generator", "Request", "SamplingParams", "SpecSchedule", "RequestStats"]
