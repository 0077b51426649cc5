"""uint8 carriers (docs/neuron.md §4 A9, A11; §7): no float8 value in any region graph.

fp8 bytes cross a graph as uint8 and get their meaning inside a kernel: the packed-weight kernels
and the compact KV record codecs are custom ops whose fakes take and return uint8 and the compute
dtype. `graph_float8_sites` reports any float8 value of a graph; the negative controls show it
reports a uint8 viewed as float8, whether in a hand-written graph or in a decoder layer region
whose record decode is traced inline, and the tiny V4.1 / V4 runs on packed weights with compact
KV records compile every region (decode and split prompt regions) with none, giving the CPU
platform's greedy tokens."""
import types

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from deepinfer.config import ModelConfig
from deepinfer.model_executor.layers import quant
from deepinfer.model_executor.static_step import BucketSpec
from deepinfer.neuron_ops.fp8 import ACT_FP8_MAX
from deepinfer.neuron_ops.fp8_guard import graph_float8_sites
from deepinfer.neuron_ops.regions import SUB_REGIONS, WHOLE, RegionRunner
from deepinfer.platforms.cpu import CpuPlatform
from deepinfer.platforms.neuron.platform import NeuronPlatform
from deepinfer.worker import kv_codecs
from deepinfer.worker.kv_records import record_format
from deepinfer.worker.runners import EagerStrategy, NeuronRegionStrategy
from deepinfer.worker.worker import build_model
from tests.support.model_helpers import Seqs, tiny_config, tiny_model

PROMPTS = [[0, 17, 400, 9, 3000, 5, 6, 7, 8, 12, 13], [0, 55, 66, 77, 88]]
HOST = NeuronPlatform(host=True)


def _dynamo_graphs(fn, *args):
    """The graphs Dynamo captures running fn(*args). fn gets its own code object each call: Dynamo
    caches per code object, and the test's lambdas would otherwise run out of recompiles."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fresh = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    out = torch.compile(fresh, backend=backend, fullgraph=True, dynamic=False)(*args)
    assert len(graphs) == 1
    return graphs, out


def _bytes(*shape):
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


def test_scan_reports_uint8_viewed_as_float8():
    """The negative control: a graph that reinterprets uint8 as e4m3 (and one that takes a float8
    input) is reported, at the Dynamo level and at the aten level."""
    def decode(rec, scale):
        return rec.view(torch.float8_e4m3fn).float() * scale

    rec = _bytes(4, 32).clamp(max=0x7E)
    graphs, out = _dynamo_graphs(decode, rec, torch.full((4, 1), 0.5))
    sites = graph_float8_sites(graphs[0])
    assert sites and all("float8_e4m3fn" in s for s in sites)
    assert any(s.startswith("view") for s in sites)
    assert torch.equal(out, decode(rec, torch.full((4, 1), 0.5)))
    aten = graph_float8_sites(make_fx(decode)(rec, torch.full((4, 1), 0.5)))
    assert aten and all("float8_e4m3fn" in s for s in aten)
    graphs, _ = _dynamo_graphs(lambda q: q.float() * 2, rec.view(torch.float8_e4m3fn))
    assert any(s.startswith("input float8_e4m3fn") for s in graph_float8_sites(graphs[0]))
    graphs, _ = _dynamo_graphs(lambda x: (x * 2).to(torch.float8_e8m0fnu).view(torch.uint8), torch.ones(4))
    assert any("float8_e8m0fnu" in s for s in graph_float8_sites(graphs[0]))
    table = torch.zeros(4).to(torch.float8_e4m3fn)                     # a float8 constant the graph holds
    gm = make_fx(lambda x: x + table.float())(torch.ones(4))
    assert any(n.op == "get_attr" for n in gm.graph.nodes)
    assert any(s.startswith("_tensor_constant") for s in graph_float8_sites(gm))


CODECS = [("swa", 64), ("entries", 64), ("index", 32)]


@pytest.mark.parametrize("kind,width", CODECS)
def test_record_codecs_are_opaque_uint8_ops(kind, width):
    """Each record codec is one custom-op node: a graph that encodes and decodes a record holds no
    float8 value, gives the eager bytes and values exactly, and the fakes match (opcheck)."""
    fmt = record_format(kind, width, "compact", torch.float32, ACT_FP8_MAX)
    x = torch.randn(6, width, generator=torch.Generator().manual_seed(1)) * 40

    def round_trip(v):
        rec = fmt.encode(v)
        return rec, fmt.decode(rec, torch.bfloat16)

    graphs, (rec, back) = _dynamo_graphs(round_trip, x)
    assert graph_float8_sites(graphs[0]) == []
    ops = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert len(ops) == 2 and all("deepinfer_kv" in str(op) for op in ops)
    want_rec, want_back = round_trip(x)
    assert rec.dtype == torch.uint8 and rec.shape == (6, fmt.record_bytes()) and torch.equal(rec, want_rec)
    assert back.dtype == torch.bfloat16 and torch.equal(back, want_back)
    enc = (kv_codecs.fp8_record_encode, (x, ACT_FP8_MAX)) if kind == "swa" else \
        (kv_codecs.fp4_record_encode, (x, fmt.group, fmt.scale_fmt, ACT_FP8_MAX))
    dec = (kv_codecs.fp8_record_decode, (rec, width, torch.float32)) if kind == "swa" else \
        (kv_codecs.fp4_record_decode, (rec, width, fmt.group, fmt.scale_fmt, torch.float32))
    for op, args in (enc, dec):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_record_codecs_equal_the_block_quantizers():
    """The codec bytes are the quantizers' codes and scales side by side, and decoding them is the
    quantizers' own dequantization, bit for bit."""
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)) * 300
    q, s = quant.quantize_fp8_block(x, (1, 32), fp8_max=ACT_FP8_MAX)
    rec = kv_codecs.fp8_record_encode(x, ACT_FP8_MAX)
    assert torch.equal(rec, torch.cat([q.view(torch.uint8), s.view(torch.uint8)], -1))
    assert torch.equal(kv_codecs.fp8_record_decode(rec, 64, torch.float32), quant.dequant_fp8_block(q, s, (1, 32)))
    p, s4 = quant.quantize_fp4(x, 16, "e4m3", fp8_max=ACT_FP8_MAX)
    rec4 = kv_codecs.fp4_record_encode(x, 16, "e4m3", ACT_FP8_MAX)
    assert torch.equal(rec4, torch.cat([p.view(torch.uint8), s4.view(torch.uint8)], -1))
    assert torch.equal(kv_codecs.fp4_record_decode(rec4, 64, 16, "e4m3", torch.float32),
                       quant.dequant_fp4(p, s4.float(), 16))


