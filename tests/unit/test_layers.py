"""Per-module checks against straightforward, independently written formulas (docs/model.md §3)."""
import math

import pytest
import torch

from deepinfer.model_executor.layers import hc, indexer, moe, rope
from deepinfer.model_executor.layers.attention import sink_attention
from deepinfer.model_executor.layers.compressor import gather_overlap_slots, pool_entries
from deepinfer.model_executor.layers.engram import engram_gate

g = torch.Generator().manual_seed(0)


def rnd(*shape):
    return torch.randn(*shape, generator=g, dtype=torch.float64).float()


@pytest.mark.parametrize("t", [1, 3, 32, 257, 2048])
def test_sinkhorn_token_major_layout_is_bit_equal(t):
    # the inference path normalises an [n, n, T] copy; every value must equal the autograd path's,
    # which normalises the [T, n, n] tensor itself, bit for bit, so prefill (many rows), decode (few)
    # and training agree
    def row_major(c0, iters):
        return hc.sinkhorn(c0.clone().requires_grad_(), iters, 1e-6).detach()
    for scale in (0.1, 1.0, 8.0):
        c0 = rnd(t, 4, 4) * scale
        got = hc.sinkhorn(c0, 20, 1e-6)
        assert got.is_contiguous() and torch.equal(got, row_major(c0, 20))
    c0 = rnd(2, t, 4, 4)   # leading dims beyond one are flattened and restored
    assert torch.equal(hc.sinkhorn(c0, 6, 1e-6), row_major(c0, 6))


def test_sinkhorn_matches_loop_and_is_doubly_stochastic():
    n, eps, iters = 4, 1e-6, 20
    c0 = rnd(3, n, n)
    got = hc.sinkhorn(c0, iters, eps)
    for b in range(3):
        m = [[0.0] * n for _ in range(n)]
        for j in range(n):
            row = [math.exp(float(c0[b, j, k])) for k in range(n)]
            s = sum(row)
            m[j] = [v / s + eps for v in row]
        for it in range(iters):
            if it > 0:
                for j in range(n):
                    s = sum(m[j]) + eps
                    m[j] = [v / s for v in m[j]]
            for k in range(n):
                s = sum(m[j][k] for j in range(n)) + eps
                for j in range(n):
                    m[j][k] /= s
        assert torch.allclose(got[b], torch.tensor(m), atol=1e-5)
    assert torch.allclose(got.sum(-1), torch.ones(3, n), atol=1e-3)
    assert torch.allclose(got.sum(-2), torch.ones(3, n), atol=1e-3)


def test_hc_mixes_pre_post_against_formula():
    t, n, d = 2, 4, 8
    x = rnd(t, n, d)
    fn, base, scale = rnd((2 + n) * n, n * d), rnd((2 + n) * n), rnd(3)
    pre, post, comb = hc.hc_mixes(x, fn, base, scale, 1e-6, 1e-6, 20)
    for i in range(t):
        flat = x[i].reshape(-1)
        m = fn @ (flat / torch.sqrt((flat ** 2).mean() + 1e-6))
        assert torch.allclose(pre[i], torch.sigmoid(m[:n] * scale[0] + base[:n]) + 1e-6, atol=1e-5)
        assert torch.allclose(post[i], 2 * torch.sigmoid(m[n:2 * n] * scale[1] + base[n:2 * n]), atol=1e-5)
    y = rnd(t, d)
    out = hc.hc_post_apply(x, y, post, comb)
    for i in range(t):
        for k in range(n):
            want = post[i, k] * y[i] + sum(comb[i, j, k] * x[i, j] for j in range(n))
            assert torch.allclose(out[i, k], want, atol=1e-5)


