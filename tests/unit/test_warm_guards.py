"""worker/runners/warm_guards.py: a step key skips Dynamo's non-tensor guards only after clean runs
with every guard evaluated, a key whose step compiles starts over, and a key that compiles while
skipping goes back to full guards for good. The stale-constant cases show the skip is real (and why
the keys must hold every constant a graph reads). A call that would recompile while skipping runs
again with every guard (neuron_ops/regions.call_region)."""
from types import SimpleNamespace

import torch

from deepinfer.neuron_ops.regions import call_region
from deepinfer.worker.runners.warm_guards import WarmGuards


def _compiled():
    graphs = {"n": 0}

    def backend(gm, example_inputs):
        graphs["n"] += 1
        return gm.forward

    def scale(x, cfg):
        return x * cfg.factor

    torch._dynamo.reset()
    compiled = torch.compile(scale, backend=backend, dynamic=False, fullgraph=True)
    # called as the region runner calls its graphs (a refused recompile runs again, fully guarded)
    return (lambda *args: call_region(compiled, *args)), graphs


def test_skips_only_after_clean_runs_and_the_skip_is_real():
    fn, graphs = _compiled()
    guards = WarmGuards(lambda: graphs["n"], enabled=True, clean_runs=2)
    x, cfg = torch.ones(3), SimpleNamespace(factor=2.0)
    for _ in range(3):   # the first compiles; two clean runs follow
        with guards.step("k"):
            assert torch.equal(fn(x, cfg), x * 2)
    assert guards.skipped_steps == 0
    cfg.factor = 5.0     # a constant no earlier call varied: a skipping step does not see it
    with guards.step("k"):
        stale = fn(x, cfg)
    assert guards.skipped_steps == 1 and torch.equal(stale, x * 2)
    # another key, not yet clean: every guard, so the new constant recompiles
    with guards.step("other"):
        assert torch.equal(fn(x, cfg), x * 5)


def test_disabled_evaluates_every_guard():
    fn, graphs = _compiled()
    guards = WarmGuards(lambda: graphs["n"], enabled=False)
    x, cfg = torch.ones(3), SimpleNamespace(factor=2.0)
    for _ in range(4):
        with guards.step("k"):
            fn(x, cfg)
    cfg.factor = 5.0
    with guards.step("k"):
        assert torch.equal(fn(x, cfg), x * 5)
    assert guards.skipped_steps == 0


def test_a_key_that_compiles_while_skipping_returns_to_full_guards():
    fn, graphs = _compiled()
    guards = WarmGuards(lambda: graphs["n"], enabled=True, clean_runs=1)
    cfg = SimpleNamespace(factor=2.0)
    for _ in range(2):
        with guards.step("k"):
            fn(torch.ones(3), cfg)
    with guards.step("k"):   # skipping; a new shape fails a tensor guard
        assert torch.equal(fn(torch.ones(4), cfg), torch.full((4,), 2.0))
    assert guards.always_guarded == {"k"}
    cfg.factor = 7.0
    for _ in range(3):
        with guards.step("k"):
            assert torch.equal(fn(torch.ones(3), cfg), torch.full((3,), 7.0))


def test_a_step_without_a_key_never_skips():
    fn, graphs = _compiled()
    guards = WarmGuards(lambda: graphs["n"], enabled=True, clean_runs=0)
    cfg = SimpleNamespace(factor=2.0)
    with guards.step(None):
        fn(torch.ones(2), cfg)
    cfg.factor = 3.0
    with guards.step(None):
        assert torch.equal(fn(torch.ones(2), cfg), torch.full((2,), 3.0))
