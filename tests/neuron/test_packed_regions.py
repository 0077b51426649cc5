"""Host-mode Neuron regions on packed weights (weight_format="packed", the Neuron default): the
region graphs compile with the packed GEMM / expert / table kernels as single custom-op nodes, the
fp8 codes are the trn2 layout (halved, |v| <= 224, exponent + 1) and the greedy tokens equal the CPU
platform's dense ones."""
import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.model_executor.layers import kernel_layouts
from deepinfer.model_executor.layers.engram_host import host_tables
from deepinfer.model_executor.layers.packed_weights import PackedFp8Linear, PackedFp8Table, is_packed
from deepinfer.model_executor.static_step import BucketSpec
from deepinfer.neuron_ops import fp8
from deepinfer.neuron_ops.regions import RegionRunner
from deepinfer.platforms.cpu import CpuPlatform
from deepinfer.platforms.neuron.platform import NeuronPlatform
from deepinfer.worker.runners import EagerStrategy, NeuronRegionStrategy
from deepinfer.worker.worker import build_model
from tests.support.model_helpers import Seqs

PROMPTS = [[0, 17, 400, 9, 3000, 5, 6, 7, 8, 12, 13], [0, 55, 66, 77, 88]]
SPEC = BucketSpec(batch=(2,), contexts=(64,), prefill_tokens=None)   # decode steps compiled


@pytest.mark.parametrize("kind", ["v41", "v4"])
def test_packed_regions_give_the_cpu_tokens(request, kind):
    ckpt = request.getfixturevalue("tiny_v41_dir" if kind == "v41" else "tiny_v4_dir")
    cfg = ModelConfig.from_pretrained(ckpt)
    cpu = build_model(cfg, str(ckpt), torch.float32, progress=False, platform=CpuPlatform())
    golden = Seqs(cpu, EagerStrategy, PROMPTS).greedy(5)
    host = NeuronPlatform(host=True)
    assert host.default_weight_format == "packed"
    packed = build_model(cfg, str(ckpt), torch.float32, progress=False, platform=host, weight_format="packed")
    fp8_mods = [m for m in [*packed.modules(), *host_tables(packed).values()]   # Engram: host tables
                if isinstance(m, (PackedFp8Linear, PackedFp8Table))]
    assert fp8_mods and all(fp8.trn2_representable(m.weight) for m in fp8_mods)
    assert max(m.weight.view(torch.float8_e4m3fn).float().abs().max().item() for m in fp8_mods) <= 224.0
    # stored in the kernels' layouts at load (layers/kernel_layouts.py): fp8 linears partition-major,
    # the packed expert stacks K-major
    assert all(kernel_layouts.fp8_is_kernel_layout(m.weight) for m in fp8_mods if isinstance(m, PackedFp8Linear))
    stacks = [m for m in packed.modules() if getattr(m, "_w13_scale", None) is not None]
    assert stacks and all(kernel_layouts.fp4_is_kernel_layout(m._w13, m._w13_scale) for m in stacks)
    regions = RegionRunner("aot_eager")
    s = Seqs(packed, NeuronRegionStrategy, PROMPTS, platform=host, buckets=SPEC, regions=regions)
    assert s.greedy(5) == golden
    assert regions.stats.total_graphs > 0 and s.strategy.buckets_seen == {(2, 64)}
    assert regions.stats.float8_sites == []   # the packed kernels take their bytes as uint8
    assert any(is_packed(m) for m in packed.modules())
