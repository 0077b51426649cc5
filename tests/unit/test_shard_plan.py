"""A rank's slices (model_executor/shard_plan.py), the loader reading only them, placeholder rows
selecting no expert (StepInputs.token_valid) and the EP byte packing (layers/ep_moe.py); in one
process (the collectives themselves are tested across processes in tests/process/test_multi_rank_model.py)."""
import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.distributed.groups import ParallelGroups
from deepinfer.distributed.parallel_layout import ParallelLayout
from deepinfer.model_executor import loader
from deepinfer.model_executor.loader import decode as loader_decode
from deepinfer.model_executor.forward_meta import SeqChunk, build_step_inputs, step_to
from deepinfer.model_executor.layers import ep_moe
from deepinfer.model_executor.layers.kernel_table import KernelTable
from deepinfer.model_executor.models.v4_ffn import MoE
from deepinfer.model_executor.shard_plan import Cut, ShardPlan, block_region, head_shard
from deepinfer.model_executor.static_step import Bucket, BucketSpec
from deepinfer.worker.cache_engine import cache_layout
from deepinfer.worker.worker import build_model
from tests.support.model_helpers import tiny_config


def test_head_shards_of_the_tiny_and_the_flash_shapes():
    cfg = tiny_config("v41")   # 4 heads of 128 in 2 output groups
    whole = [head_shard(cfg, 2, r) for r in range(2)]   # one group a rank
    assert [(s.head0, s.heads, s.group0, s.groups, s.col0, s.cols) for s in whole] == \
        [(0, 2, 0, 1, 0, 256), (2, 2, 1, 1, 0, 256)]
    part = [head_shard(cfg, 4, r) for r in range(4)]    # one head: half a group
    assert [(s.group0, s.col0, s.cols, s.whole) for s in part] == \
        [(0, 0, 128, False), (0, 128, 128, False), (1, 0, 128, False), (1, 128, 128, False)]
    flash = ModelConfig.from_pretrained("examples/configs/v41-flash.json")
    s = head_shard(flash, 8, 3)    # 64 heads in 8 groups, lanes of 8: one group a rank
    assert (s.head0, s.heads, s.group0, s.groups, s.whole) == (24, 8, 3, 1, True)
    with pytest.raises(ValueError, match="must divide num_heads"):
        head_shard(cfg, 3, 0)


def test_cuts_name_the_head_rows_the_group_columns_and_the_experts():
    cfg = tiny_config("v41")
    plan = ShardPlan(cfg, ParallelLayout(rank=3, cp=4, ep=4, attn_tp=4))
    assert plan.cuts("layers.2.attn.wq_b.weight") == (Cut(0, 384, 128, 512),)
    assert plan.cuts("mtp.0.attn.attn_sink") == (Cut(0, 3, 1, 4),)
    assert plan.cuts("layers.0.attn.wo_a.weight") == (Cut(0, 64, 64, 128), Cut(1, 128, 128, 256))
    assert plan.cuts("layers.0.attn.wo_b.weight") == (Cut(1, 64, 64, 128),)
    assert plan.cuts("layers.0.attn.wq_a.weight") == () and plan.cuts("layers.0.attn.wkv.weight") == ()
    assert plan.holds("layers.1.ffn.experts.7.w2.weight") and not plan.holds("layers.1.ffn.experts.5.w2.weight")
    assert plan.moe_experts("mtp.1.ffn.experts.3.w1.weight") == range(3, 4)   # 4 DSpark experts
    assert plan.holds("layers.1.ffn.shared_experts.w1.weight")
    with pytest.raises(ValueError, match="expert_parallel_size 3"):
        ShardPlan(cfg, ParallelLayout(rank=0, cp=3, ep=3, attn_tp=1))


def test_head_splits_by_vocabulary_only_over_a_cp_group_that_divides_it():
    cfg = tiny_config("v41")   # vocab 129280 = 2^7 x 1010
    split = ShardPlan(cfg, ParallelLayout(rank=1, cp=4, ep=1, attn_tp=1))
    assert split.vocab_split and split.vocab == range(32320, 64640)
    assert split.cuts("head.weight") == (Cut(0, 32320, 32320, 129280),)
    whole = ShardPlan(cfg, ParallelLayout(rank=1, cp=3, ep=1, attn_tp=1))   # 129280 % 3 != 0
    assert not whole.vocab_split and whole.vocab == range(129280) and whole.cuts("head.weight") == ()