def test_codec_fakes_reject_a_float8_carrier():
    codes = _bytes(3, 66).clamp(max=0x7E)
    with pytest.raises(ValueError, match="expected uint8 record bytes"):
        kv_codecs.fp8_record_decode(codes.view(torch.float8_e4m3fn), 64, torch.float32)
    with pytest.raises(ValueError, match="expected values in a float dtype"):
        kv_codecs.fp8_record_encode(torch.zeros(3, 64).to(torch.float8_e4m3fn), ACT_FP8_MAX)
    with pytest.raises(ValueError, match="records of 66 bytes"):
        kv_codecs.fp8_record_decode(codes[:, :40], 64, torch.float32)
    with torch._subclasses.FakeTensorMode():
        with pytest.raises(ValueError, match="expected uint8 record bytes"):
            kv_codecs.fp8_record_decode(torch.empty(3, 66, dtype=torch.float8_e4m3fn), 64, torch.float32)


def _int_codecs(fmt, kind, width, fp8_max):
    if kind == "swa":
        return (lambda v: kv_codecs.fp8_encode(v, fp8_max, int_codes=True),
                lambda r: kv_codecs.fp8_decode(r, width, torch.float32, int_codes=True))
    return (lambda v: kv_codecs.fp4_encode(v, fmt.group, fmt.scale_fmt, fp8_max, int_codes=True),
            lambda r: kv_codecs.fp4_decode(r, width, fmt.group, fmt.scale_fmt, torch.float32, int_codes=True))


@pytest.mark.parametrize("kind,width", [("swa", 512), ("entries", 512), ("index", 128)] + CODECS)
def test_integer_record_codecs_equal_the_ops(kind, width):
    """The traced forms a device runs (int_codes: e4m3 by integer arithmetic) write the ops' bytes and
    read the ops' values bit for bit, random record bytes (NaN codes included) too."""
    g = torch.Generator().manual_seed(width)
    x = torch.cat([torch.randn(8, width, generator=g) * 10.0 ** e for e in range(-6, 6)])
    x[0] = 0
    rb = torch.randint(0, 256, (64, record_format(kind, width, "compact", torch.float32).record_bytes()),
                       dtype=torch.uint8, generator=g)
    for fp8_max in (ACT_FP8_MAX, 448.0):
        fmt = record_format(kind, width, "compact", torch.float32, fp8_max)
        enc, dec = _int_codecs(fmt, kind, width, fp8_max)
        rec = fmt.encode(x)
        assert torch.equal(enc(x), rec)
        for r in (rec, rb):
            assert torch.equal(dec(r).view(torch.int32), fmt.decode(r, torch.float32).view(torch.int32))


@pytest.mark.parametrize("kind,width", CODECS)
def test_integer_record_codecs_trace_without_float8(kind, width):
    fmt = record_format(kind, width, "compact", torch.float32, ACT_FP8_MAX)
    enc, dec = _int_codecs(fmt, kind, width, ACT_FP8_MAX)
    x = torch.randn(6, width, generator=torch.Generator().manual_seed(3)) * 40
    graphs, back = _dynamo_graphs(lambda v: dec(enc(v)), x)
    assert torch.equal(back, fmt.decode(fmt.encode(x), torch.float32))
    assert graph_float8_sites(graphs[0]) == []
    assert not any("deepinfer_kv" in str(n.target) for n in graphs[0].graph.nodes)


