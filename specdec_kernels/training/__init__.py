"""Training of drafters on a frozen target model.

- :mod:`.medusa_loss`: the Medusa heads' loss (:func:`medusa_loss`), their targets
  (:func:`medusa_targets` for rows of generated tokens, :func:`sequence_targets` for whole
  sequences) and one optimisation step (:func:`train_step`);
- :mod:`.medusa_training`: self-distillation data and the trainer of the shipped heads
  (``specdec train-medusa``);
- :mod:`.medusa_prompts`: the synthetic instruction prompts it answers.
"""
from .medusa_loss import medusa_loss, medusa_targets, sequence_targets, train_step

__all__ = ["medusa_loss", "medusa_targets", "sequence_targets", "train_step"]
