"""current_platform(): DEEPINFER_ACCELERATOR (cpu | cuda | neuron) wins over detection
(/dev/neuron* -> neuron, CUDA available -> cuda, else cpu). Resolved once per process."""
from __future__ import annotations

import glob

from deepinfer.platforms.interface import Platform

_current: Platform | None = None


def detect() -> str:
    if glob.glob("/dev/neuron*"):
        return "neuron"
    import torch
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def make_platform(name: str) -> Platform:
    if name == "cpu":
        from deepinfer.platforms.cpu import CpuPlatform
        return CpuPlatform()
    if name == "cuda":
        from deepinfer.platforms.cuda import CudaPlatform
        return CudaPlatform()
    if name == "neuron":
        from deepinfer.platforms.neuron.platform import NeuronPlatform
        return NeuronPlatform()
    raise ValueError(f"DEEPINFER_ACCELERATOR: expected cpu, cuda or neuron, got {name!r}")


def current_platform() -> Platform:
    global _current
    if _current is None:
        from deepinfer import envs
        _current = make_platform(envs.get("DEEPINFER_ACCELERATOR") or detect())
    return _current


def reset_platform() -> None:
    """Forget the resolved platform (tests switch DEEPINFER_ACCELERATOR)."""
    global _current
    _current = None
