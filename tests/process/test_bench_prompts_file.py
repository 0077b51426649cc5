"""bench_neuron.py --prompts-file: JSON-lines prompts (text tokenized as the engine does, or token
ids) replace the random ones, bad lines fail with their line number, and an offline cell runs
exactly the file's prompts."""
import json

import pytest

from tests.support import load_script

bench_neuron = load_script("examples/neuron/bench_neuron.py")
from bench_lib.prompts import FilePrompts  # noqa: E402


def test_file_prompts_tokenize_text_take_ids_and_cycle(tmp_path, tiny_v41_dir):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "count: 1 2 3"}) + "\n\n" + json.dumps({"prompt": [0, 5, 6]}) + "\n")
    prompts = FilePrompts.from_file(str(f), str(tiny_v41_dir))
    assert prompts.prompts[0][0] == 0 and len(prompts.prompts[0]) > 3   # BOS, then the text's tokens
    assert prompts.prompts[1] == [0, 5, 6] and prompts.max_len == len(prompts.prompts[0])
    assert prompts.make(3) == [prompts.prompts[0], prompts.prompts[1], prompts.prompts[0]]


@pytest.mark.parametrize("line", ['{"text": "x"}', '{"prompt": ""}', '{"prompt": [1, "a"]}', "not json"])
def test_bad_prompt_lines_name_their_line(tmp_path, line):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": [1, 2]}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=r"p.jsonl:2"):
        FilePrompts.from_file(str(f), str(tmp_path))


def test_offline_cell_runs_the_files_prompts(tmp_path, tiny_v41_dir):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ("copy: river lamp =", "keys: k01=dog ; k01 ->")))
    out = tmp_path / "r.json"
    rc = bench_neuron.main(["--model", str(tiny_v41_dir), "--prompts-file", str(f), "--output-lens", "3",
                            "--concurrency", "1", "--num-prompts", "2", "--num-warmups", "0", "--out", str(out)])
    assert rc == 0
    (rec,) = json.loads(out.read_text())["records"]
    assert rec["input_len"] == FilePrompts.from_file(str(f), str(tiny_v41_dir)).max_len
    assert rec["completed"] == 2 and rec["failed"] == 0
