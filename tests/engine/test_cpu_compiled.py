"""The cpu platform's compiled decode step (DEEPINFER_CPU_COMPILE=1, worker/runners/cpu_compiled.py):
the same greedy tokens as the eager CPU path on both tiny checkpoints with prompts chunked (prompt
chunks eager with fused kernels, decode steps compiled: prefill == decode == chunked through the compiled path), the
same through verification with oracle drafts, and V4's tokens equal transformers' through inductor.

The fast cases compile with aot_eager (the same Dynamo graphs, buckets and padding as inductor, no
code generation); inductor's compile takes minutes on the 2-core machine, so its case is slow."""
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.platforms.cpu import CpuPlatform
from deepinfer.spec.oracle_drafts import oracle_drafts
from tests.support.head_kernel_cases import has_tiles_head
from tests.support.spec_runs import prompts_of_lengths, token_lists

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _llm(ckpt, **kw):
    kw.setdefault("max_num_batched_tokens", 8)   # 11- and 5-token prompts: chunked, mixed with decode rows
    return LLM(model=str(ckpt), dtype="float32", max_model_len=48, max_num_seqs=2, **kw)


def _compiled(monkeypatch, backend="aot_eager", scope="step"):
    monkeypatch.setenv("DEEPINFER_CPU_COMPILE", "1")
    monkeypatch.setenv("DEEPINFER_CPU_COMPILE_BACKEND", backend)
    monkeypatch.setenv("DEEPINFER_CPU_COMPILE_SCOPE", scope)


def test_cpu_platform_runner_follows_the_env(monkeypatch):
    from deepinfer.engine_config import EngineConfig
    p = CpuPlatform()
    monkeypatch.delenv("DEEPINFER_CPU_COMPILE", raising=False)
    assert p.runner_strategy == "eager"
    monkeypatch.setenv("DEEPINFER_CPU_COMPILE", "1")
    assert p.runner_strategy == "cpu_compiled"
    spec = p.bucket_spec(EngineConfig(model="m", max_num_seqs=5, max_model_len=96, num_speculative_tokens=3))
    assert spec.batch == (1, 2, 4, 8) and spec.contexts == (96,) and spec.prefill_tokens is None
    assert spec.verify_tokens == 4
    # prompt buckets only where the env names them (sorted, one each); ranks must agree on them
    monkeypatch.setenv("DEEPINFER_CPU_PREFILL_BUCKETS", "256,64,64")
    spec = p.bucket_spec(EngineConfig(model="m", max_num_seqs=5, max_model_len=96))
    assert spec.prefill_tokens == (64, 256) and list(p.signature()["prefill_buckets"]) == [64, 256]
    p.validate_config(EngineConfig(model="m", max_num_batched_tokens=256), None)
    for bad in ("1,64", "64,512"):   # too small; larger than a step can be
        monkeypatch.setenv("DEEPINFER_CPU_PREFILL_BUCKETS", bad)
        with pytest.raises(ValueError, match="DEEPINFER_CPU_PREFILL_BUCKETS"):
            p.validate_config(EngineConfig(model="m", max_num_batched_tokens=256), None)


def test_inductor_regions_get_a_cpp_wrapper_unless_the_env_says_python(monkeypatch):
    """DEEPINFER_CPU_COMPILE_WRAPPER: inductor region graphs compile with cpp_wrapper (the golden
    inductor test below runs it); python and the aot_eager backend pass no inductor options, and a
    region runner refuses inductor options for another backend."""
    import torch._inductor.compile_fx as compile_fx_module
    from deepinfer.neuron_ops.regions import RegionRunner
    monkeypatch.setenv("DEEPINFER_CPU_COMPILE_BACKEND", "inductor")
    monkeypatch.delenv("DEEPINFER_CPU_COMPILE_WRAPPER", raising=False)
    runner = CpuPlatform().region_runner()
    assert runner.inductor_options == {"cpp_wrapper": True}
    seen = []
    monkeypatch.setattr(compile_fx_module, "compile_fx", lambda gm, inputs, config_patches: seen.append(config_patches))
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    runner._backend_for("exit", "exit")(gm, [torch.zeros(2)])
    assert seen == [{"cpp_wrapper": True}]
    monkeypatch.setenv("DEEPINFER_CPU_COMPILE_WRAPPER", "python")
    assert CpuPlatform().region_runner().inductor_options == {}
    monkeypatch.setenv("DEEPINFER_CPU_COMPILE_WRAPPER", "cpp")
    monkeypatch.setenv("DEEPINFER_CPU_COMPILE_BACKEND", "aot_eager")
    assert CpuPlatform().region_runner().inductor_options == {}
    with pytest.raises(ValueError, match="inductor backend"):
        RegionRunner("aot_eager", inductor_options={"cpp_wrapper": True})