def test_packed_slices_must_fit_the_scale_grid():
    assert block_region("w", Cut(0, 64, 64, 128), 128) == (0, 1)      # inside one block
    assert block_region("w", Cut(0, 128, 256, 512), 128) == (1, 3)    # starts on a block
    with pytest.raises(ValueError, match=r"tensor 'w'.*\[64, 192\).*128-wide scale block"):
        block_region("w", Cut(0, 64, 128, 512), 128)


@pytest.mark.parametrize("fmt", ["dense", "packed"])
def test_a_rank_loads_exactly_its_slices_and_reads_nothing_else(tiny_v41_l4_dir, fmt, monkeypatch):
    ckpt = tiny_v41_l4_dir
    cfg = ModelConfig.from_pretrained(ckpt)
    whole = build_model(cfg, str(ckpt), torch.float32, progress=False, weight_format=fmt).state_dict()
    reads = []
    real = loader_decode.read_slice

    def spy(f, key, ndim, region):
        reads.append((key, dict(region)))
        return real(f, key, ndim, region)
    monkeypatch.setattr(loader_decode, "read_slice", spy)
    layout = ParallelLayout(rank=1, cp=4, ep=4, attn_tp=4)   # head 1: half of group 0; experts 2, 3
    plan = ShardPlan(cfg, layout)
    # the groups of a rank without a process group: same shapes, identity collectives
    # (no store either: the Engram tables are loaded privately, not shared through /dev/shm)
    model = build_model(cfg, str(ckpt), torch.float32, progress=False, weight_format=fmt,
                        parallel=ParallelGroups(layout), shared_tables=False)
    mine = model.state_dict()
    assert not any(plan.holds(k) is False for k in mine)
    assert sorted({int(k.split(".")[4]) for k in mine if k.startswith("layers.0.ffn.experts.")}) == [2, 3]
    for name, t in mine.items():
        ref = whole[name]
        for c in plan.cuts(name.removesuffix(".scale") + ".weight" if name.endswith(".scale") else name):
            if name.endswith(".scale"):   # packed: the scale rows / columns of the slice's blocks
                block = model.get_submodule(name.rsplit(".", 1)[0]).block[c.dim]
                first, stop = block_region(name, c, block)
                ref = ref.narrow(c.dim, first, stop - first)
            else:
                ref = ref.narrow(c.dim, c.start, c.size)
        assert t.shape == ref.shape and torch.equal(t, ref), name
    def weight_of(key):
        return key.removesuffix(".scale") + ".weight" if key.endswith(".scale") else key
    sharded = [(k, region) for k, region in reads if plan.cuts(weight_of(k))]
    assert len(sharded) >= 4 * 2 and all(region for _, region in sharded)   # wq_b, sink, wo_a, wo_b a layer
    read_experts = {int(k.split(".")[4]) for k, _ in reads if ".ffn.experts." in k and k.startswith("layers.")}
    assert read_experts == {2, 3}


def _steps(cfg):
    layout = cache_layout(cfg, 3, 32, None)
    chunks = [SeqChunk(1, 0, 5, [1, 2], list(range(3, 8)), 1), SeqChunk(2, 0, 3, [3], [9, 10, 11], 1)]
    spec = BucketSpec(batch=(4,), contexts=(64,), prefill_tokens=(16,), max_model_len=64)
    return build_step_inputs(chunks, layout), spec.static_step(chunks, Bucket(4, 16, 64), layout)


def test_token_valid_marks_placeholder_rows_and_survives_padding():
    plain, padded = _steps(tiny_config("v4", layers=1))
    assert plain.token_valid.tolist() == [True] * 8
    assert padded.static_shapes and padded.token_valid.tolist() == [True] * 8 + [False] * 8
    assert step_to(padded, "meta").token_valid.device.type == "meta"


@pytest.mark.parametrize("static", [False, True])
def test_placeholder_rows_select_no_expert_and_real_rows_are_unchanged(static):
    torch.manual_seed(0)
    cfg = tiny_config("v41", layers=1)
    moe = MoE(cfg, False, torch.float32)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    moe.pack()
    k = KernelTable()
    x = torch.randn(6, cfg.hidden_size)
    ids = torch.arange(6)
    valid = torch.tensor([True, True, False, True, False, False])
    with torch.inference_mode():
        full = moe(x, ids, k, static)
        masked = moe(x, ids, k, static, token_valid=valid)
        s = moe.shared_experts
        shared = k.expert_mlp(x, s.w1.weight, s.w3.weight, s.w2.weight, cfg.swiglu_limit)
    assert torch.equal(masked[valid], full[valid])           # bitwise
    assert torch.equal(masked[~valid], shared[~valid])       # routed part exactly zero
    assert not torch.equal(full[~valid], shared[~valid])


