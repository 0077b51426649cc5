"""NeuronPlatform: AWS Trainium2 through torch-neuronx (device mode) or its CPU twin (host mode).

Host mode (docs/neuron.md §5.8) is DEEPINFER_ACCELERATOR=neuron with no /dev/neuron*, or with
DEEPINFER_NEURON_HOST=1: device cpu, gloo, region graphs compiled with a CPU backend
(DEEPINFER_NEURON_COMPILE_BACKEND, aot_eager by default), kernels as PyTorch references with the
kernels' argument lists. Device mode: device `neuron`, torch.compile(backend="neuron") with the
compiler flags of docs/neuron.md §2.3, trn2's IEEE e4m3 fp8 (max 240). torch_neuronx is imported only
inside device-mode methods, never at import time.

Nothing in device mode has run on Trainium hardware in this project.
"""
from __future__ import annotations

import glob
import os

import torch

from deepinfer import envs
from deepinfer.model_executor.static_step import BucketSpec
from deepinfer.neuron_ops.fp8 import ACT_FP8_MAX
from deepinfer.platforms.interface import Platform
from deepinfer.platforms.neuron import compile_cache
from deepinfer.platforms.neuron.buckets import (check_prompt_buckets, default_context_buckets, default_row_buckets,
                                                default_verify_rows)

# docs/neuron.md §7, §2.3: let neuronx-cc read torch's float8_e4m3fn bytes as trn2's IEEE e4m3.
FP8_COMPILER_FLAG = "--internal-hlo2tensorizer-options=--experimental-unsafe-fp8e4m3fn-as-fp8e4m3"


def has_neuron_device() -> bool:
    return bool(glob.glob("/dev/neuron*"))


def import_torch_neuronx():
    """Import torch_neuronx (device mode only) with a clear error where it is missing."""
    try:
        import torch.utils._device  # noqa: F401  (missing without backend autoload, docs/neuron.md §4 G7)
        import torch_neuronx
    except ImportError as e:
        raise RuntimeError("Neuron device mode needs torch-neuronx (pip install -r requirements-neuron.txt "
                           f"on a Trainium host); set DEEPINFER_NEURON_HOST=1 for host mode: {e}") from None
    return torch_neuronx


