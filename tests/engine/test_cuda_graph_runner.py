"""CudaGraphStrategy: decode steps padded to (row, context) buckets and replayed from captured graphs.

Without a GPU the runner runs with HostReplay in place of CUDA graph capture: buckets, placeholder
capture, the persistent input buffers refilled every step, the fixed-shape MoE and the output
buffer are all the real code, so the tokens must equal the eager runner's. Capturability is checked
on meta tensors (no data: any host read or data-dependent shape raises) with the model moved there
the way build_model moves it to a GPU, watching for host tensors copied in after warm-up. The
tests marked `cuda` run the real capture and replay where torch sees a GPU, and are skipped otherwise."""
import dataclasses
import functools

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from deepinfer import LLM, SamplingParams
from deepinfer.config import ModelConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_config import EngineConfig
from deepinfer.model_executor.forward_meta import SeqChunk, step_to
from deepinfer.model_executor.models.deepseek_v4 import DeepseekV4Model
from deepinfer.worker.cache_engine import allocate_cache, cache_layout, default_block_size
from deepinfer.platforms.cuda import cuda_batch_buckets
from deepinfer.worker.runners.cuda_graphs import CudaGraphStrategy, HostReplay
from deepinfer.worker.runners.eager import EagerStrategy
from deepinfer.model_executor.static_step import Bucket, BucketSpec
from deepinfer.worker.worker import Worker, build_model

from tests.support.model_helpers import (Seqs, assert_padding_wrote_only_scratch, run_in_lockstep, tiny_config,
                                         tiny_model)
from tests.support.near_ties import NearTies, sampled_tokens_replayed
from tests.support.spec_runs import oracle_drafts

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)")


def test_cuda_batch_buckets():
    assert cuda_batch_buckets(1) == (1,)
    assert cuda_batch_buckets(3) == (1, 2, 4)
    assert cuda_batch_buckets(8) == (1, 2, 4, 8)
    assert cuda_batch_buckets(20) == (1, 2, 4, 8, 16, 24)
    with pytest.raises(ValueError, match="max_num_seqs"):
        cuda_batch_buckets(0)


# -- capturability: a padded decode step on meta tensors ------------------------------------------

class _DeviceMixes(TorchDispatchMode):
    """Records every op whose tensors sit on more than one device: with the model on meta, that is a
    host tensor copied in or used in place (a host-to-device copy or a host read on a GPU)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if len({t.device.type for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)}) > 1:
            self.ops.append(str(func))
        return out


class _HostConstructors(TorchFunctionMode):
    """Records tensors built from host data (torch.tensor / as_tensor / from_numpy)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.tensor, torch.as_tensor, torch.from_numpy):
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _meta_setup(kind, dtype, mode="plain", weights="dense", drafts=0):
    """The model built on the host and moved, as build_model moves it to a GPU (plain attributes such
    as RoPE tables stay on the host), a cache and a padded decode step, all on meta. weights
    "packed": the checkpoint's quantized tensors kept packed (fp8 / fp4 kernels, packed experts).
    drafts > 0: speculative decoding (draft keys written by the forward, rings grown for rollback)
    and a step of verification rows (1 + drafts tokens, one row shorter) in its verify bucket."""
    from deepinfer.tools.memory_report import config_weight_formats
    from deepinfer.worker.cache_engine import speculative_ring_rows
    cfg = tiny_config(kind)
    model = DeepseekV4Model(cfg, dtype)
    if weights == "packed":
        assert model.use_weight_formats(config_weight_formats(cfg)) > 0
    model.post_load()
    model.to("meta")
    if drafts:
        model.enable_drafting()
    bs, extra = default_block_size(cfg), speculative_ring_rows(drafts)
    layout = cache_layout(cfg, 5, bs, model.engram_spec, extra_ring_rows=extra)
    cache = allocate_cache(cfg, 5, 20, bs, dtype, device="meta", mode=mode, extra_ring_rows=extra)
    spec = BucketSpec(batch=(1, 2, 4), contexts=None, prefill_tokens=None, max_model_len=256,
                      verify_tokens=1 + drafts)
    n = 1 + drafts
    chunks = [SeqChunk(1, 37, n, [1, 2, 3], list(range(37 + n))),
              SeqChunk(2, 10, max(1, n - 1), [4], list(range(10 + max(1, n - 1))))]
    bucket = spec.select(chunks)
    step = spec.static_step(chunks, bucket, layout, logits_rows=4 * n)
    # the host stage first, as every strategy's to_device runs it: the Engram rows stay host work
    return model, cache, step_to(model.host_inputs(step), "meta")


@pytest.mark.parametrize("dtype,mode,weights", [(torch.float32, "plain", "dense"), (torch.bfloat16, "plain", "dense"),
                                                (torch.float32, "compact", "dense"),
                                                (torch.bfloat16, "plain", "packed")])
