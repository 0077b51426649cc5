"""The ModelRunner is the one step path: the engine's steps and the tests' go through `run`; the
worker selects its rank's device through the platform before the model exists; a run without
sample requests (a follower rank) returns logits only."""
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import ModelConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_config import EngineConfig
from deepinfer.platforms.cpu import CpuPlatform
from deepinfer.platforms.neuron.platform import NeuronPlatform
from deepinfer.sampling_params import SamplingParams as SP
from deepinfer.worker.model_runner import ModelRunner, SampleRequest
from deepinfer.worker.worker import Worker
from tests.support.model_helpers import Seqs, tiny_config, tiny_model
from deepinfer.worker.runners import EagerStrategy


class RecordingPlatform(CpuPlatform):
    def __init__(self):
        self.calls = []

    def set_device(self, rank: int) -> None:
        self.calls.append(("set_device", rank))

    def validate_config(self, engine_config, model_config) -> None:
        self.calls.append(("validate_config",))


def test_worker_selects_the_rank_device_first_and_the_engine_steps_through_run(tiny_v41_dir, monkeypatch):
    cfg = ModelConfig.from_pretrained(tiny_v41_dir)
    ec = EngineConfig(model=str(tiny_v41_dir), dtype="float32", max_model_len=64, max_num_seqs=2).resolve(cfg)
    platform = RecordingPlatform()
    built = []
    import deepinfer.worker.worker as worker_mod
    real_build = worker_mod.build_model

    def build(*a, **kw):
        built.append(list(platform.calls))
        return real_build(*a, **kw)
    monkeypatch.setattr(worker_mod, "build_model", build)
    worker = Worker(cfg, ec, platform=platform, rank=3)
    assert built == [[("validate_config",), ("set_device", 3)]]   # before the model was built
    runs = []
    real_run = ModelRunner.run

    def counting_run(self, chunks, samples=None, scores=None):
        out = real_run(self, chunks, samples, scores)
        runs.append((len(chunks), out.sampled is not None))
        return out
    monkeypatch.setattr(ModelRunner, "run", counting_run)
    llm = LLM.from_engine(LLMEngine(ec, model_config=cfg, worker=worker))
    out = llm.generate([{"prompt_token_ids": [0, 5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=4,
                                                                             ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert len(runs) == 4 and all(sampled for _, sampled in runs)


def test_neuron_set_device_pins_the_core_in_device_mode(monkeypatch):
    for var in ("NEURON_RT_VISIBLE_CORES", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NEURON_CC_FLAGS"):
        monkeypatch.delenv(var, raising=False)
    import os
    host = NeuronPlatform(host=True)
    host.set_device(5)
    assert host.rank == 5 and "NEURON_RT_VISIBLE_CORES" not in os.environ
    device = NeuronPlatform(host=False)   # set_device touches no runtime: safe without a device
    device.set_device(5)
    assert (os.environ["NEURON_RT_VISIBLE_CORES"], os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]) \
        == ("5", "0", "1")


def test_run_without_samples_returns_logits_only_and_sampling_matches_argmax():
    model = tiny_model(tiny_config("v4", layers=2))
    s = Seqs(model, EagerStrategy, [[0, 5, 6, 7], [0, 9]])
    chunks = [s.chunk(0, 4), s.chunk(1, 2)]
    follower = s.runner.run(chunks)
    assert follower.sampled is None and follower.logits.shape == (2, model.cfg.vocab_size)
    greedy = [SampleRequest(SP(temperature=0.0), position=4), SampleRequest(SP(temperature=0.0), position=2)]
    out = s.runner.sample(follower.logits, greedy)
    assert out.token_ids.tolist() == follower.logits.argmax(-1).tolist()
    with pytest.raises(ValueError, match="2 logits rows but 1 sample"):
        s.runner.sample(follower.logits, greedy[:1])
    banned = [SampleRequest(SP(temperature=0.0), 4, banned_ids=(int(follower.logits[0].argmax()),)), greedy[1]]
    assert s.runner.sample(follower.logits, banned).token_ids[0].item() != follower.logits[0].argmax().item()
    assert torch.isfinite(follower.logits).all()