@pytest.mark.parametrize("scope", ["step", "layer"])
@pytest.mark.parametrize("kind", ["v4", "v41"])
def test_compiled_steps_give_the_eager_greedy_tokens(request, kind, scope, monkeypatch, cpu_platform):
    """Both compile scopes: each decode step one graph (the default), or Neuron's per-layer regions."""
    ckpt = request.getfixturevalue("tiny_v4_dir" if kind == "v4" else "tiny_v41_dir")
    prompts = prompts_of_lengths([11, 5], seed=4)
    eager = token_lists(_llm(ckpt, enforce_eager=True).generate(prompts, GREEDY, use_tqdm=False))
    _compiled(monkeypatch, scope=scope)
    llm = _llm(ckpt)
    strategy = llm.llm_engine.worker.runner.strategy
    assert strategy.name == "cpu_compiled" and strategy.regions.scope == scope
    assert token_lists(llm.generate(prompts, GREEDY, use_tqdm=False)) == eager
    # the last decode step's greedy rows took the head's argmax where the tiles kernel holds the head
    # (layers/head_gemm.py head_logits_argmax), and scanned the logits elsewhere
    assert (llm.llm_engine.worker.runner.row_argmax is not None) == has_tiles_head(llm)
    # a prompt step (eager) after decode steps of two rows, then after decode steps of one row: its
    # greedy token is its own logits' argmax, never the previous decode step's (ModelRunner.execute)
    for prompt, expect in [(prompts[1], eager[1]), (prompts[0], eager[0])]:
        assert token_lists(llm.generate([prompt], GREEDY, use_tqdm=False)) == [expect]
    # step scope: one graph a bucket, no layer region compiled; layer scope: the entry, layers, exit
    regions = set(strategy.regions.stats.regions)
    assert regions == ({"step"} if scope == "step" else {"entry", "layer", "exit"}), regions
    # decode steps ran in row buckets through compiled regions, prompt steps eagerly with the fused
    # kernel table (worker/runners/prompt_kernels.py), and the model has its own table back
    assert strategy.num_graphs > 0 and strategy.eager_steps > 0
    assert strategy.fused_prompt_steps == strategy.eager_steps
    assert llm.llm_engine.worker.model.kernels is not strategy.prompt_kernels
    assert {t for t, _ in strategy.buckets_seen} <= {1, 2} and strategy.buckets_seen
    assert strategy.compile_s > 0


@pytest.mark.parametrize("kind", ["v4", "v41"])
def test_prompt_buckets_compile_prompt_and_mixed_steps_with_the_eager_greedy_tokens(request, kind, monkeypatch,
                                                                                   cpu_platform):
    """DEEPINFER_CPU_PREFILL_BUCKETS: steps with prompt chunks (8 tokens a step: the 5-token prompt
    and the 11-token one's first chunk, then decode rows beside its later chunks) run padded in the
    8-token prompt bucket's graph, decode steps in their row buckets; nothing runs eagerly, and the
    tokens are the eager path's."""
    ckpt = request.getfixturevalue("tiny_v4_dir" if kind == "v4" else "tiny_v41_dir")
    prompts = prompts_of_lengths([5, 11], seed=4)
    eager = token_lists(_llm(ckpt, enforce_eager=True).generate(prompts, GREEDY, use_tqdm=False))
    _compiled(monkeypatch)
    monkeypatch.setenv("DEEPINFER_CPU_PREFILL_BUCKETS", "8")
    llm = _llm(ckpt)
    strategy = llm.llm_engine.worker.runner.strategy
    assert strategy.buckets.prefill_tokens == (8,)
    steps = []
    llm.llm_engine.timing_hook = lambda t: steps.append((t.num_prefill_tokens, t.num_decode_tokens))
    assert token_lists(llm.generate(prompts, GREEDY, use_tqdm=False)) == eager
    llm.llm_engine.timing_hook = None
    assert any(p and d for p, d in steps), steps   # a mixed step: a prompt chunk beside a decode row
    assert strategy.eager_steps == 0 and strategy.fused_prompt_steps == 0
    seen = {t for t, _ in strategy.buckets_seen}
    assert 8 in seen and seen <= {1, 2, 8}, strategy.buckets_seen
    # each prompt alone: the 5-token one padded to 8, the 11-token one in two chunks that fit the bucket
    for prompt, expect in [(prompts[0], eager[0]), (prompts[1], eager[1])]:
        assert token_lists(llm.generate([prompt], GREEDY, use_tqdm=False)) == [expect]
    assert strategy.eager_steps == 0


