"""Runner strategies by name: the platform says which one it runs (`Platform.runner_strategy`), the
worker builds it. Kept here, not in platforms/, so the platform never imports worker code."""
from deepinfer.worker.runners.base import RunnerStrategy
from deepinfer.worker.runners.cpu_compiled import CpuCompiledStrategy
from deepinfer.worker.runners.cuda_graphs import CudaGraphStrategy
from deepinfer.worker.runners.eager import EagerStrategy
from deepinfer.worker.runners.neuron_regions import NeuronRegionStrategy

STRATEGIES: dict[str, type[RunnerStrategy]] = {
    EagerStrategy.name: EagerStrategy,
    CudaGraphStrategy.name: CudaGraphStrategy,
    NeuronRegionStrategy.name: NeuronRegionStrategy,
    CpuCompiledStrategy.name: CpuCompiledStrategy,
}


def strategy_class(name: str) -> type[RunnerStrategy]:
    if name not in STRATEGIES:
        raise ValueError(f"runner strategy: expected one of {sorted(STRATEGIES)}, got {name!r}")
    return STRATEGIES[name]


__all__ = ["STRATEGIES", "CpuCompiledStrategy", "CudaGraphStrategy", "EagerStrategy", "NeuronRegionStrategy", "RunnerStrategy",
           "strategy_class"]