def test_ep_rows_pack_as_bytes_and_unpack_exactly():
    x = torch.randn(5, 12).to(torch.bfloat16)
    w = torch.rand(5, 2)
    idx = torch.tensor([[0, 7], [3, 1], [-1, -1], [6, 2], [5, 4]])
    buf = ep_moe.pack_rows(x, w, idx)
    assert buf.dtype == torch.uint8 and buf.shape == (5, 12 * 2 + 2 * 4 + 2 * 4)
    x2, w2, idx2 = ep_moe.unpack_rows(torch.cat([buf, buf]), 12, torch.bfloat16, 2)
    assert torch.equal(x2[5:], x) and torch.equal(w2[:5], w) and torch.equal(idx2[5:], idx)


def test_stacked_transformers_experts_and_sinks_read_only_this_ranks_rows(tmp_path, monkeypatch):
    from types import SimpleNamespace
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(3)
    E, I, D = 4, 4, 6
    gate_up, down = torch.randn(E, 2 * I, D, generator=g), torch.randn(E, D, I, generator=g)
    sinks = torch.randn(4, generator=g)
    save_file({"model.layers.0.mlp.experts.gate_up_proj": gate_up, "model.layers.0.mlp.experts.down_proj": down,
               "model.layers.0.self_attn.sinks": sinks}, str(tmp_path / "model.safetensors"))
    cfg = SimpleNamespace(num_heads=4, o_groups=2, head_dim=8, o_lora_rank=4, n_routed_experts=E, is_v41=False)
    plan = ShardPlan(cfg, ParallelLayout(rank=1, cp=2, ep=2, attn_tp=2))
    f32 = torch.float32
    expected = {"layers.0.attn.attn_sink": ((2,), f32)}
    for e in plan.experts(E):
        expected.update({f"layers.0.ffn.experts.{e}.w1.weight": ((I, D), f32),
                         f"layers.0.ffn.experts.{e}.w3.weight": ((I, D), f32),
                         f"layers.0.ffn.experts.{e}.w2.weight": ((D, I), f32)})
    reads = []
    real = loader_decode.read_slice
    monkeypatch.setattr(loader_decode, "read_slice", lambda f, key, ndim, region: reads.append((key, region))
                        or real(f, key, ndim, region))
    out = loader.load_weights(tmp_path, expected, progress=False, plan=plan)
    assert torch.equal(out["layers.0.attn.attn_sink"], sinks[2:])
    for e in (2, 3):
        assert torch.equal(out[f"layers.0.ffn.experts.{e}.w1.weight"], gate_up[e, :I])
        assert torch.equal(out[f"layers.0.ffn.experts.{e}.w3.weight"], gate_up[e, I:])
        assert torch.equal(out[f"layers.0.ffn.experts.{e}.w2.weight"], down[e])
    assert sorted(reads) == [("model.layers.0.mlp.experts.down_proj", {0: (2, 4)}),
                             ("model.layers.0.mlp.experts.gate_up_proj", {0: (2, 4)}),
                             ("model.layers.0.self_attn.sinks", {0: (2, 4)})]


