"""Drafting methods, one home each: a method's model or head, its drafter and its training
recipe live together (``ngram``, ``draft_model`` with self-speculation, ``medusa``, ``eagle``).
The Generator drives them through ``decoding.drafter``; ``decoding.registry`` builds them by
name. Nothing is imported here, so that importing one method never loads the others."""
