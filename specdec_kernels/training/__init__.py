"""What the drafters' training recipes share (each recipe lives with its method in
``specdec_kernels.drafting``):

- :mod:`.distill_data`: the target's features and answers, cached in shards: self-distilled
  answers to prompts and teacher-forced features over real code;
- :mod:`.prompts`: the synthetic instruction prompts the target answers;
- :mod:`.recipe`: the learning-rate schedule, the validation prompts, the reduced draft
  vocabulary and the acceptance check by real decoding.
"""