def test_device_fp8_references_hold_no_float8():
    """Device mode traces the plain references of the names it has no kernel for; the fp8 ones read
    their codes by integer arithmetic: no float8 value in their graphs, and bit for bit the CPU
    platform's references (which read a float8 view, and so are reported: the control)."""
    from deepinfer.model_executor.layers import kernel_table
    from deepinfer.neuron_ops import kernel_routing
    from tests.support.neuron_cases import kernel_args
    cases = kernel_args()
    for name in ("blockquant_fp8_gemm", "blockquant_fp8_grouped_gemm", "fp8_table_rows"):
        args, kw = cases[name]
        device_fn, cpu_fn = kernel_routing.kernel(name, on_device=True), kernel_table.reference(name)
        graphs, got = _dynamo_graphs(lambda *a: device_fn(*a, **kw), *args)
        assert graph_float8_sites(graphs[0]) == [], name
        assert torch.equal(got, cpu_fn(*args, **kw)), name
        graphs, _ = _dynamo_graphs(lambda *a: cpu_fn(*a, **kw), *args)
        assert any("float8_e4m3fn" in s for s in graph_float8_sites(graphs[0])), name


def _compact_region_run(model, regions, steps=3):
    s = Seqs(model, NeuronRegionStrategy, PROMPTS, platform=HOST, buckets=BucketSpec(batch=(2,), contexts=(64,),
             prefill_tokens=None), regions=regions, kv_cache_mode="compact", fp8_max=ACT_FP8_MAX)
    return s.greedy(steps), s


def test_region_scan_catches_a_record_decode_traced_inline(monkeypatch):
    """The negative control at the region level: with the fp8 record decode swapped for its inline
    torch form, the decoder layer regions hold e4m3 views and the runner reports them, with the
    same tokens; with the custom ops, or with the integer forms traced in, they hold none."""
    model = tiny_model(tiny_config("v4", 2), HOST)
    clean = RegionRunner("aot_eager")
    tokens, s = _compact_region_run(model, clean)
    assert s.strategy.eager_steps == 1 and clean.stats.total_graphs > 0   # the prompt step: no bucket
    assert clean.stats.float8_sites == [] and s.strategy.fp8_sites() == []

    def inline_decode(rec, width, dtype):
        q = rec[..., :width].contiguous().view(torch.float8_e4m3fn).float()
        return (q * quant.ue8m0_to_float(rec[..., width:].contiguous()).repeat_interleave(32, -1)).to(dtype)

    with monkeypatch.context() as m:
        m.setattr(kv_codecs, "fp8_record_decode", inline_decode)
        dirty = RegionRunner("aot_eager")
        assert _compact_region_run(model, dirty)[0] == tokens
    assert dirty.stats.float8_sites and all("float8_e4m3fn" in x for x in dirty.stats.float8_sites)

    # the device's traced integer forms, run here by naming cpu a traced device: no opaque codec is
    # called, no float8 value is in a graph, and the tokens are the same
    def no_op(*args):
        raise AssertionError("the opaque codec ran where the traced form should")

    monkeypatch.setattr(kv_codecs, "TRACED_DEVICES", ("cpu",))
    for name in ("fp8_record_encode", "fp8_record_decode", "fp4_record_encode", "fp4_record_decode"):
        monkeypatch.setattr(kv_codecs, name, no_op)
    traced = RegionRunner("aot_eager")
    assert _compact_region_run(model, traced)[0] == tokens
    assert traced.stats.total_graphs > 0 and traced.stats.float8_sites == []


@pytest.mark.parametrize("kind", ["v41", "v4"])
def test_packed_compact_regions_hold_no_float8(request, kind):
    """Packed weights (trn2 fp8 codes) and compact KV records on the host-mode Neuron platform: every
    region graph (the step's entry and exit, whole decode layers and the split prompt sub-regions)
    holds no float8 value and no unsafe float8 op, and the greedy tokens are the CPU platform's with the same records."""
    ckpt = request.getfixturevalue("tiny_v41_dir" if kind == "v41" else "tiny_v4_dir")
    cfg = ModelConfig.from_pretrained(ckpt)
    cpu = build_model(cfg, str(ckpt), torch.float32, progress=False, platform=CpuPlatform())
    golden = Seqs(cpu, EagerStrategy, PROMPTS, kv_cache_mode="compact", fp8_max=ACT_FP8_MAX).greedy(4)
    packed = build_model(cfg, str(ckpt), torch.float32, progress=False, platform=HOST, weight_format="packed")
    regions = RegionRunner("aot_eager", split="multi_row")
    spec = BucketSpec(batch=(2,), contexts=(64,), prefill_tokens=16)
    s = Seqs(packed, NeuronRegionStrategy, PROMPTS, platform=HOST, buckets=spec, regions=regions,
             kv_cache_mode="compact", fp8_max=ACT_FP8_MAX)
    assert s.greedy(4) == golden
    assert s.strategy.eager_steps == 0 and s.strategy.buckets_seen == {(16, 64), (2, 64)}
    assert set(regions.stats.regions) == set(WHOLE + SUB_REGIONS) | {"entry", "exit"}
    assert regions.stats.total_graphs == s.strategy.plan.graph_count
    assert regions.stats.float8_sites == [] and regions.stats.fp8_sites == []
