"""fp8 bytes the engine writes on the Neuron platform mean the same as IEEE e4m3 (trn2, max 240).

The compact KV records hold e4m3 bytes (SWA values, main-KV fp4 group scales). The cache is sized
by the platform's fp8_max: 224 on Neuron, 448 on cpu/cuda. After a real generation every e4m3 byte
in every cache must decode to |v| <= 240 on Neuron; the CPU platform's run of the same requests is
the control that shows the bound is not met by accident (its codes go up to 448)."""
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import ModelConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_config import EngineConfig
from deepinfer.platforms.cpu import CpuPlatform
from deepinfer.platforms.neuron.platform import NeuronPlatform
from deepinfer.worker.kv_records import Fp4Format, Fp8Ue8m0Format
from deepinfer.worker.worker import Worker

TRN2_E4M3_MAX = 240.0


def _e4m3_values(cache) -> torch.Tensor:
    """Every e4m3 byte of the compact stores, decoded to fp32."""
    out = []
    for store, fmt in ((cache.swa, cache.formats.swa), (cache.entries, cache.formats.entries),
                       (cache.index_keys, cache.formats.index)):
        for rec in store.values():
            if isinstance(fmt, Fp8Ue8m0Format):
                codes = rec[:, : fmt.width]
            elif isinstance(fmt, Fp4Format) and fmt.scale_fmt == "e4m3":
                codes = rec[:, fmt.width // 2:]
            else:
                continue
            out.append(codes.contiguous().view(torch.float8_e4m3fn).float().flatten())
    return torch.cat(out)


def _generate_compact(model_dir, platform):
    cfg = ModelConfig.from_pretrained(model_dir)
    ec = EngineConfig(model=str(model_dir), dtype="float32", max_model_len=128, max_num_seqs=2,
                      max_num_batched_tokens=128, kv_cache_mode="compact", enforce_eager=True).resolve(cfg)
    worker = Worker(cfg, ec, platform=platform)
    llm = LLM.from_engine(LLMEngine(ec, model_config=cfg, worker=worker))
    prompts = [{"prompt_token_ids": [0] + list(range(100, 160))}, {"prompt_token_ids": [0, 7, 8, 9, 10]}]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    return _e4m3_values(worker.cache)


def test_compact_kv_bytes_stay_within_trn2_e4m3_on_neuron(tiny_v41_dir):
    neuron = _generate_compact(tiny_v41_dir, NeuronPlatform(host=True))
    assert torch.isfinite(neuron).all()
    assert (neuron != 0).any(), "the generation wrote no fp8 record"
    assert neuron.abs().max().item() <= 224.0 <= TRN2_E4M3_MAX
    cpu = _generate_compact(tiny_v41_dir, CpuPlatform())
    assert cpu.abs().max().item() > TRN2_E4M3_MAX   # the control: OCP e4m3fn codes use the full 448 range
