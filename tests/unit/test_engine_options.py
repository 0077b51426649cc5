"""One source of engine options: LLM(...), `python -m deepinfer.serve` and `deepinfer serve` take every
EngineConfig field under its name with its default, and build the config the same way."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import subprocess
import sys

import pytest

import deepinfer.cli as deepinfer_cli
import deepinfer.entrypoints.llm as llm_module
import deepinfer.serve.cli as serve_cli
from deepinfer.engine_config import EngineConfig, engine_config_from_args

from tests.support import REPO

MODEL = "ckpt-dir"

# A valid value other than the default for every option; a new EngineConfig field fails
# test_every_field_has_a_test_value until it gets one here.
OTHER_VALUES = {
    "tokenizer": "tok-dir",
    "dtype": "float32",
    "max_model_len": 256,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 512,
    "num_kv_blocks": 32,
    "block_size": 16,
    "enforce_eager": True,
    "enable_prefix_caching": False,
    "warmup_graphs": True,
    "compile_cache_dir": "/var/cache/neuron-graphs",
    "seed": 7,
    "skip_tokenizer_init": True,
    "kv_cache_memory_bytes": 12345,
    "kv_cache_mode": "compact",
    "weight_format": "packed",
    "context_parallel_size": 2,
    "expert_parallel_size": 2,
    "attention_tp_size": 2,
    "nnodes": 2,
    "node_rank": 1,
    "master_addr": "10.0.0.1",
    "master_port": 29500,
    "rank_step_timeout": 30,
    "num_speculative_tokens": 3,
    "speculative_verify": "confidence",
    "speculative_draft_vocab": "/srv/draft-vocab.json",
}


def _option_fields():
    return [f for f in dataclasses.fields(EngineConfig) if f.name != "model"]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _argv(values: dict) -> list[str]:
    argv = ["--model", MODEL]
    for name, value in values.items():
        if isinstance(value, bool):   # a flag; one that defaults to True is turned off by --no-x
            argv += [_flag(name) if value else "--no-" + _flag(name)[2:]]
        else:
            argv += [_flag(name), str(value)]
    return argv


class _CapturingEngine:
    """Stands in for LLMEngine: keeps the EngineConfig LLM built."""

    def __init__(self, config: EngineConfig):
        self.config = config


@pytest.fixture
def llm_config(monkeypatch):
    monkeypatch.setattr(llm_module, "LLMEngine", _CapturingEngine)
    return lambda *args, **kw: llm_module.LLM(*args, **kw).llm_engine.config


@pytest.fixture(autouse=True)
def _no_kv_env(monkeypatch):
    monkeypatch.delenv("DEEPINFER_KV_CACHE_MEMORY_BYTES", raising=False)


def test_every_field_has_a_test_value():
    defaults = dataclasses.asdict(EngineConfig(model=MODEL))
    assert set(OTHER_VALUES) == {f.name for f in _option_fields()}
    for name, value in OTHER_VALUES.items():
        assert value != defaults[name], name


def test_server_parser_has_every_field_with_its_default():
    actions = {a.dest: a for a in serve_cli.build_parser()._actions}
    for f in dataclasses.fields(EngineConfig):
        action = actions[f.name]
        assert _flag(f.name) in action.option_strings
        if f.default is not dataclasses.MISSING:
            assert action.default == f.default, f.name
    assert actions["model"].required
    assert actions["kv_cache_mode"].choices == ("plain", "compact")
    assert actions["enforce_eager"].nargs == 0 and actions["warmup_graphs"].nargs == 0  # flags


def test_defaults_agree_between_llm_and_server(llm_config):
    reference = EngineConfig(model=MODEL)
    from_server = engine_config_from_args(serve_cli.parse_args(["--model", MODEL]))
    from_llm = llm_config(MODEL)
    assert from_server == reference
    assert from_llm == reference
    assert from_server.max_num_batched_tokens == 2048  # the server's old default was max(2048, seqs)


def test_every_option_reaches_the_config_from_llm_and_server(llm_config):
    from_server = engine_config_from_args(serve_cli.parse_args(_argv(OTHER_VALUES)))
    from_llm = llm_config(MODEL, **OTHER_VALUES)
    for name, value in OTHER_VALUES.items():
        assert getattr(from_server, name) == value, name
        assert getattr(from_llm, name) == value, name
    assert from_server == from_llm


def test_kv_cache_mode_and_memory_bytes_from_the_command_line():
    args = serve_cli.parse_args(["--model", MODEL, "--kv-cache-mode", "compact",
                                 "--kv-cache-memory-bytes", "12345"])
    config = engine_config_from_args(args)
    assert (config.kv_cache_mode, config.kv_cache_memory_bytes) == ("compact", 12345)


def test_bad_choice_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exc:
        serve_cli.parse_args(["--model", MODEL, "--kv-cache-mode", "fp2"])
    assert exc.value.code == 2
    assert "--kv-cache-mode" in capsys.readouterr().err


def test_kv_cache_memory_default_is_read_when_the_config_is_built(monkeypatch, llm_config):
    # The parser is built before the variable is set: the CLI leaves the default to EngineConfig,
    # which reads DEEPINFER_KV_CACHE_MEMORY_BYTES at construction, as it does for LLM(...).
    parser = serve_cli.build_parser()
    assert engine_config_from_args(parser.parse_args(["--model", MODEL])).kv_cache_memory_bytes == 1 << 30
    monkeypatch.setenv("DEEPINFER_KV_CACHE_MEMORY_BYTES", "4096")
    assert engine_config_from_args(parser.parse_args(["--model", MODEL])).kv_cache_memory_bytes == 4096
    assert llm_config(MODEL).kv_cache_memory_bytes == 4096
    assert "DEEPINFER_KV_CACHE_MEMORY_BYTES" in parser.format_help()


def test_llm_refuses_an_unknown_option_and_names_the_valid_ones(llm_config):
    with pytest.raises(TypeError) as exc:
        llm_config(MODEL, max_num_seq=4)
    message = str(exc.value)
    assert "max_num_seq'" in message
    for f in _option_fields():
        assert f"'{f.name}'" in message


def test_llm_signature_lists_every_option():
    params = inspect.signature(llm_module.LLM).parameters
    assert list(params) == [f.name for f in dataclasses.fields(EngineConfig)]
    assert params["model"].default is inspect.Parameter.empty
    for f in _option_fields():
        assert params[f.name].kind is inspect.Parameter.KEYWORD_ONLY
        if f.default is not dataclasses.MISSING:
            assert params[f.name].default == f.default, f.name


def test_deepinfer_help_lists_serve(capsys):
    with pytest.raises(SystemExit) as exc:
        deepinfer_cli.main(["--help"])
    assert exc.value.code == 0
    assert "serve" in capsys.readouterr().out


def test_deepinfer_serve_help(capsys):
    with pytest.raises(SystemExit) as exc:
        deepinfer_cli.main(["serve", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for f in dataclasses.fields(EngineConfig):
        assert _flag(f.name) in out
    assert "--port" in out and "--api-key" in out


def test_deepinfer_without_a_command_is_a_usage_error():
    with pytest.raises(SystemExit) as exc:
        deepinfer_cli.main([])
    assert exc.value.code == 2


def test_deepinfer_serve_parses_like_python_m_serve(monkeypatch):
    seen = []
    monkeypatch.setattr(serve_cli, "run", lambda args: seen.append(args) or 0)
    argv = _argv(OTHER_VALUES) + ["--port", "9001", "--api-key", "k"]
    assert deepinfer_cli.main(["serve", *argv]) == 0
    via_console = {k: v for k, v in vars(seen[0]).items() if k not in ("command", "run")}
    assert via_console == vars(serve_cli.parse_args(argv))


def test_deepinfer_serve_runs_the_server_code(caplog):
    # The real run path up to the engine config: an invalid combination exits 2 before any
    # engine or socket is made.
    code = deepinfer_cli.main(["serve", "--model", MODEL, "--max-num-seqs", "8",
                               "--max-num-batched-tokens", "4", "--log-level", "error"])
    assert code == 2
    assert "max_num_batched_tokens" in caplog.text


def test_setup_declares_the_console_script():
    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    entry_points = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "entry_points"))
    scripts = dict(s.replace(" ", "").split("=", 1) for s in entry_points["console_scripts"])
    module, func = scripts["deepinfer"].split(":")
    assert (module, func) == ("deepinfer.cli", "main")
    assert getattr(__import__(module, fromlist=[func]), func) is deepinfer_cli.main


@pytest.mark.parametrize("module", ["deepinfer.serve", "serve"])   # "serve": the repo-root alias
def test_python_m_serve_still_works(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage: python -m deepinfer.serve" in out.stdout and "--kv-cache-mode" in out.stdout


def test_setup_installs_no_top_level_serve_package():
    # The repo-root serve/ is only the `python -m serve` alias of a source checkout.
    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "find_packages")
    include = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "include"))
    from setuptools import find_packages
    packages = find_packages(str(REPO), include=include)
    assert "deepinfer.serve" in packages
    assert all(p == "deepinfer" or p.startswith("deepinfer.") for p in packages), packages


@pytest.mark.parametrize("options, message", [
    (dict(context_parallel_size=3, expert_parallel_size=2), "the larger must be a multiple of the smaller"),
    (dict(context_parallel_size=4, attention_tp_size=3), "attention_tp_size (3) must divide context_parallel_size (4)"),
    (dict(nnodes=2, context_parallel_size=2), "master_port is required when nnodes > 1"),
    (dict(nnodes=2, master_port=29500, context_parallel_size=3), "2 nodes cannot split a world of 3 ranks"),
    (dict(node_rank=1), "node_rank must be in [0, nnodes - 1]"),
    (dict(context_parallel_size=0), "context_parallel_size must be an integer >= 1"),
    (dict(master_port=70000), "master_port must be an integer in [1, 65535]"),
])
def test_parallel_options_reject_bad_combinations(options, message):
    with pytest.raises(ValueError) as e:
        EngineConfig(model=MODEL, **options)
    assert message in str(e.value)


def test_parallel_options_are_checked_against_the_model():
    from tests.support.model_helpers import tiny_config
    cfg = tiny_config("v41")   # 8 heads, 8 routed experts (4 in the draft layers)
    assert EngineConfig(model=MODEL, context_parallel_size=16).lane_size == 8   # default min(cp, 8)
    with pytest.raises(ValueError, match="attention_tp_size 16 must divide num_heads"):
        EngineConfig(model=MODEL, context_parallel_size=16, attention_tp_size=16).resolve(cfg)
    with pytest.raises(ValueError, match="expert_parallel_size 16 must divide n_routed_experts"):
        EngineConfig(model=MODEL, expert_parallel_size=16).resolve(cfg)
    EngineConfig(model=MODEL, context_parallel_size=2, expert_parallel_size=4, attention_tp_size=2).resolve(cfg)


def test_drafts_across_ranks_resolve_and_check_the_draft_experts():
    from tests.support.model_helpers import tiny_config
    cfg = tiny_config("v41")   # 4 routed experts in the draft layers
    for sizes in (dict(), dict(context_parallel_size=2), dict(expert_parallel_size=4)):
        EngineConfig(model=MODEL, num_speculative_tokens=3, **sizes).resolve(cfg)
    with pytest.raises(ValueError, match=r"expert_parallel_size 8 must divide dspark_n_routed_experts \(4\)"):
        EngineConfig(model=MODEL, num_speculative_tokens=3, expert_parallel_size=8).resolve(cfg)
