"""deepinfer: an inference engine for DeepSeek V4 / V4.1 (Trainium2-first, with a CPU host mode)."""
__version__ = "0.1.0"

from deepinfer.logging_config import configure_logging as _configure_logging

# DEEPINFER_LOG_LEVEL takes effect for every deepinfer logger from the first import on.
_configure_logging()

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name):
    # Lazy so `import deepinfer` (and envs / platforms) stays light.
    if name == "LLM":
        from deepinfer.entrypoints.llm import LLM
        return LLM
    if name == "SamplingParams":
        from deepinfer.sampling_params import SamplingParams
        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from deepinfer import outputs
        return getattr(outputs, name)
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