def _plain_then_speculative(ckpt, monkeypatch, seed: int):
    """(prompts, greedy params, the eager plain tokens, a compiled engine drafting 2 tokens a row)."""
    prompts = prompts_of_lengths([11, 5], seed=seed)
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    plain = token_lists(_llm(ckpt, enforce_eager=True).generate(prompts, params, use_tqdm=False))
    _compiled(monkeypatch)
    return prompts, params, plain, _llm(ckpt, num_speculative_tokens=2, max_num_batched_tokens=16)


def test_compiled_verification_gives_the_plain_tokens(tiny_v41_dir, monkeypatch, cpu_platform):
    """Verification rows (1 + 2 tokens a sequence) run in their own buckets; every oracle draft is
    accepted, so the tokens are the plain eager run's."""
    prompts, params, plain, llm = _plain_then_speculative(tiny_v41_dir, monkeypatch, seed=5)
    strategy = llm.llm_engine.worker.runner.strategy
    with oracle_drafts(llm, {tuple(p["prompt_token_ids"]): t for p, t in zip(prompts, plain)}):
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert token_lists(outs) == plain
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    assert sum(o.metrics.num_accepted_tokens for o in outs) == drafted > 0
    assert any(t in (3, 6) for t, _ in strategy.buckets_seen), strategy.buckets_seen   # verify buckets ran


def test_greedy_speculative_steps_in_one_step_graph_give_plain_greedy(tiny_v41_dir, monkeypatch, cpu_platform):
    """The step scope's verification forward feeds the verify_draft region (spec/greedy_step.py): the
    tiny V4.1's own (random) drafts, greedy, give the plain eager tokens."""
    prompts, params, plain, llm = _plain_then_speculative(tiny_v41_dir, monkeypatch, seed=8)
    strategy = llm.llm_engine.worker.runner.strategy
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert token_lists(outs) == plain
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    stats = strategy.regions.stats.regions
    assert stats["step"] > 0 and stats["verify_draft"] > 0 and stats["layer"] == 0, stats


@pytest.mark.slow
def test_inductor_decode_steps_give_transformers_greedy_tokens(tiny_v4_dense_dir, monkeypatch, cpu_platform):
    """Golden through the compiled path: inductor-generated decode steps, greedy, vs transformers' generate."""
    from transformers import AutoModelForCausalLM
    tf = AutoModelForCausalLM.from_pretrained(str(tiny_v4_dense_dir), dtype=torch.float32).eval()
    prompts = prompts_of_lengths([24, 30], seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    _compiled(monkeypatch, "inductor")
    llm = _llm(tiny_v4_dense_dir, max_num_batched_tokens=64)
    got = token_lists(llm.generate(prompts, params, use_tqdm=False))
    for p, toks in zip(prompts, got):
        ids = torch.tensor([p["prompt_token_ids"]])
        with torch.no_grad():
            ref = tf.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
        assert toks == ref
    assert llm.llm_engine.worker.runner.strategy.num_graphs > 0


def test_warm_up_compiles_the_regions_and_the_prompt_kernels_before_the_first_request(tiny_v4_dir, monkeypatch,
                                                                                     cpu_platform):
    """warmup_graphs=True: every planned region graph and the fused prompt kernels are built at start-up,
    so the first request compiles nothing, and its tokens are the eager path's."""
    prompts = prompts_of_lengths([11, 5], seed=7)
    eager = token_lists(_llm(tiny_v4_dir, enforce_eager=True).generate(prompts, GREEDY, use_tqdm=False))
    _compiled(monkeypatch)
    llm = _llm(tiny_v4_dir, warmup_graphs=True)
    strategy = llm.llm_engine.worker.runner.strategy
    graphs, compile_s = strategy.num_graphs, strategy.compile_s
    assert graphs == strategy.plan.graph_count and strategy._prompt_kernels_built and compile_s > 0
    assert token_lists(llm.generate(prompts, GREEDY, use_tqdm=False)) == eager
    assert strategy.num_graphs == graphs and strategy.compile_s == compile_s
    assert strategy.fused_prompt_steps > 0
