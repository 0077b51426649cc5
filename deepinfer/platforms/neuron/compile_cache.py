"""The persistent compile cache of a Neuron engine (docs/neuron.md §2.3, §5.10).

Every rank compiles the same region graphs, and a graph costs minutes of neuronx-cc, so compiled
NEFFs are kept in one directory across runs: `EngineConfig.compile_cache_dir`, else
DEEPINFER_NEURON_COMPILE_CACHE_DIR, else ~/.cache/deepinfer/neuron-compile ($XDG_CACHE_HOME when set).
On a device the directory is handed to torch-neuronx before its runtime starts; host mode compiles
with a CPU backend, records the directory and writes nothing there.
"""
from __future__ import annotations

import os
from collections.abc import MutableMapping

from deepinfer import envs

# The torch-neuronx variables that name its persistent cache: TORCH_NEURONX_NEFF_CACHE_DIR (the
# native TorchNeuron backend's NEFF cache) and NEURON_COMPILE_CACHE_URL (the torch-xla based
# torch-neuronx). Neither has been seen working here (docs/neuron.md §8).
DEVICE_CACHE_VARS = ("TORCH_NEURONX_NEFF_CACHE_DIR", "NEURON_COMPILE_CACHE_URL")


def default_dir() -> str:
    return envs.user_cache_dir("neuron-compile")


def resolve_dir(engine_value: str | None) -> str:
    """The cache directory (absolute): the engine option, else the env var, else default_dir()."""
    chosen = engine_value or envs.get("DEEPINFER_NEURON_COMPILE_CACHE_DIR") or default_dir()
    return os.path.abspath(os.path.expanduser(chosen))


def configure_device_cache(path: str, environ: MutableMapping[str, str]) -> dict[str, str]:
    """Create `path` and point each DEVICE_CACHE_VARS at it, keeping any the user set already.
    Returns the variables as they now are."""
    os.makedirs(path, exist_ok=True)
    for name in DEVICE_CACHE_VARS:
        environ.setdefault(name, path)
    return {name: environ[name] for name in DEVICE_CACHE_VARS}


def neff_files(path: str | None) -> int:
    """NEFF files under `path` (0 when it does not exist): a warm-up compares the count before and after."""
    if not path or not os.path.isdir(path):
        return 0
    return sum(name.endswith(".neff") for _, _, names in os.walk(path) for name in names)