def test_interleaved_rope_matches_complex_rotation_and_inverts():
    r, d = 8, 12
    rot = rope.RotaryEmbedding(r, 10000.0)
    pos = torch.tensor([0, 3, 17])
    x = rnd(3, d)
    cos, sin = rot.cos_sin(pos)
    y = rope.apply_rope(x, cos, sin)
    assert torch.equal(y[:, : d - r], x[:, : d - r])
    for t in range(3):
        for i in range(r // 2):
            theta = 10000.0 ** (-2 * i / r)
            z = complex(x[t, d - r + 2 * i], x[t, d - r + 2 * i + 1]) * complex(math.cos(pos[t] * theta),
                                                                                  math.sin(pos[t] * theta))
            assert abs(y[t, d - r + 2 * i] - z.real) < 1e-4 and abs(y[t, d - r + 2 * i + 1] - z.imag) < 1e-4
    assert torch.allclose(rope.apply_rope(y, cos, sin, inverse=True), x, atol=1e-5)


def test_yarn_frequencies_follow_the_ramp():
    r, base = 64, 160000.0
    y = {"factor": 16, "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1}
    inv = rope.rope_inv_freq(r, base, y)
    plain = rope.rope_inv_freq(r, base)

    def corr(rot):
        return r * math.log(256 / (2 * math.pi * rot)) / (2 * math.log(base))
    lo, hi = max(math.floor(corr(32)), 0), min(math.ceil(corr(1)), r - 1)
    for i in range(r // 2):
        ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)
        want = plain[i] / 16 * ramp + plain[i] * (1 - ramp)
        assert abs(inv[i] - want) <= 1e-6 * abs(want)


def test_sink_attention_against_loop():
    t, h, k, d = 3, 2, 5, 4
    q, keys, sink = rnd(t, h, d), rnd(t, k, d), rnd(h)
    valid = torch.rand(t, k, generator=g) > 0.3
    out = sink_attention(q, keys, valid, sink, 0.5)
    for i in range(t):
        for hh in range(h):
            s = [float(q[i, hh] @ keys[i, j]) * 0.5 for j in range(k) if valid[i, j]]
            ks = [keys[i, j] for j in range(k) if valid[i, j]]
            den = math.exp(float(sink[hh])) + sum(math.exp(v) for v in s)
            want = sum((math.exp(v) / den) * kk for v, kk in zip(s, ks)) if ks else torch.zeros(d)
            assert torch.allclose(out[i, hh], want, atol=1e-5)


def test_overlap_pooling_against_loop():
    m, width = 4, 3
    rows = rnd(12, 2 * 2 * width)  # [c (2w) | z (2w)] per token
    src = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]])
    valid = torch.ones(1, 2 * m, dtype=torch.bool)
    c, z = gather_overlap_slots(rows, src, width, overlap=True)
    out = pool_entries(c, z, valid)[0]
    for ch in range(width):
        cs = [rows[j, ch] for j in range(4)] + [rows[j, width + ch] for j in range(4, 8)]
        zs = [rows[j, 2 * width + ch] for j in range(4)] + [rows[j, 3 * width + ch] for j in range(4, 8)]
        e = [math.exp(float(v)) for v in zs]
        want = sum(ev / sum(e) * float(cv) for ev, cv in zip(e, cs))
        assert abs(out[ch] - want) < 1e-5


def test_index_scores_and_stable_topk():
    t, n_i, e, d = 2, 3, 6, 4
    q, keys, w = rnd(t, n_i, d), rnd(t, e, d), rnd(t, n_i)
    valid = torch.ones(t, e, dtype=torch.bool)
    valid[1, 4:] = False
    s = indexer.index_scores(q, keys, w, valid, key_scale=0.5)
    for i in range(t):
        for j in range(e):
            want = sum(float(w[i, hh]) * max(0.0, float(q[i, hh] @ keys[i, j])) * 0.5 for hh in range(n_i))
            assert (s[i, j] == float("-inf")) if not valid[i, j] else abs(s[i, j] - want) < 1e-5
    ties = torch.tensor([[1.0, 3.0, 3.0, 0.0, float("-inf")]])
    assert indexer.stable_topk(ties, 3).tolist() == [[1, 2, 0]]
    assert indexer.stable_topk(ties, 5).tolist() == [[1, 2, 0, 3, -1]]


def test_candidate_blocks_force_last_block_and_sort_ascending():
    scores = torch.tensor([[5.0, 1, 0, 0, 9, 9, 2, 2, 0, 0, 0, float("-inf")]])
    n_vis = torch.tensor([11])
    sel = indexer.candidate_blocks(scores, n_vis, block=2, topk_blocks=3)
    # block maxima: [5, 0, 9, 2, 0, 0(last valid -> +inf)]; top-3 = {5(+inf), 2, 0} -> ascending
    assert sel.tolist() == [[0, 2, 5]]
    sel = indexer.candidate_blocks(scores[:, :3], torch.tensor([3]), block=2, topk_blocks=4)
    assert sel.tolist() == [[0, 1, -1, -1]]
    mask = indexer.candidate_entry_mask(torch.tensor([[0, 2, -1]]), 6, 2)
    assert mask.tolist() == [[True, True, False, False, True, True]]


