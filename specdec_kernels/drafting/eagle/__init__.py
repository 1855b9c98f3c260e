"""EAGLE: the feature-level draft head (``head``), the dynamic-tree drafter (``drafter``) and
``specdec train-eagle`` (``training``)."""