@pytest.mark.parametrize("kind", ["v4", "v41"])
def test_padded_decode_step_is_capturable(kind, dtype, mode, weights):
    """What a CUDA graph capture refuses, checked on meta tensors (which have no data): .item(),
    .tolist(), nonzero, bincount and boolean indexing raise on meta; after a warm-up forward (as the
    runner does before capturing), the forward must neither copy host tensors in nor build tensors
    from host data. Negative controls: the same step unpadded (routed MoE) raises, and a forward with
    the per-device RoPE tables dropped is caught copying them in. "compact" stores DeepSeek's fp8 /
    fp4 KV records, encoded and decoded inside the forward; "packed" weights go through the fp8 / fp4
    GEMM kernels and the fixed-shape packed experts."""
    model, cache, step = _meta_setup(kind, dtype, mode, weights)
    _assert_capturable(model, cache, step, 4)
    with pytest.raises((NotImplementedError, RuntimeError)):
        model(dataclasses.replace(step, static_shapes=False), cache)
    for rotary in model.rotary.values():
        rotary._inv_freq_on.clear()
    with _DeviceMixes() as again:
        model(step, cache)
    assert again.ops


def _assert_capturable(model, cache, step, rows: int) -> None:
    model(step, cache)                                    # warm-up: per-device tables are made here
    mixes, ctors = _DeviceMixes(), _HostConstructors()
    with ctors, mixes:
        logits = model(step, cache)
    assert logits.shape == (rows, model.cfg.vocab_size) and logits.device.type == "meta"
    assert mixes.ops == [] and ctors.calls == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_verification_step_is_capturable(dtype):
    """Verification rows (1 + 3 tokens, one row of 3) padded to their bucket (2 rows x 4 tokens, a
    placeholder chunk beyond the rows carrying the short row's spare token), with the draft layers'
    main keys written inside the forward: nothing a capture refuses."""
    model, cache, step = _meta_setup("v41", dtype, drafts=3)
    assert model.writes_draft_keys and step.num_tokens == 8
    _assert_capturable(model, cache, step, 16)


# -- the runner on CPU with HostReplay --------------------------------------------------------------

def _host_runner(spec):
    return functools.partial(CudaGraphStrategy, buckets=spec, capture=HostReplay())


@pytest.fixture(scope="module", params=["v4", "v41"])
def rand_model(request):
    return tiny_model(tiny_config(request.param))


PROMPTS = [[0, 17, 400, 9, 3000, 5, 6, 7, 8, 12, 13], [0, 55, 66, 77, 88]]
SLOTS, BLOCKS = 5, 13


def test_padding_rows_never_change_real_rows(rand_model):
    m = rand_model
    spec = BucketSpec(batch=(4,), contexts=(64,), prefill_tokens=None)
    padded = Seqs(m, _host_runner(spec), PROMPTS, num_slots=SLOTS, num_blocks=BLOCKS)
    plain = Seqs(m, EagerStrategy, PROMPTS, num_slots=SLOTS, num_blocks=BLOCKS)
    run_in_lockstep(padded, plain, 14)
    r = padded.strategy
    assert r.eager_steps == 1 and r.replays == 13 and list(r.graphs) == [Bucket(4, 4, 64)]
    used_blocks = set(padded.tables[0][:3]) | set(padded.tables[1][:3])
    assert_padding_wrote_only_scratch(padded.cache, plain.cache, {1, 2}, used_blocks, SLOTS, BLOCKS)


def test_replay_refuses_another_cache_or_a_foreign_step(rand_model):
    m = rand_model
    spec = BucketSpec(batch=(2,), contexts=(64,), prefill_tokens=None)
    s = Seqs(m, _host_runner(spec), PROMPTS, num_slots=SLOTS, num_blocks=BLOCKS)
    s.step({0: len(PROMPTS[0]), 1: len(PROMPTS[1])})
    s.tokens[0].append(5)
    s.tokens[1].append(6)
    s.step({0: 1, 1: 1})
    s.tokens[0].append(7)
    s.tokens[1].append(8)
    other = allocate_cache(m.cfg, SLOTS, BLOCKS, s.bs, torch.float32)
    step, bucket = s.strategy.prepare([s.chunk(0, 1), s.chunk(1, 1)])
    with pytest.raises(RuntimeError, match="cache it was captured with"):
        s.strategy.forward(step, other, bucket)
    narrow = dataclasses.replace(step, swa_write_src=step.swa_write_src[:1])
    with pytest.raises(RuntimeError, match="does not match the graph"):
        s.strategy.forward(narrow, s.cache, bucket)


