"""CPU: the PyTorch path on the host. Steps run eagerly by default; with DEEPINFER_CPU_COMPILE=1
decode and verification steps run compiled (worker/runners/cpu_compiled.py: the region runner and
static buckets of Neuron host mode, neuron_ops/regions.py and model_executor/static_step.py, compiled
by DEEPINFER_CPU_COMPILE_BACKEND), each step one graph by default (DEEPINFER_CPU_COMPILE_SCOPE=step;
`layer` compiles Neuron's per-layer regions), prompt steps eagerly with fused elementwise kernels
(worker/runners/prompt_kernels.py), or compiled in DEEPINFER_CPU_PREFILL_BUCKETS' buckets.
`enforce_eager` (or DEEPINFER_CPU_COMPILE=0) is the eager fallback."""
import logging

import torch

from deepinfer import envs
from deepinfer.model_executor.static_step import BucketSpec
from deepinfer.platforms.host_allocator import keep_freed_memory
from deepinfer.platforms.huge_pages import on_huge_pages
from deepinfer.platforms.interface import Platform
from deepinfer.platforms.neuron.buckets import batch_buckets, check_prompt_buckets, default_context_buckets

logger = logging.getLogger(__name__)


def _bf16_head_copy(weight: torch.Tensor, kernel: str) -> torch.Tensor | None:
    """The bf16 copy of one fp32 head for `kernel` (tiles: packed for AMX; rows: row-major), or None
    where the head is not bf16-valued or no kernel that suits it is usable here."""
    from deepinfer.model_executor.layers import bf16_rows_gemm, bf16_tiles_gemm
    copy = bf16_rows_gemm.exact_bf16_copy(weight)
    if copy is None:
        return None
    fits_tiles = copy.shape[0] % bf16_tiles_gemm.ROWS == 0 and copy.shape[1] % bf16_tiles_gemm.COLS == 0
    # on huge pages: every step reads the whole copy (platforms/huge_pages.py)
    if kernel in ("auto", "tiles") and fits_tiles and bf16_tiles_gemm.available():
        return on_huge_pages(bf16_tiles_gemm.tile_view(copy))   # packed by the copy into the buffer
    if kernel in ("auto", "rows") and bf16_rows_gemm.available():
        return on_huge_pages(copy)
    return None


