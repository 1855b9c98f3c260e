"""Speculative decode loop, drafters, speculation-length schedules, statistics."""
from .drafters import (Draft, Drafter, MedusaDrafter, MedusaHeadWeights, ModelDrafter, NgramDrafter,
                       SelfSpecDrafter)
from .generator import Generator, Request, SamplingParams
from .schedule import SpecSchedule
from .stats import RequestStats

__all__ = ["Draft", "Drafter", "MedusaDrafter", "MedusaHeadWeights", "ModelDrafter", "NgramDrafter",
           "SelfSpecDrafter", "Generator", "Request", "SamplingParams", "SpecSchedule", "RequestStats"]