def _engine(model_dir, model, strategy_cls=None, **kw):
    cfg = ModelConfig.from_pretrained(model_dir)
    ec = EngineConfig(model=str(model_dir), dtype="float32", **kw).resolve(cfg)
    worker = Worker(cfg, ec, model=model, strategy_cls=strategy_cls)
    return LLM.from_engine(LLMEngine(ec, model_config=cfg, worker=worker))


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(5, 60, (n,), generator=g).tolist()
    return [{"prompt_token_ids": [0] + torch.randint(3, 128000, (k - 1,), generator=g).tolist()} for k in lens]


@pytest.mark.parametrize("kind,mode", [("v4", "plain"), ("v41", "plain"), ("v41", "compact")])
def test_engine_tokens_equal_eager(kind, mode, tiny_v4_dir, tiny_v41_dir, monkeypatch):
    """Greedy and seeded requests that finish at different lengths, so the batch shrinks through
    several row buckets: the graph runner's tokens equal the eager runner's.

    With compact (fp8 / fp4) KV records, the eager reference runs the fixed-shape MoE too: the two
    MoE forms differ in fp32 rounding (~1e-7), and re-quantizing the KV cache every step can turn such
    a difference into another sampled token a few steps later, which would say nothing about the
    runner. The GEMMs of a step padded to its bucket round differently from the eager step's too (the
    logits differ by up to ~1e-5 here, more on other CPUs' kernels), so a token may differ from the
    eager one only where the eager sampler decided within 0.05 of a logit, and is then replayed
    (tests/support/near_ties.py): at most two such tokens, every other token equal."""
    d = tiny_v4_dir if kind == "v4" else tiny_v41_dir
    model = build_model(ModelConfig.from_pretrained(d), str(d), torch.float32, progress=False)
    if mode == "compact":
        monkeypatch.setattr(model.kernels, "moe_experts", model.kernels.moe_experts_static)
    prompts = _prompts(5, seed=2)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, top_p=0.9, seed=i, max_tokens=3 + 4 * i,
                             ignore_eos=True) for i in range(5)]
    kw = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=512, kv_cache_mode=mode)
    eager = _engine(d, model, EagerStrategy, **kw)
    eager_steps = sampled_tokens_replayed(eager.llm_engine.worker.runner)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    spec = BucketSpec(batch=cuda_batch_buckets(8), contexts=None, prefill_tokens=None, max_model_len=256)
    monkeypatch.undo()
    llm = _engine(d, model, _host_runner(spec), **kw)
    sampled_tokens_replayed(llm.llm_engine.worker.runner, eager_steps,
                            NearTies("graph runner tokens vs eager", threshold=0.05, max_excused=2))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    r = llm.llm_engine.worker.runner.strategy
    assert {b.num_seqs for b in r.graphs} >= {1, 2, 8} and r.replays > 0 and r.eager_steps >= 1
    assert llm.llm_engine.stats().num_used_blocks == 0


def test_warm_up_captures_every_bucket_at_engine_start(tiny_v41_dir):
    d = tiny_v41_dir
    model = build_model(ModelConfig.from_pretrained(d), str(d), torch.float32, progress=False)
    spec = BucketSpec(batch=cuda_batch_buckets(4), contexts=None, prefill_tokens=None, max_model_len=128)
    llm = _engine(d, model, _host_runner(spec), max_model_len=128, max_num_seqs=4, max_num_batched_tokens=256,
                  warmup_graphs=True)
    worker = llm.llm_engine.worker
    assert worker.warmup_graphs == 3 * 2 == worker.runner.num_graphs   # rows 1, 2, 4 x contexts 64, 128
    graphs = worker.runner.strategy.graphs   # one logits buffer per row count, shared across context buckets
    assert graphs[Bucket(4, 4, 64)].output is graphs[Bucket(4, 4, 128)].output
    assert len({id(g.output) for g in graphs.values()}) == 3
    llm.generate(_prompts(3, seed=4), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                 use_tqdm=False)
    assert worker.runner.num_graphs == 6 and worker.runner.strategy.replays > 0
    assert llm.llm_engine.stats().num_graphs == 6
    with pytest.raises(ValueError, match="warmup_graphs"):
        EngineConfig(model=str(d), warmup_graphs="yes")


