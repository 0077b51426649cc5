"""A model path that is not a checkpoint, or a damaged safetensors file, fails with an error that
names the path and says what is wrong, through the loader and through LLM(...)."""
import shutil

import pytest
import torch

from deepinfer import LLM
from deepinfer.config import ModelConfig
from deepinfer.model_executor.loader import load_weights, stored_formats


def _damaged_copy(src, dst, keep_fraction: float | None):
    """dst: a copy of checkpoint `src` whose model.safetensors is cut to `keep_fraction` of its
    bytes (an interrupted download), or, with None, has its header overwritten by garbage."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copyfile(f, dst / f.name)
    size = (src / "model.safetensors").stat().st_size
    with open(src / "model.safetensors", "rb") as fin, open(dst / "model.safetensors", "wb") as fout:
        if keep_fraction is None:
            fout.write(b"\x7f" * 64)
            fin.seek(64)
            shutil.copyfileobj(fin, fout)
        else:
            fout.write(fin.read(int(size * keep_fraction)))
    return dst / "model.safetensors"


def test_llm_on_a_missing_directory_says_it_does_not_exist(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=r"model directory .*no-such-model.* does not exist"):
        LLM(str(missing))
    with pytest.raises(ValueError, match=r"model directory .*no-such-model.* does not exist"):
        LLM(str(missing), skip_tokenizer_init=True)
    (tmp_path / "a-file").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"a-file.* is not a directory"):
        LLM(str(tmp_path / "a-file"))


def test_model_config_on_a_missing_directory(tmp_path):
    with pytest.raises(ValueError, match=r"config.json not found: the model directory .*nope.* does not exist"):
        ModelConfig.from_pretrained(tmp_path / "nope")


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.0, None], ids=["half", "last-bytes", "empty", "garbage-header"])
def test_loader_names_a_truncated_or_corrupt_file(tiny_v4_dir, tmp_path, keep):
    bad = _damaged_copy(tiny_v4_dir, tmp_path / "ckpt", keep)
    cfg = ModelConfig.from_pretrained(tiny_v4_dir)
    with pytest.raises(ValueError, match=rf"{bad}: the safetensors file is incomplete or corrupt"):
        stored_formats(bad.parent)
    with pytest.raises(ValueError, match=rf"{bad}: the safetensors file is incomplete or corrupt"):
        load_weights(bad.parent, {"embed.weight": ((cfg.vocab_size, cfg.hidden_size), torch.float32)},
                     progress=False, partial=True)


def test_llm_on_a_truncated_shard_names_the_file(tiny_v4_dir, tmp_path):
    bad = _damaged_copy(tiny_v4_dir, tmp_path / "ckpt", 0.5)
    with pytest.raises(ValueError, match=rf"{bad}: the safetensors file is incomplete or corrupt"):
        LLM(str(bad.parent), dtype="float32", max_model_len=64, max_num_seqs=2)
    # the original is untouched and still loads
    assert stored_formats(tiny_v4_dir)