class NeuronPlatform(Platform):
    name = "neuron"
    # trn2 reads e4m3 bytes as IEEE e4m3 (max 240, FP8_COMPILER_FLAG): everything the engine encodes
    # quantizes to 224, the headroom neuron_ops/fp8.py uses for activations.
    fp8_max = ACT_FP8_MAX
    runner_strategy = "neuron_regions"

    def __init__(self, host: bool | None = None):
        # Resolve every env var now: traced code must never read the environment (docs/neuron.md §4 F4).
        if host is None:
            host = bool(envs.get("DEEPINFER_NEURON_HOST")) or not has_neuron_device()
        self.is_host_mode = host
        self.dist_backend = "gloo" if host else "neuron"
        self.compile_backend = envs.get("DEEPINFER_NEURON_COMPILE_BACKEND") if host else "neuron"
        self.region_split = envs.get("DEEPINFER_NEURON_REGION_SPLIT")
        self.row_buckets = envs.get("DEEPINFER_NEURON_ROW_BUCKETS")
        self.ctx_buckets = envs.get("DEEPINFER_NEURON_CTX_BUCKETS")
        self.prefill_bucket = envs.get("DEEPINFER_NEURON_PREFILL_BUCKET")
        self.verify_rows = envs.get("DEEPINFER_NEURON_VERIFY_ROWS")
        self.fp8_guard = bool(envs.get("DEEPINFER_NEURON_FP8_GUARD"))
        # host mode only: run the NKI kernels in the interpreter (device mode runs them on the core)
        self.simulate_kernels = host and envs.get("DEEPINFER_NEURON_KERNELS") == "simulate"
        self.rank = 0
        self.compile_cache_dir: str | None = None   # set from the engine config (validate_config)

    # -- device -------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        if self.is_host_mode:
            return torch.device("cpu")
        import_torch_neuronx()
        return torch.device("neuron", 0)   # each process sees one core as device 0 (set_device)

    def set_device(self, rank: int) -> None:
        """One process per NeuronCore: device 0 of a 1-device local world (docs/neuron.md §4 G1, G2).
        Must run before torch_neuronx initializes the runtime, so the worker calls it first. Host mode
        has no runtime to configure: it records the rank only."""
        self.rank = int(rank)
        if self.is_host_mode:
            return
        os.environ["LOCAL_RANK"] = "0"
        os.environ["LOCAL_WORLD_SIZE"] = "1"
        os.environ["NEURON_RT_VISIBLE_CORES"] = str(self.rank)
        self.configure_compiler()

    # -- compile --------------------------------------------------------------------------------
    def compiler_flags(self) -> list[str]:
        return [FP8_COMPILER_FLAG]

    def configure_compiler(self) -> None:
        """Append our flags to NEURON_CC_FLAGS and point the compiler's persistent cache at
        compile_cache_dir (device mode; keeps what the user set)."""
        flags = os.environ.get("NEURON_CC_FLAGS", "").split()
        for f in self.compiler_flags():
            if f not in flags:
                flags.append(f)
        os.environ["NEURON_CC_FLAGS"] = " ".join(flags)
        if self.compile_cache_dir is not None:
            compile_cache.configure_device_cache(self.compile_cache_dir, os.environ)

    def region_runner(self):
        from deepinfer.neuron_ops.regions import RegionRunner
        if not self.is_host_mode:
            self.configure_compiler()
        return RegionRunner(backend=self.compile_backend, split=self.region_split)

    def bucket_spec(self, engine_config) -> BucketSpec:
        """Row buckets (DEEPINFER_NEURON_ROW_BUCKETS, else 8 and next_pow2(max_num_seqs)), context
        buckets (DEEPINFER_NEURON_CTX_BUCKETS, else max_model_len) and prompt-chunk buckets
        (DEEPINFER_NEURON_PREFILL_BUCKET, else max_num_batched_tokens, rounded up to a power of two), and
        verification buckets padded to powers of two (pow2_tokens, docs/neuron.md §4 B3) for the row buckets
        of DEEPINFER_NEURON_VERIFY_ROWS, else `default_verify_rows`: §5.10."""
        prefill = tuple(self.prefill_bucket) if self.prefill_bucket else (int(engine_config.max_num_batched_tokens),)
        rows = tuple(self.row_buckets) if self.row_buckets else default_row_buckets(int(engine_config.max_num_seqs))
        contexts = tuple(self.ctx_buckets) if self.ctx_buckets else default_context_buckets(engine_config.max_model_len)
        verify = 1 + int(getattr(engine_config, "num_speculative_tokens", 0) or 0)
        return BucketSpec(batch=rows, contexts=contexts, prefill_tokens=prefill,
                          max_model_len=engine_config.max_model_len, verify_tokens=verify, pow2_tokens=True,
                          verify_shares_decode=True,
                          verify_rows=tuple(self.verify_rows) if self.verify_rows else default_verify_rows(rows, verify))

    # -- config and kernels -----------------------------------------------------------------------
    def validate_config(self, engine_config, model_config) -> None:
        """Reject bucket settings the engine's limits contradict, and take the engine's compile cache
        directory (before set_device, which hands it to the compiler)."""
        max_tokens, max_len = int(engine_config.max_num_batched_tokens), engine_config.max_model_len
        if self.row_buckets and max(self.row_buckets) < int(engine_config.max_num_seqs):
            raise ValueError(f"DEEPINFER_NEURON_ROW_BUCKETS: the largest bucket ({max(self.row_buckets)}) must be "
                             f">= max_num_seqs ({engine_config.max_num_seqs})")
        self.compile_cache_dir = compile_cache.resolve_dir(getattr(engine_config, "compile_cache_dir", None))
        check_prompt_buckets("DEEPINFER_NEURON_PREFILL_BUCKET", self.prefill_bucket, max_tokens)
        if self.ctx_buckets and max_len is not None and max(self.ctx_buckets) < max_len:
            raise ValueError(f"DEEPINFER_NEURON_CTX_BUCKETS: the largest bucket ({max(self.ctx_buckets)}) must be "
                             f">= max_model_len ({max_len})")

    def fp8_weight_codes(self, codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """trn2 reads the bytes as IEEE e4m3 (max 240): every code is halved (|v| <= 224) and its block
        exponent raised by one, so the dequantized weight is unchanged (neuron_ops/fp8.py). Host mode
        does the same, so it computes with the bytes a device would read."""
        from deepinfer.neuron_ops.fp8 import rescale_weight_for_trn2
        return rescale_weight_for_trn2(codes, scale)

    def kernel_weight_layouts(self, model) -> None:
        """The NKI kernels' layouts (model_executor/layers/kernel_layouts.py): fp8 linears partition-major
        with bf16 scale values, fp4 expert stacks K-major; every fp8 code checked against trn2's e4m3
        range here, once, not per call. Host mode too, so its references read what a device reads."""
        from deepinfer.platforms.neuron.weight_layouts import lay_out_model
        lay_out_model(model)

    def kernel(self, name: str):
        from deepinfer.neuron_ops import kernel_routing
        return kernel_routing.kernel(name, on_device=not self.is_host_mode, simulate=self.simulate_kernels)

    def signature(self) -> dict:
        # every setting resolved in __init__ but the float8 guard (it only logs)
        return {**super().signature(), "compile_backend": self.compile_backend, "region_split": self.region_split,
                "row_buckets": self.row_buckets, "ctx_buckets": self.ctx_buckets,
                "prefill_bucket": self.prefill_bucket, "verify_rows": self.verify_rows,
                "simulate_kernels": bool(self.simulate_kernels)}

    def __repr__(self) -> str:
        return f"<NeuronPlatform {'host' if self.is_host_mode else 'device'} mode>"
