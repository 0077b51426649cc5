"""CUDA: the same PyTorch path on a GPU; decode steps replay CUDA graphs per (row, context) bucket
(worker/cuda_graph_runner.py). Nothing on this path has run on a GPU in this project unless a
GPU test run says so (tests/test_cuda_graph_runner.py, skipped without CUDA)."""
import torch

from deepinfer.platforms.interface import Platform


class CudaPlatform(Platform):
    name = "cuda"
    dist_backend = "nccl"

    def __init__(self):
        self.engine_limits: dict = {}

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    @property
    def graph_runner_cls(self):
        from deepinfer.worker.cuda_graph_runner import CudaGraphRunner
        return CudaGraphRunner.for_platform(self)

    def bucket_spec(self, max_num_seqs: int):
        """Decode row buckets from max_num_seqs; context buckets powers of two (>= 64) up to
        max_model_len; no prefill bucket (prompt steps run eagerly)."""
        from deepinfer.worker.cuda_graph_runner import cuda_batch_buckets
        from deepinfer.worker.static_step import BucketSpec
        lim = self.engine_limits
        return BucketSpec(batch=cuda_batch_buckets(int(lim.get("max_num_seqs", max_num_seqs))), contexts=None,
                          prefill_tokens=None, max_model_len=lim.get("max_model_len"))

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
        self.engine_limits = {"max_num_seqs": int(engine_config.max_num_seqs),
                              "max_model_len": engine_config.max_model_len}
