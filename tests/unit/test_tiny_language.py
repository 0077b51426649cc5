"""examples/tiny_language.py: the language's rules as docs/tiny_language.md states them, the word
list the doc's `words:` line gives, and seeded determinism."""
import random
import re

from tests.support import REPO, load_script

lang = load_script("examples/tiny_language.py")


def test_doc_words_line_is_the_generators_list():
    lines = [ln for ln in (REPO / "docs" / "tiny_language.md").read_text().splitlines() if ln.startswith("words:")]
    assert len(lines) == 1
    words = lines[0][len("words:"):].split()
    assert words == list(lang.WORDS) and len(set(words)) == 64
    assert all(re.fullmatch(r"[a-z]+", w) for w in words)


def test_lines_follow_the_rules():
    rng = random.Random(5)
    for _ in range(60):
        count = lang.line(rng, "count")
        m = re.fullmatch(r"count(?: by ([2-9]))?: ([0-9 ]+)\n", count)
        assert m, count
        step = int(m.group(1) or 1)
        nums = [int(x) for x in m.group(2).split()]
        assert 0 <= nums[0] <= 999 and all(b - a == step for a, b in zip(nums, nums[1:]))
        copy = lang.line(rng, "copy")
        head, tail = copy[len("copy: "):-1].split(" = ")
        assert copy.startswith("copy: ") and head == tail and 3 <= len(head.split()) <= 12
        assert set(head.split()) <= set(lang.WORDS)
        for kind, width, lo, hi in (("lookup", 2, 4, 32), ("long_lookup", 3, 200, 800)):
            text = lang.line(rng, kind)
            pairs_text, query = text[len("keys: "):-1].split(" ; ")
            pairs = dict(p.split("=") for p in pairs_text.split())
            keys = [p.split("=")[0] for p in pairs_text.split()]
            assert lo <= len(keys) <= hi and len(set(keys)) == len(keys)
            assert all(re.fullmatch(rf"k[0-9]{{{width}}}", k) for k in keys)
            key, value = query.split(" -> ")
            assert pairs[key] == value and value in lang.WORDS


def test_prompts_are_lines_cut_before_their_answer_and_seeded():
    for kind in lang.KINDS:
        prompts = lang.heldout_prompts(kind, 20, seed=3)
        assert prompts == lang.heldout_prompts(kind, 20, seed=3)
        assert prompts != lang.heldout_prompts(kind, 20, seed=4)
        for p in prompts:
            assert p.correct(p.answer + " anything after") and not p.correct(p.answer[:-1])
            if kind == "count":
                assert len(p.answer.split()) == lang.COUNT_ANSWER_NUMBERS
            else:
                assert p.answer.endswith("\n")
                assert p.prompt.endswith(" =" if kind == "copy" else " ->")