def test_a_flash_rank_builds_on_meta_under_a_fake_64_rank_group():
    """The full-scale dry run's premise: a rank of V4.1-Flash at cp = ep = 64, lanes of 8, built on
    meta tensors under torch's fake process group, holds only its slices."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from deepinfer.model_executor.models.deepseek_v4 import DeepseekV4Model
    cfg = ModelConfig.from_pretrained("examples/configs/v41-flash.json")
    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=9, world_size=64)
    try:
        groups = ParallelGroups.create(ParallelLayout(rank=9, cp=64, ep=64, attn_tp=8))
        with torch.device("meta"):
            model = DeepseekV4Model(cfg, torch.bfloat16, parallel=groups)
        sd = model.state_dict()
    finally:
        dist.destroy_process_group()
    d, r = cfg.head_dim, cfg.o_lora_rank
    assert sd["layers.0.attn.wq_b.weight"].shape == (8 * d, cfg.q_lora_rank)   # heads 8..15
    assert sd["layers.0.attn.wo_a.weight"].shape == (r, 8 * d)                  # output group 1
    assert sd["layers.0.attn.wo_b.weight"].shape == (cfg.hidden_size, r)
    assert sd["mtp.0.attn.attn_sink"].shape == (8,)
    held = {k.split(".")[4] for k in sd if k.startswith("layers.0.ffn.experts.")}
    assert held == {str(e) for e in range(54, 60)}                              # 384 / 64 = 6 experts
    assert {k.split(".")[4] for k in sd if k.startswith("mtp.0.ffn.experts.")} == {"18", "19"}
    assert sd["layers.0.attn.wq_a.weight"].shape == (cfg.q_lora_rank, cfg.hidden_size)   # replicated


@pytest.mark.parametrize("replicated", [True, False])
@pytest.mark.parametrize("static", [False, True])
def test_expert_halves_sum_to_the_whole_moe_and_placeholders_route_nowhere(replicated, static):
    """Two EP ranks' MoEs (experts 0-3 and 4-7) without a process group: each returns its partial
    routed sum plus the shared expert (the collectives are identities), through the same dispatch
    code as across processes (packed bytes when the tokens are not replicated)."""
    torch.manual_seed(1)
    cfg = tiny_config("v41", layers=1)
    whole = MoE(cfg, False, torch.float32)
    with torch.no_grad():
        for p in whole.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    sd = whole.state_dict()
    halves = []
    for held in (range(0, 4), range(4, 8)):
        half = MoE(cfg, False, torch.float32, experts=held, ep=None, tokens_replicated=replicated)
        half.load_state_dict({k: v for k, v in sd.items() if k in half.state_dict()})
        halves.append(half)
    k = KernelTable()
    x, ids = torch.randn(7, cfg.hidden_size), torch.arange(7)
    valid = torch.tensor([True, False, True, True, True, False, True])
    with torch.inference_mode():
        want = whole(x, ids, k, static, token_valid=valid)
        parts = [h(x, ids, k, static, token_valid=valid) for h in halves]
        s = whole.shared_experts
        shared = k.expert_mlp(x, s.w1.weight, s.w3.weight, s.w2.weight, cfg.swiglu_limit)
    assert torch.allclose(parts[0] + parts[1] - shared, want, atol=1e-5)
    for part in parts:
        assert torch.equal(part[~valid], shared[~valid])
    assert sorted(halves[1].experts.keys()) == ["4", "5", "6", "7"] and halves[1]._w13.shape[0] == 4


@pytest.mark.parametrize("cap,overflows,replicated", [(64, False, True), (2, True, False)])
def test_capacity_form_equals_dense_and_falls_back_on_overflow(cap, overflows, replicated, monkeypatch):
    """Fixed-shape prompt steps: each held expert's pairs in `cap` slots; an overflowing expert sends
    the step to the dense form (torch.cond on the max-all-reduced flag: identity without a group)."""
    torch.manual_seed(2)
    cfg = tiny_config("v41", layers=1)
    whole = MoE(cfg, False, torch.float32)
    with torch.no_grad():
        for p in whole.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    half = MoE(cfg, False, torch.float32, experts=range(4, 8), ep=None, tokens_replicated=replicated)
    half.load_state_dict({n: v for n, v in whole.state_dict().items() if n in half.state_dict()})
    k = KernelTable()
    x, ids = torch.randn(64, cfg.hidden_size), torch.arange(64)
    valid = torch.arange(64) % 5 != 0
    with torch.inference_mode():
        dense = half(x, ids, k, True, token_valid=valid)     # 64 rows, 4 experts: dense by the policy
        monkeypatch.setattr(ep_moe, "capacity", lambda moe, rows: cap)
        got = half(x, ids, k, True, token_valid=valid)
        real = ep_moe.capacity_partials    # which branch ran: the slot form, marked by +1000
        monkeypatch.setattr(ep_moe, "capacity_partials", lambda *a: real(*a) + 1000.0)
        marked = half(x, ids, k, True, token_valid=valid)
    assert torch.allclose(marked - got, torch.full_like(got, 0.0 if overflows else 1000.0), atol=1e-3)
    assert torch.allclose(got, dense, atol=1e-5)
    s = half.shared_experts
    shared = k.expert_mlp(x, s.w1.weight, s.w3.weight, s.w2.weight, cfg.swiglu_limit)
    assert torch.equal(got[~valid], shared[~valid])


def test_capacity_policy_keeps_decode_steps_dense():
    cfg = ModelConfig.from_pretrained("examples/configs/v41-flash.json")
    moe = MoE.__new__(MoE)
    moe.topk, moe.n_experts, moe.n_local = cfg.n_experts_per_tok, cfg.n_routed_experts, 6
    assert ep_moe.capacity(moe, 64) is None      # a decode bucket: ~1 pair an expert, no flag collective
    assert ep_moe.capacity(moe, 128) is None     # a 128-token chunk at cp = ep: still a small load
    cap = ep_moe.capacity(moe, 64 * 128)         # 128-token chunks of 64 CP groups, gathered
    assert cap == 2 * 64 * 128 * cfg.n_experts_per_tok // cfg.n_routed_experts and 2 * 6 * cap <= 64 * 128
