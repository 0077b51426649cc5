"""CUDA: the same PyTorch path on a GPU; decode steps replay CUDA graphs per (row, context) bucket
(worker/runners/cuda_graphs.py). Nothing on this path has run on a GPU in this project unless a
GPU test run says so (tests/engine/test_cuda_graph_runner.py, skipped without CUDA)."""
import torch

from deepinfer.model_executor.static_step import BucketSpec
from deepinfer.platforms.interface import Platform


def cuda_batch_buckets(max_num_seqs: int, interval: int = 8) -> tuple[int, ...]:
    """Powers of two up to `interval`, then every `interval` rows, until max_num_seqs is covered
    (DeepSeek's engine: 1, 2, 4, 8, 16, 24, ...; docs/architecture.md)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs: must be >= 1, got {max_num_seqs}")
    out, b = [1], 1
    while b < max_num_seqs:
        b = b * 2 if b * 2 <= interval else b + interval
        out.append(b)
    return tuple(out)


class CudaPlatform(Platform):
    name = "cuda"
    dist_backend = "nccl"
    runner_strategy = "cuda_graphs"

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def set_device(self, rank: int) -> None:
        torch.cuda.set_device(rank)

    def bucket_spec(self, engine_config) -> BucketSpec:
        """Decode row buckets from max_num_seqs; context buckets powers of two (>= 64) up to
        max_model_len; no prefill bucket (prompt steps run eagerly). With speculative decoding, every
        row bucket also has a verification graph of 1 + num_speculative_tokens tokens a row."""
        return BucketSpec(batch=cuda_batch_buckets(int(engine_config.max_num_seqs)), contexts=None,
                          prefill_tokens=None, max_model_len=engine_config.max_model_len,
                          verify_tokens=1 + int(getattr(engine_config, "num_speculative_tokens", 0) or 0))

    def validate_config(self, engine_config, model_config) -> None:
        if not torch.cuda.is_available():
            raise ValueError("DEEPINFER_ACCELERATOR=cuda but torch sees no CUDA device")
