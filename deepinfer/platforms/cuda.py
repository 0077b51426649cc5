"""CUDA: the same PyTorch path on a GPU (CUDA graphs per batch bucket come with the CUDA runner)."""
import torch

from deepinfer.platforms.interface import Platform


class CudaPlatform(Platform):
    name = "cuda"
    dist_backend = "nccl"

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def num_devices(self) -> int:
        return torch.cuda.device_count()

    def set_device(self, rank: int) -> None:
        torch.cuda.set_device(rank)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info()

    def validate_config(self, engine_config, model_config) -> None:
        if not torch.cuda.is_available():
            raise ValueError("DEEPINFER_ACCELERATOR=cuda but torch sees no CUDA device")
