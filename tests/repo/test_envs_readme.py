"""deepinfer.envs: the README table matches the registry, and values are read lazily."""
import re

import pytest

from deepinfer import envs

from tests.support import REPO

README = REPO / "README.md"
BEGIN, END = "<!-- envs:begin -->", "<!-- envs:end -->"


def _cells(line: str) -> list[str]:
    inner = line.strip().strip("|")
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", inner)]


def readme_rows() -> list[list[str]]:
    text = README.read_text(encoding="utf-8")
    assert BEGIN in text and END in text, f"README.md needs the {BEGIN} ... {END} block"
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    lines = [ln for ln in block.splitlines() if ln.strip().startswith("|")]
    assert _cells(lines[0]) == ["Variable", "Default", "Type", "Meaning"]
    return [_cells(ln) for ln in lines[2:]]


def test_readme_table_matches_registry():
    want = [[f"`{v.name}`", v.default_text, v.type_text.replace("\\|", "|"), v.meaning] for v in envs.ENV_VARS]
    got = readme_rows()
    assert got == want, "README env table is stale: regenerate it with `python -m deepinfer.envs`"


def test_readme_block_is_the_generated_table():
    block = README.read_text(encoding="utf-8").split(BEGIN, 1)[1].split(END, 1)[0]
    assert block.strip() == envs.markdown_table()


def test_every_name_is_prefixed_and_unique():
    names = [v.name for v in envs.ENV_VARS]
    assert len(names) == len(set(names))
    assert all(n.startswith("DEEPINFER_") for n in names)


def test_values_are_read_at_call_time(monkeypatch):
    monkeypatch.delenv("DEEPINFER_ACCELERATOR", raising=False)
    assert envs.get("DEEPINFER_ACCELERATOR") is None
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "Neuron")
    assert envs.get("DEEPINFER_ACCELERATOR") == "neuron"
    assert envs.DEEPINFER_ACCELERATOR == "neuron"
    monkeypatch.setenv("DEEPINFER_NEURON_HOST", "1")
    assert envs.DEEPINFER_NEURON_HOST is True
    monkeypatch.setenv("DEEPINFER_NEURON_CTX_BUCKETS", "4096, 1024,1024")
    assert envs.get("DEEPINFER_NEURON_CTX_BUCKETS") == [1024, 4096]
    monkeypatch.setenv("DEEPINFER_KV_CACHE_MEMORY_BYTES", "0x1000")
    assert envs.get("DEEPINFER_KV_CACHE_MEMORY_BYTES") == 4096
    monkeypatch.setenv("DEEPINFER_LOG_LEVEL", "debug")
    assert envs.get("DEEPINFER_LOG_LEVEL") == "DEBUG"
    monkeypatch.setenv("DEEPINFER_LOG_LEVEL", "")
    assert envs.get("DEEPINFER_LOG_LEVEL") == "INFO"  # empty means unset


def test_defaults(monkeypatch):
    for v in envs.ENV_VARS:
        monkeypatch.delenv(v.name, raising=False)
    assert envs.get("DEEPINFER_KV_CACHE_MEMORY_BYTES") == 1 << 30
    assert envs.get("DEEPINFER_NEURON_COMPILE_BACKEND") == "aot_eager"
    assert envs.get("DEEPINFER_ENGRAM_STOP_AT_BOS") is False
    assert envs.get("DEEPINFER_ACCELERATOR") is None
    assert envs.get("DEEPINFER_LOG_LEVEL") == "INFO"


@pytest.mark.parametrize("name,value,needle", [
    ("DEEPINFER_ACCELERATOR", "tpu", "DEEPINFER_ACCELERATOR must be one of cpu|cuda|neuron"),
    ("DEEPINFER_NEURON_HOST", "maybe", "DEEPINFER_NEURON_HOST must be one of 0/1/true/false"),
    ("DEEPINFER_KV_CACHE_MEMORY_BYTES", "lots", "DEEPINFER_KV_CACHE_MEMORY_BYTES must be an integer"),
    ("DEEPINFER_KV_CACHE_MEMORY_BYTES", "-1", "must be >= 0"),
    ("DEEPINFER_NEURON_CTX_BUCKETS", "1024,0", "comma-separated positive integers"),
    ("DEEPINFER_NEURON_COMPILE_BACKEND", "eager", "aot_eager|inductor"),
])
def test_bad_values_name_the_variable(monkeypatch, name, value, needle):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(needle)):
        envs.get(name)


def test_unknown_names_are_rejected():
    with pytest.raises(KeyError, match="not a registered"):
        envs.get("DEEPINFER_NOT_A_THING")
    with pytest.raises(AttributeError):
        envs.DEEPINFER_NOT_A_THING  # noqa: B018
