"""Medusa: the heads (``heads``), their loss (``loss``), the drafter (``drafter``) and
``specdec train-medusa`` (``training``)."""