def _verify_run(d, model, strategy_cls, platform=None, drafts=3, oracle_of=None, monkeypatch=None):
    """Greedy tokens of 4 prompts (the batch shrinks as they finish), the runner strategy and the
    engine's spec counters; oracle_of: plain tokens to draft from (tests/support/spec_runs.py oracle_drafts)."""
    prompts = _prompts(4, seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(4)]
    cfg = ModelConfig.from_pretrained(d)
    ec = EngineConfig(model=str(d), dtype="float32", max_model_len=128, max_num_seqs=4,
                      max_num_batched_tokens=256, num_speculative_tokens=drafts).resolve(cfg)
    if oracle_of is not None:
        oracle_drafts(monkeypatch, prompts, oracle_of)
    if strategy_cls == "graphs":
        from deepinfer.platforms.cuda import CudaPlatform
        strategy_cls = _host_runner(CudaPlatform().bucket_spec(ec)) if platform is None else None
    worker = Worker(cfg, ec, model=model, strategy_cls=strategy_cls, platform=platform)
    llm = LLM.from_engine(LLMEngine(ec, model_config=cfg, worker=worker))
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    return tokens, worker.runner.strategy, llm.llm_engine.scheduler.spec_policy.stats


def test_verification_rows_replay_graphs_of_their_own_buckets(tiny_v41_dir, monkeypatch):
    """num_speculative_tokens = 3 on the CUDA bucket spec: a step of verification rows (1 + 3 tokens
    each, fewer near max_tokens) replays the graph of its row bucket x 4 tokens, and greedy with
    oracle drafts (accepted runs and rejections at every depth) gives exactly the eager plain tokens."""
    d = tiny_v41_dir
    model = build_model(ModelConfig.from_pretrained(d), str(d), torch.float32, progress=False)
    plain, _, _ = _verify_run(d, model, EagerStrategy, drafts=0)
    got, runner, stats = _verify_run(d, model, "graphs", oracle_of=plain, monkeypatch=monkeypatch)
    assert got == plain
    assert isinstance(runner, CudaGraphStrategy) and runner.replays > 0
    verify = [b for b in runner.graphs if b.num_tokens == 4 * b.num_seqs]
    assert verify
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


# -- on a GPU -------------------------------------------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("kind", ["v4", "v41"])
def test_cuda_graphs_equal_eager_on_gpu(kind, tiny_v4_dir, tiny_v41_dir, monkeypatch):
    from deepinfer.platforms.cuda import CudaPlatform
    d = tiny_v4_dir if kind == "v4" else tiny_v41_dir
    platform = CudaPlatform()
    model = build_model(ModelConfig.from_pretrained(d), str(d), torch.float32, progress=False, platform=platform)
    prompts = _prompts(5, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    kw = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=512)

    def run(strategy_cls):
        cfg = ModelConfig.from_pretrained(d)
        ec = EngineConfig(model=str(d), dtype="float32", **kw).resolve(cfg)
        worker = Worker(cfg, ec, model=model, strategy_cls=strategy_cls, platform=platform)
        llm = LLM.from_engine(LLMEngine(ec, model_config=cfg, worker=worker))
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)], worker.runner.strategy
    want, _ = run(EagerStrategy)
    got, runner = run(None)
    assert isinstance(runner, CudaGraphStrategy) and runner.num_graphs >= 1 and runner.replays > 0
    assert got == want


@needs_cuda
def test_grouped_static_moe_on_gpu():
    from deepinfer.model_executor.layers import moe
    g = torch.Generator().manual_seed(0)
    t, d, e, inter, k = 16, 64, 8, 32, 2
    x = torch.randn(t, d, generator=g).bfloat16().cuda()
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).cuda()
    w = torch.rand(t, k, generator=g).cuda()
    w13 = (torch.randn(e, 2 * inter, d, generator=g) * 0.3).bfloat16().cuda()
    w2 = (torch.randn(e, d, inter, generator=g) * 0.3).bfloat16().cuda()
    want = moe.routed_experts(x, idx, w, w13, w2, 4.0).float()
    got = moe.grouped_static_experts(x, idx, w, w13, w2, 4.0).float()
    assert (got - want).abs().max().item() <= 2e-2 * want.abs().max().item()


@needs_cuda
def test_verification_graphs_equal_eager_on_gpu(tiny_v41_dir, monkeypatch):
    """Verification rows captured and replayed on the GPU give the eager speculative tokens (and the
    plain greedy ones)."""
    from deepinfer.platforms.cuda import CudaPlatform
    d = tiny_v41_dir
    platform = CudaPlatform()
    model = build_model(ModelConfig.from_pretrained(d), str(d), torch.float32, progress=False, platform=platform)
    plain, _, _ = _verify_run(d, model, EagerStrategy, platform=platform, drafts=0)
    eager, _, _ = _verify_run(d, model, EagerStrategy, platform=platform, oracle_of=plain, monkeypatch=monkeypatch)
    got, runner, stats = _verify_run(d, model, "graphs", platform=platform)   # oracle still patched
    assert isinstance(runner, CudaGraphStrategy) and runner.replays > 0
    assert any(b.num_tokens == 4 * b.num_seqs for b in runner.graphs)
    assert got == eager == plain and stats.num_accepted_tokens > 0
