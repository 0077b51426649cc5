"""Speculative decoding: the one home of the feature (docs/model.md §3.8, §6.4; docs/architecture.md §1).

Vocabulary: "speculative" / "spec" names the feature, "draft" the tokens it proposes; users set
`num_speculative_tokens` (B, the drafts per step; the bench tools' `--nextn`).

- decoder.py    SpecDecoder: the speculative step on the driver (main forward, verification, proposal);
- proposer.py   DraftProposer: one DSpark draft block and the drafts sampled from it, depth by depth,
                on the draft seed stream (DRAFT_SEED_OFFSET);
- verify.py     the accept / resample rule on the sampler's processed distributions;
- greedy_step.py  a step of greedy rows verified and drafted on the device in one program (the plan
                rows it reads, the acceptance and draft block it runs, the one tensor it returns);
- verify_policy.py  VerifyPolicy, the scheduler's side: which drafts each row verifies, and the
                counters and calibration verification feeds;
- verify_plan.py    speculative_verify="confidence": the plan from the drafts' confidences;
- step_times.py the measured step-time model the plan prices steps with;
- stats.py      SpecDecodeStats, the engine-wide counters.

Outside this package, by concept: the draft layers' math and metadata (model_executor/models/
dspark_draft.py), the draft vocabulary that narrows the draft heads (model_executor/models/draft_vocab.py;
built by examples/tools/build_draft_vocab.py), the ring rows drafts need (worker/cache_engine.py speculative_ring_rows), the
draft block on several ranks (executor/step_fanout.py prepare_draft), the step result every step
returns (step_result.py) and the bans per draft depth (stop_rules.py).
"""
