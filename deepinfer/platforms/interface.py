"""The Platform interface (docs/architecture.md): everything that differs per accelerator.

The engine and the worker ask; the platform answers and never imports worker or engine code
(tests/repo/test_import_cycles.py). Every member here is used by the engine.
"""
from __future__ import annotations

import torch


class Platform:
    name: str = "base"
    dist_backend: str = "gloo"      # torch.distributed backend of this platform's ranks
    # Largest magnitude the engine itself encodes as fp8 e4m3 (compact KV records): OCP e4m3fn holds
    # 448. Neuron lowers this to 224: trn2 reads the bytes as IEEE e4m3, whose max is 240.
    fp8_max: float = 448.0
    is_host_mode: bool = False
    # Which runner strategy runs a step (deepinfer/worker/runners/: "eager", "cuda_graphs",
    # "neuron_regions"), by name so the platform never imports the worker.
    runner_strategy: str = "eager"
    # weight_format="auto": where the weights live in their checkpoint formats (see each platform)
    default_weight_format: str = "packed"
    # compiled region runners: skip Dynamo's non-tensor guards on steps whose bucket and layout ran
    # clean before (worker/runners/warm_guards.py)
    skip_warm_guards: bool = False

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def set_device(self, rank: int) -> None:
        """Select the device of local rank `rank`; the worker calls it first, before the model exists."""

    def bucket_spec(self, engine_config):
        """Static step shapes of this platform's runner strategy (a model_executor.static_step.BucketSpec),
        or None when steps run as they come (eager)."""
        return None

    def fp8_weight_codes(self, codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The bytes this platform's fp8 GEMM kernels read for a packed e4m3 weight (uint8 codes, uint8
        ue8m0 exponents), converted once at load. The checkpoint's own bytes by default."""
        return codes, scale

    def kernel_weight_layouts(self, model) -> None:
        """Store the model's packed weights in the layouts this platform's kernels read, once after
        loading (after fp8_weight_codes). The checkpoint layout by default: nothing to do."""

    def validate_config(self, engine_config, model_config) -> None:
        """Raise ValueError for what this backend cannot run."""

    def kernel(self, name: str):
        """The implementation of a named kernel (see deepinfer/model_executor/layers/kernel_table.py)."""
        from deepinfer.model_executor.layers import kernel_table
        return kernel_table.reference(name)

    def signature(self) -> dict:
        """What must be the same on every rank of one model: the platform and every setting that
        changes its graphs, kernels or weight layout. The driver publishes its own; a rank whose own
        differs (another host's environment, or a process that changed DEEPINFER_* after its first
        engine) stops at start-up with the difference (executor/rank_bootstrap.py)."""
        return {"platform": self.name, "host_mode": bool(self.is_host_mode), "runner": self.runner_strategy,
                "default_weight_format": self.default_weight_format, "fp8_max": float(self.fp8_max)}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"