def keep_bf16_head(model, kernel: str = "auto") -> bool:
    """Add `weight_bf16` (a non-persistent buffer, out of the state dict) to each vocabulary-wide head
    (the LM head; a V4.1 model's DSpark Markov head, models/dspark_draft.py; their draft-vocabulary rows,
    models/draft_vocab.py) that is fp32 and bf16-valued,
    when a kernel for it is usable here and the rank runs one torch thread; True when one got it.
    `kernel` (DEEPINFER_CPU_BF16_HEAD_KERNEL): tiles packs the copy for the AMX kernel
    (layers/bf16_tiles_gemm.py), rows keeps it row-major for the vector kernel
    (layers/bf16_rows_gemm.py), auto takes tiles where it can. The kernels run on one thread: with two,
    torch's fp32 GEMM reads the fp32 head on both cores as fast as the rows kernel reads the bf16 one on
    one (`examples/bench/bench_bf16_head.py --threads 2`: 0.99x at 1 row, 0.88x at 8), so a
    multi-threaded rank keeps the GEMM."""
    if torch.get_num_threads() != 1:
        return False
    heads = [getattr(model, "head", None)]
    mtp = getattr(model, "mtp", None)
    if mtp is not None and len(mtp) and hasattr(mtp[-1], "markov_head"):
        heads.append(mtp[-1].markov_head.head)
    draft_vocab = getattr(model, "draft_vocab", None)
    if draft_vocab is not None:   # the draft heads' rows of both (models/draft_vocab.py)
        heads += [draft_vocab.head, draft_vocab.markov]
    kept, forms = 0, set()
    for head in heads:
        weight = getattr(head, "weight", None)
        copy = None if weight is None or weight.device.type != "cpu" else _bf16_head_copy(weight.data, kernel)
        if copy is None:
            continue
        head.register_buffer("weight_bf16", copy, persistent=False)
        kept += copy.numel() * 2
        forms.add("tiles (AMX)" if copy.dim() == 5 else "rows")
    if kept:
        logger.info("vocabulary heads: bf16 copies (%.0f MiB) for the %s kernel (layers/head_gemm.py)",
                    kept / 2**20, " and ".join(sorted(forms)))
    return bool(kept)


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
    def skip_warm_guards(self) -> bool:
        """DEEPINFER_CPU_SKIP_WARM_GUARDS: the compiled step skips Dynamo's non-tensor guards once a
        step's bucket and layout ran clean (worker/runners/warm_guards.py)."""
        return bool(envs.get("DEEPINFER_CPU_SKIP_WARM_GUARDS"))

    @property
    def runner_strategy(self) -> str:
        return "cpu_compiled" if envs.get("DEEPINFER_CPU_COMPILE") else "eager"

    def validate_config(self, engine_config, model_config) -> None:
        """The compiled runner's prompt buckets (DEEPINFER_CPU_PREFILL_BUCKETS) fit a step."""
        if self.runner_strategy == "cpu_compiled":
            check_prompt_buckets("DEEPINFER_CPU_PREFILL_BUCKETS", envs.get("DEEPINFER_CPU_PREFILL_BUCKETS"),
                                 engine_config.max_num_batched_tokens)

    def bucket_spec(self, engine_config) -> BucketSpec | None:
        """The compiled runner's shapes (None when steps run eagerly, so a test's own strategy keeps its
        buckets). Decode row buckets: powers of two up to next_pow2(max_num_seqs) (a padded row costs a
        row of every GEMM, and this CPU's small-row GEMMs grow with the rows: layers/head_gemm.py); the
        power-of-two context buckets up to max_model_len (platforms/neuron/buckets.py); prompt buckets
        only where DEEPINFER_CPU_PREFILL_BUCKETS names them (each costs a compile per context bucket, and
        a 64-token prompt step of the trained tiny V4.1 took 0.54x the eager time compiled: README
        "Compiled prompt steps"), else prompt steps run eagerly. With speculative decoding every row
        bucket also has a verification shape of 1 + num_speculative_tokens tokens a row."""
        if self.runner_strategy != "cpu_compiled":
            return None
        return BucketSpec(batch=batch_buckets(int(engine_config.max_num_seqs)),
                          contexts=default_context_buckets(engine_config.max_model_len),
                          prefill_tokens=envs.get("DEEPINFER_CPU_PREFILL_BUCKETS"),
                          max_model_len=engine_config.max_model_len,
                          verify_tokens=1 + int(getattr(engine_config, "num_speculative_tokens", 0) or 0))

    def kernel_weight_layouts(self, model) -> None:
        """An fp32 LM head whose values are all bf16 (a checkpoint's bf16 head, widened at load) also
        keeps a bf16 copy, `head.weight_bf16`, which a bf16-weight kernel multiplies (layers/head_gemm.py:
        the AMX tiles kernel at any row count, or the vector rows kernel at small row counts): the same
        fp32 products from half the bytes. Ranks of one torch thread only (keep_bf16_head), unless
        DEEPINFER_CPU_BF16_HEAD=0, or no kernel can be built here."""
        if envs.get("DEEPINFER_CPU_BF16_HEAD"):
            keep_bf16_head(model, envs.get("DEEPINFER_CPU_BF16_HEAD_KERNEL"))

    def signature(self) -> dict:
        return {**super().signature(), "compile_backend": envs.get("DEEPINFER_CPU_COMPILE_BACKEND"),
                "bf16_head": bool(envs.get("DEEPINFER_CPU_BF16_HEAD")),
                "bf16_head_kernel": envs.get("DEEPINFER_CPU_BF16_HEAD_KERNEL"),
                "skip_warm_guards": self.skip_warm_guards, "compile_scope": envs.get("DEEPINFER_CPU_COMPILE_SCOPE"),
                "compile_wrapper": envs.get("DEEPINFER_CPU_COMPILE_WRAPPER"),
                "prefill_buckets": envs.get("DEEPINFER_CPU_PREFILL_BUCKETS")}

    def region_runner(self):
        from deepinfer.neuron_ops.regions import RegionRunner
        # a C++ wrapper: inductor's Python wrapper costs ~1 ms of a batch-1 step (per-kernel calls,
        # size asserts, buffer views; README "Compiled CPU decode step", measured)
        backend = envs.get("DEEPINFER_CPU_COMPILE_BACKEND")
        cpp = backend == "inductor" and envs.get("DEEPINFER_CPU_COMPILE_WRAPPER") == "cpp"
        return RegionRunner(backend=backend, split="never", inductor_options={"cpp_wrapper": True} if cpp else None,
                            scope=envs.get("DEEPINFER_CPU_COMPILE_SCOPE"))
