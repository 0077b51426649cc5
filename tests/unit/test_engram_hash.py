"""Engram host-side hashing (docs/model.md §3.7, tiny V4.1 config of §7.2)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from deepinfer.model_executor.layers import engram_hash as eh

V = 129280
V_C = 99092


def tiny_cfg(**overrides):
    cfg = dict(engram_layer_ids=[1, 3], engram_max_ngram_size=3, engram_vocab_size=1009, engram_n_heads=2,
               engram_pad_token_id=2, engram_compressed_vocab=True, vocab_size=V)
    cfg.update(overrides)
    return SimpleNamespace(**cfg)


@pytest.fixture(scope="module")
def spec():
    return eh.EngramHashSpec.from_config(tiny_cfg())


# ----------------------------------------------------------------------------- layout


def test_tiny_primes_offsets_rows(spec):
    l1, l3 = spec.layer(1), spec.layer(3)
    assert l1.primes == ((1009, 1013), (1019, 1021))
    assert l3.primes == ((1031, 1033), (1039, 1049))
    assert (l1.num_rows, l3.num_rows) == (4062, 4152)
    assert l1.offsets == ((0, 1009), (2022, 3041))
    assert l3.offsets == ((0, 1031), (2064, 3103))


def test_primes_restart_per_order_and_skip_used():
    # 4 heads, N=4: first (layer, n) takes the first four primes >= 10, the next restarts at 11 and skips them.
    primes = eh.compute_primes([0, 5], 4, 2, 10)
    assert primes[0] == ((11, 13), (17, 19), (23, 29))
    assert primes[5] == ((31, 37), (41, 43), (47, 53))
    # A vocab size that is itself prime is the first candidate (nextprime(v - 1)).
    assert eh.compute_primes([0], 2, 1, 13)[0] == ((13,),)


def test_next_prime_matches_sieve():
    limit = 6000
    sieve = np.ones(limit + 200, dtype=bool)
    sieve[:2] = False
    for i in range(2, int((limit + 200) ** 0.5) + 1):
        if sieve[i]:
            sieve[i * i::i] = False
    primes = np.nonzero(sieve)[0]
    for n in range(0, limit):
        assert eh.next_prime(n) == primes[np.searchsorted(primes, n)]
    assert eh.is_prime(2**61 - 1) and not eh.is_prime((2**31 - 1) * (2**31 + 11))


def test_multipliers_exact_numpy_call(spec):
    assert spec.num_compressed == V_C
    bound = (2**63 - 1) // V_C // 2
    for lid in (1, 3):
        expected = np.random.default_rng(10007 * lid).integers(0, bound, size=3, dtype=np.int64) * 2 + 1
        mult = spec.layer(lid).multipliers
        np.testing.assert_array_equal(mult, expected)
        assert mult.dtype == np.int64 and np.all(mult % 2 == 1) and np.all(mult > 0)
        # Largest product stays below 2^63 (no overflow in int64).
        assert (V_C - 1) * int(mult.max()) < 2**63
    assert not np.array_equal(spec.layer(1).multipliers, spec.layer(3).multipliers)


def test_uncompressed_uses_identity_and_vocab_size():
    spec = eh.EngramHashSpec.from_config(tiny_cfg(engram_compressed_vocab=False, vocab_size=500))
    assert spec.num_compressed == 500 and spec.pad_id == 2
    np.testing.assert_array_equal(spec.old2new, np.arange(500))
    bound = (2**63 - 1) // 500 // 2
    expected = np.random.default_rng(10007).integers(0, bound, size=3, dtype=np.int64) * 2 + 1
    np.testing.assert_array_equal(spec.layer(1).multipliers, expected)


@pytest.mark.parametrize("field,value", [
    ("engram_max_ngram_size", 1), ("engram_n_heads", 0), ("engram_layer_ids", [1, 1]),
    ("engram_pad_token_id", V), ("engram_vocab_size", 1),
])
def test_config_validation(field, value):
    with pytest.raises(ValueError, match=field):
        eh.EngramHashSpec.from_config(tiny_cfg(**{field: value}))


# ----------------------------------------------------------------------------- compressed vocab


def test_shipped_table():
    old2new = eh.load_compressed_vocab(None, V)
    assert old2new.shape == (V,) and old2new.dtype == np.int64
    assert int(old2new.max()) + 1 == V_C
    np.testing.assert_array_equal(old2new[:3], [0, 1, 2])
    # Compressed ids are numbered in order of first occurrence.
    _, first = np.unique(old2new, return_index=True)
    assert np.all(np.diff(first) > 0)
    with pytest.raises(ValueError, match="vocab_size"):
        eh.load_compressed_vocab(None, V + 1)


def test_rebuild_from_real_tokenizer_matches_shipped():
    # ~2-3 s on 2 cores: decode_batch and the normalizer run in Rust.
    tok = eh.as_backend_tokenizer(eh.default_tokenizer_path())
    rebuilt = eh.build_compressed_vocab(tok)
    assert int(rebuilt.max()) + 1 == V_C
    np.testing.assert_array_equal(rebuilt, eh.load_compressed_vocab(None, V))
    # The fingerprint recognises the shipped tokenizer, so load_compressed_vocab does not rebuild.
    assert eh.load_compressed_vocab(tok, V) is eh.load_compressed_vocab(None, V)


def _word_tokenizer(tokens):
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=tokens[0]))


def test_normalization_keys():
    tokens = ["<unk>", "Hello", "héllo", "HELLO", " ", "  ", "\t\n", " x ", "x", "Ａ", "a", "a  b",
              "a b", "\ufffdab", "\u0301", "ﬁ", "fi"]
    old2new = eh.build_compressed_vocab(_word_tokenizer(tokens))
    c = dict(zip(tokens, old2new.tolist()))
    assert c["<unk>"] == 0 and c["Hello"] == 1
    assert c["héllo"] == c["HELLO"] == c["Hello"]          # accents stripped, lowercased
    assert c[" "] == c["  "] == c["\t\n"] == 2              # whitespace runs -> kept single space
    assert c[" x "] == c["x"] == 3                          # stripped
    assert c["Ａ"] == c["a"] == 4                           # NFKC fullwidth
    assert c["a  b"] == c["a b"] == 5
    assert c["\ufffdab"] == 6                               # raw-string key, not merged
    assert c["\u0301"] == 7                                 # normalizes to "", keeps its own text
    assert c["ﬁ"] == c["fi"] == 8                           # NFKC ligature
    assert int(old2new.max()) == 8


def test_other_tokenizer_is_rebuilt_not_shipped():
    tok = _word_tokenizer(["<unk>", "A", "a", "b"])
    np.testing.assert_array_equal(eh.load_compressed_vocab(tok, 4), [0, 1, 1, 2])


# ----------------------------------------------------------------------------- hash


def ref_indices(spec, layer_id, g_row):
    """Per-element Python-int reference of docs/model.md §3.7 Hash."""
    lh = spec.layer(layer_id)
    products = []
    for j, g in enumerate(g_row):
        p = int(g) * int(lh.multipliers[j])
        assert 0 <= p < 2**63
        products.append(p)
    out, h = [], products[0]
    for i in range(1, spec.max_ngram_size):
        h ^= products[i]
        for head in range(spec.n_heads):
            out.append(h % lh.primes[i - 1][head] + lh.offsets[i - 1][head])
    return out


def test_indices_match_reference_and_ranges(spec):
    gen = torch.Generator().manual_seed(0)
    G = torch.randint(0, V_C, (200, 3), generator=gen, dtype=torch.int64)
    G[0] = V_C - 1
    G[1] = 0
    for lid in (1, 3):
        got = eh.engram_indices(spec, lid, G)
        assert got.shape == (200, 4) and got.dtype == torch.int64
        expected = torch.tensor([ref_indices(spec, lid, row.tolist()) for row in G])
        assert torch.equal(got, expected)
        lh = spec.layer(lid)
        lo, width = torch.tensor(lh.flat_offsets), torch.tensor(lh.flat_primes)
        assert torch.all(got >= lo) and torch.all(got < lo + width)
        assert int(got.max()) < lh.num_rows
    all_layers = eh.engram_indices_all(spec, G)
    assert set(all_layers) == {1, 3} and torch.equal(all_layers[3], eh.engram_indices(spec, 3, G))
    with pytest.raises(ValueError, match="G"):
        eh.engram_indices(spec, 1, G[:, :2])
    with pytest.raises(ValueError, match="layer_id"):
        eh.engram_indices(spec, 2, G)


# ----------------------------------------------------------------------------- n-gram ids


def ref_ngram_row(tokens, pos, old2new, N, pad, starts=(), ends=()):
    row = []
    for j in range(N):
        p = pos - j
        crossed = any(tokens[q] in starts for q in range(max(p + 1, 0), pos + 1)) or \
            any(tokens[q] in ends for q in range(max(p, 0), pos))
        row.append(int(old2new[pad]) if p < 0 or crossed else int(old2new[tokens[p]]))
    return row


def _random_seqs(rng):
    seqs = []
    for length, start, num in [(1, 0, 1), (7, 0, 7), (9, 1, 3), (12, 11, 1), (20, 5, 0), (30, 2, 25), (5, 4, 1)]:
        tokens = rng.integers(0, 40, size=length).tolist()
        seqs.append((tokens, start, num))
    return seqs


@pytest.mark.parametrize("N", [2, 3, 4])
def test_batch_ngram_ids_match_reference(spec, N):
    rng = np.random.default_rng(N)
    seqs = _random_seqs(rng)
    # Use real ids whose compressed ids differ from the raw ones, plus the pad and BOS/EOS.
    vocab_pick = np.array([0, 1, 2] + rng.integers(3, V, size=37).tolist())
    seqs = [([int(vocab_pick[t]) for t in toks], s, n) for toks, s, n in seqs]
    G = eh.batch_ngram_ids(seqs, spec.old2new, N, 2)
    expected = [ref_ngram_row(toks, s + t, spec.old2new, N, 2) for toks, s, n in seqs for t in range(n)]
    assert G.dtype == torch.int64 and G.shape == (len(expected), N)
    assert G.tolist() == expected
    # The per-sequence variant gives the same rows.
    rows = [eh.ngram_ids(toks, torch.arange(s, s + n), spec.old2new, N, 2) for toks, s, n in seqs]
    assert torch.equal(torch.cat(rows), G)


def test_batch_ngram_ids_segment_reset(spec):
    rng = np.random.default_rng(7)
    seqs = [(rng.integers(0, 6, size=length).tolist(), s, n) for length, s, n in [(25, 0, 25), (18, 3, 15), (9, 8, 1)]]
    G = eh.batch_ngram_ids(seqs, spec.old2new, 4, 2, segment_start_ids=[0], segment_end_ids=[1])
    expected = [ref_ngram_row(toks, s + t, spec.old2new, 4, 2, starts={0}, ends={1})
                for toks, s, n in seqs for t in range(n)]
    assert G.tolist() == expected
    plain = eh.batch_ngram_ids(seqs, spec.old2new, 4, 2)
    assert not torch.equal(plain, G)       # the reset is live on this data


def test_batch_ngram_ids_validation_and_empty(spec):
    assert eh.batch_ngram_ids([], spec.old2new, 3, 2).shape == (0, 3)
    with pytest.raises(ValueError, match="seqs"):
        eh.batch_ngram_ids([([5, 6], 1, 2)], spec.old2new, 3, 2)
    with pytest.raises(ValueError, match="token_ids"):
        eh.batch_ngram_ids([([5, V], 0, 2)], spec.old2new, 3, 2)
    with pytest.raises(ValueError, match="positions"):
        eh.ngram_ids([5, 6], torch.tensor([2]), spec.old2new, 3, 2)


def test_end_to_end_prompt(spec):
    tok = eh.as_backend_tokenizer(eh.default_tokenizer_path())
    ids = [0] + tok.encode("Hello hello world", add_special_tokens=False).ids   # "Hello", "Ġhello", "Ġworld"
    assert len(ids) == 4 and ids[1] != ids[2]
    G = spec.batch_ngram_ids([(ids, 0, len(ids))])
    c = spec.old2new
    assert G.tolist() == [[0, 2, 2], [c[ids[1]], 0, 2], [c[ids[2]], c[ids[1]], 0], [c[ids[3]], c[ids[2]], c[ids[1]]]]
    assert G[1, 0] == G[2, 0]                                   # "Hello" and " hello" share a compressed id
    idx = eh.engram_indices(spec, 1, G)
    assert idx.shape == (4, 4)
    # Equal current tokens, different previous tokens (BOS vs "Hello"): different 2-gram rows.
    assert not torch.equal(idx[1, :2], idx[2, :2])
