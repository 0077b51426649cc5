"""The LM head's argmax (layers/head_gemm.py head_logits_argmax, the AMX tiles kernel) in the eager
runner: greedy rows take it instead of scanning the logits, and the tokens are the scan's, in decode
steps and in prompt steps that follow them (ModelRunner.execute clears it before every forward)."""
from deepinfer import LLM, SamplingParams
from deepinfer.model_executor.models.deepseek_v4 import DeepseekV4Model
from tests.support.head_kernel_cases import has_tiles_head
from tests.support.spec_runs import prompts_of_lengths, token_lists

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _generate(ckpt, prompts):
    llm = LLM(model=str(ckpt), dtype="float32", max_model_len=48, max_num_seqs=2, enforce_eager=True)
    outs = [token_lists(llm.generate(prompts, GREEDY, use_tqdm=False))]
    outs += [token_lists(llm.generate([p], GREEDY, use_tqdm=False)) for p in prompts]   # prompt after decode
    return llm, outs


def test_eager_greedy_rows_take_the_heads_argmax_and_keep_the_scans_tokens(tiny_v41_dir, monkeypatch, cpu_platform):
    prompts = prompts_of_lengths([9, 4], seed=6)
    llm, with_head = _generate(tiny_v41_dir, prompts)
    assert (llm.llm_engine.worker.runner.row_argmax is not None) == has_tiles_head(llm)
    # the same logits, the argmax left to the sampler's scan (layers/row_argmax.py)
    monkeypatch.setattr(DeepseekV4Model, "forward_argmax", lambda self, step, cache: (self(step, cache), None))
    llm, scanned = _generate(tiny_v41_dir, prompts)
    assert llm.llm_engine.worker.runner.row_argmax is None
    assert with_head == scanned
