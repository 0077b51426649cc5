"""CPU: the PyTorch path on the host. Steps run eagerly by default; with DEEPINFER_CPU_COMPILE=1
decode and verification steps run through compiled decoder-layer regions (worker/runners/cpu_compiled.py:
the region runner and static buckets of Neuron host mode, neuron_ops/regions.py and
model_executor/static_step.py, compiled by DEEPINFER_CPU_COMPILE_BACKEND), prompt steps eagerly with
fused elementwise kernels (worker/runners/prompt_kernels.py).
`enforce_eager` (or DEEPINFER_CPU_COMPILE=0) is the eager fallback."""
from deepinfer import envs
from deepinfer.model_executor.static_step import BucketSpec
from deepinfer.platforms.host_allocator import keep_freed_memory
from deepinfer.platforms.interface import Platform
from deepinfer.platforms.neuron.buckets import batch_buckets, default_context_buckets


class CpuPlatform(Platform):
    name = "cpu"
    dist_backend = "gloo"
    # Measured (README "Weight formats"): the packed references dequantize every weight on every step,
    # which costs more than these CPUs' dense GEMMs; memory is not the limit on the tiny checkpoints.
    default_weight_format = "dense"
    # the float8 guard of Neuron host mode (worker/runners/neuron_regions.py): no device rule to check here
    fp8_guard = False

    def set_device(self, rank: int) -> None:
        """No device to pick; the rank's process keeps its freed step buffers mapped instead
        (platforms/host_allocator.py), unless DEEPINFER_CPU_KEEP_FREED_MEMORY=0."""
        if envs.get("DEEPINFER_CPU_KEEP_FREED_MEMORY"):
            keep_freed_memory()

    @property
    def runner_strategy(self) -> str:
        return "cpu_compiled" if envs.get("DEEPINFER_CPU_COMPILE") else "eager"

    def bucket_spec(self, engine_config) -> BucketSpec | None:
        """The compiled runner's shapes (None when steps run eagerly, so a test's own strategy keeps its
        buckets). Decode row buckets: powers of two up to next_pow2(max_num_seqs) (a padded row costs a
        row of every GEMM, and this CPU's small-row GEMMs grow with the rows: layers/head_gemm.py); the
        power-of-two context buckets up to max_model_len (platforms/neuron/buckets.py); no prompt
        buckets (prompt steps run eagerly). With speculative decoding every row bucket also has a
        verification shape of 1 + num_speculative_tokens tokens a row."""
        if self.runner_strategy != "cpu_compiled":
            return None
        return BucketSpec(batch=batch_buckets(int(engine_config.max_num_seqs)),
                          contexts=default_context_buckets(engine_config.max_model_len), prefill_tokens=None,
                          max_model_len=engine_config.max_model_len,
                          verify_tokens=1 + int(getattr(engine_config, "num_speculative_tokens", 0) or 0))

    def signature(self) -> dict:
        return {**super().signature(), "compile_backend": envs.get("DEEPINFER_CPU_COMPILE_BACKEND")}

    def region_runner(self):
        from deepinfer.neuron_ops.regions import RegionRunner
        return RegionRunner(backend=envs.get("DEEPINFER_CPU_COMPILE_BACKEND"), split="never")
