"""Draft models and self-speculation exit heads: the model files (``model``), the drafter
(``drafter``) and ``specdec train-draft`` (``training``)."""
