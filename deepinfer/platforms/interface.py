"""The Platform interface (design.md §3): everything that differs per accelerator."""
from __future__ import annotations

import torch


class Platform:
    name: str = "base"
    dist_backend: str = "gloo"
    fp8_max: float = 448.0          # OCP e4m3fn; trn2's IEEE e4m3 tops out at 240
    is_host_mode: bool = False

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def graph_runner_cls(self):
        from deepinfer.worker.graph_runner import EagerRunner
        return EagerRunner

    def num_devices(self) -> int:
        return 1

    def set_device(self, rank: int) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the memory the KV pool is carved from."""
        import os
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        avail = os.sysconf("SC_AVPHYS_PAGES") * page
        return avail, pages * page

    def supports_fp8_dtype(self) -> bool:
        return True

    def validate_config(self, engine_config, model_config) -> None:
        """Raise ValueError for what this backend cannot run."""

    def kernel(self, name: str):
        """The implementation of a named kernel (see deepinfer/model_executor/layers/kernels.py)."""
        from deepinfer.model_executor.layers import kernels
        return kernels.reference(name)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"