def test_moe_routing_and_experts_against_loop():
    t, dim, e, inter, k = 5, 6, 4, 3, 2
    x, gw, bias = rnd(t, dim), rnd(e, dim), rnd(e) * 0.1
    idx, w = moe.route(x, gw, bias, k, 1.5)
    w13, w2 = rnd(e, 2 * inter, dim), rnd(e, dim, inter)
    y = moe.routed_experts(x, idx, w, w13, w2, 10.0)
    for i in range(t):
        s = [math.sqrt(math.log1p(math.exp(float(x[i] @ gw[j])))) for j in range(e)]
        order = sorted(range(e), key=lambda j: (-(s[j] + float(bias[j])), j))[:k]
        assert idx[i].tolist() == order
        tot = sum(s[j] for j in order)
        want = torch.zeros(dim)
        for j in order:
            a, b = w13[j, :inter] @ x[i], w13[j, inter:] @ x[i]
            act = torch.nn.functional.silu(a.clamp(max=10.0)) * b.clamp(-10.0, 10.0)
            want += (s[j] / tot * 1.5) * (w2[j] @ act)
        assert torch.allclose(y[i], want, atol=1e-4)


def test_engram_gate_against_formula():
    t, n, d = 2, 3, 8
    x, kv = rnd(t, n, d), rnd(t, (n + 1) * d)
    wq, wk = rnd(n, d), rnd(n, d)
    out = engram_gate(x, kv, wq, wk, 1e-6)
    for i in range(t):
        v = kv[i, n * d:]
        for s in range(n):
            k = kv[i, s * d:(s + 1) * d]
            rx = 1 / math.sqrt(float((x[i, s] ** 2).mean()) + 1e-6)
            rk = 1 / math.sqrt(float((k ** 2).mean()) + 1e-6)
            dot = float(((x[i, s] * wq[s]) * (k * wk[s])).sum()) * rx * rk / math.sqrt(d)
            gate = 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot)))
            assert torch.allclose(out[i, s], x[i, s] + gate * v, atol=1e-5)


def test_kv_cache_report_matches_deepseek_record_sizes():
    """V4.1-Flash in DeepSeek's compact records: 720 B/token main KV + 170 B/token index keys
    (docs/model.md §5.1), SWA 43 rings x 128 x 528 B, three C2 state rings of 2 fp32 [2, 512] rows."""
    import json

    from deepinfer.config import ModelConfig
    from deepinfer.worker.cache_engine import kv_cache_report

    from tests.support import REPO
    path = REPO / "examples" / "configs" / "v41-flash.json"
    cfg = ModelConfig.from_dict(json.loads(path.read_text()))
    r = kv_cache_report(cfg, "compact")
    assert r["detail"]["entries"] == 720 and r["detail"]["index"] == 170 and r["bytes_per_token"] == 890
    assert r["detail"]["swa"] == 43 * 128 * 528
    assert r["detail"]["state"] == 3 * 2 * 4096
    plain = kv_cache_report(cfg, "plain")
    assert plain["bytes_per_token"] == 3 * (512 * 2 + 128 * 2) / 2 + (512 * 2 + 128 * 2)


def test_grouped_and_looped_expert_paths_agree():
    t, dim, e, inter, k = 9, 6, 5, 3, 2
    x, gw = rnd(t, dim), rnd(e, dim)
    idx, w = moe.route(x, gw, None, k, 1.0)
    w13, w2 = rnd(e, 2 * inter, dim), rnd(e, dim, inter)
    a = moe._grouped_experts(x, idx, w, w13, w2, 10.0)
    b = moe._looped_experts(x, idx, w, w13, w2, 10.0)
    assert torch.allclose(a, b, atol=1e-5)


def test_routed_experts_loop_over_experts_once_they_get_many_rows(monkeypatch):
    e, dim, inter, k = 4, 8, 4, 2
    w13, w2 = rnd(e, 2 * inter, dim), rnd(e, dim, inter)
    calls = []
    for form in ("_grouped_experts", "_looped_experts"):
        real = getattr(moe, form)
        monkeypatch.setattr(moe, form, lambda *a, _f=form, _r=real: (calls.append(_f), _r(*a))[1])
    for t in (3, moe.LOOPED_MIN_ROWS_PER_EXPERT * e // k):
        x, gw = rnd(t, dim), rnd(e, dim)
        idx, w = moe.route(x, gw, None, k, 1.0)
        got = moe.routed_experts(x, idx, w, w13, w2, 10.0)
        want = moe._grouped_experts(x, idx, w, w13, w2, 10.0)   # the other form, for comparison
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls == ["_grouped_experts", "_grouped_experts", "_looped_experts", "_grouped_experts"]
    calls.clear()
    x = rnd(t, dim).requires_grad_()   # training keeps the grouped form (its backward's summation order)
    moe.routed_experts(x, idx, w, w13, w2, 10.0)
    assert calls == ["_grouped_experts"]
