"""The device rules of docs/neuron.md §4 in one table: id, the rule's safe formulation, whether a check
enforces it (`enforced`, `check` naming the test or report field) or it is `documented` only. The doc's
table and the device report's `rules` list (tools/device_report.py) are both generated from RULES;
tests/repo/test_device_rules.py checks they agree and that every named check exists.
`python -m deepinfer.platforms.neuron.device_rules docs/neuron.md` rewrites the doc's table between
its DOC_BEGIN / DOC_END markers."""
from __future__ import annotations

from dataclasses import dataclass

ENFORCED, DOCUMENTED = "enforced", "documented"
DOC_BEGIN = "<!-- device rules table: generated from deepinfer/platforms/neuron/device_rules.py -->"
DOC_END = "<!-- end of the device rules table -->"


@dataclass(frozen=True)
class Rule:
    id: str
    text: str
    check: str | None = None   # "tests/<path>::<test>" or "report:<field>"; None: documented only

    @property
    def status(self) -> str:
        return ENFORCED if self.check else DOCUMENTED


RULES: tuple[Rule, ...] = (
    Rule('A1',
         'trn2 fp8 is e4m3 with largest finite 240: activations and KV quantized to 224, checkpoint fp8 '
         'weights halved with their exponent raised',
         'tests/neuron/test_neuron_kernels.py::test_activation_quantization_stays_below_224'),
    Rule('A2',
         'no torch.cat / stack of float8 tensors: concatenate uint8 views',
         'report:graphs[].float8_sites'),
    Rule('A3',
         'no advanced indexing or gather on float8 views: index uint8 views',
         'report:graphs[].float8_sites'),
    Rule('A4',
         'no int64 constants beyond int32 (narrowed on device): in-range sentinels, int32 index math',
         'report:graphs[].int64_sites'),
    Rule('A5',
         'no 64-bit constant beyond int32 in a graph (NCC_ESFH001): such arithmetic stays eager on the '
         'host or uses int32',
         'report:graphs[].int64_sites'),
    Rule('A6',
         'no OCP fp8 values inside graphs (NCC_EOCP001): the unsafe-fp8 flag, or fp8 carried as uint8',
         'report:graphs[].float8_sites'),
    Rule('A7',
         'no FP4/MX matmul: dequantize inside the kernel',
         'tests/neuron/test_nki_kernels.py::test_blockquant_fp4_gemm_equals_reference'),
    Rule('A8',
         'fp8 and bf16 casts in separate stages (the fp8 legalisation pass mistook bf16 casts for fp8 '
         'carriers)',
         None),
    Rule('A9',
         'byte codes carried as int32 through a graph, narrowed to bytes only in the final store',
         None),
    Rule('A10',
         'byte pairs packed arithmetically into int16 storage (no int16 through uint8 views in one graph)',
         None),
    Rule('A11',
         'graph inputs arrive in the dtype their kernel reads (weights as uint8, scales row-major); no '
         'bitcast of a graph input',
         'tests/neuron/test_nki_kernels.py::test_blockquant_fp8_gemm_rejects_what_trn2_cannot_read'),
    Rule('A12',
         "a norm's cast to fp8 stays inside a region graph",
         None),
    Rule('B1',
         'no dynamic shapes: dynamic=False, fullgraph=True, buckets for everything',
         'tests/neuron/test_buckets.py::test_steps_in_one_bucket_have_identical_shapes'),
    Rule('B2',
         'every bucket compiled at start-up when asked (warm-up); /health 503 until ready',
         'tests/neuron/test_regions.py::test_warm_up_compiles_every_bucket_before_the_first_request'),
    Rule('B3',
         'row counts, gathered-block counts and the token counts of multi-row steps (prompt chunks, '
         'verification, DSpark draft blocks) are powers of two',
         'tests/neuron/test_compile_plan.py::test_every_planned_step_has_a_power_of_two_token_count_at_nextn_1_to_5'),
    Rule('B4',
         'prompt-chunk steps run a layer as sub-regions with a boundary between the projections and the '
         'indexer',
         'tests/neuron/test_compile_plan.py::test_warm_up_compiles_the_plan_and_the_split_keeps_greedy_tokens'),
    Rule('B5',
         'nondeterministic compiles reduced to minimal repros and their rate measured',
         None),
    Rule('B6',
         "no torch.topk with k >= 1024: nkilib's rotational top-k",
         None),
    Rule('B7',
         'no large per-row gathers: a prompt chunk gathers what its last row sees once (the shared scope) '
         'and masks per row; rows of other sequences in its step gather their own, in bounded row chunks; '
         'the largest intermediate of any graph at most 256 MiB (measured: the device report, '
         'graphs[].max_intermediate_bytes); eager and compiled prompt chunks alike, the indexer and the '
         'attention',
         'tests/engine/test_shared_scope.py::test_compiled_indexer_reads_the_scope_with_the_eager_selections'),
    Rule('B8',
         'few buckets, the graph count logged before anything compiles (at most 64 for the default '
         'V4.1-Flash config), a persistent compile cache',
         'report:graph_count'),
    Rule('C1',
         'the sampler compiled as one graph',
         None),
    Rule('C2',
         'no eager torch.remainder: a - (a // b) * b for non-negative operands',
         None),
    Rule('C3',
         'top-p bisection skipped when nothing is filtered; greedy batches take the argmax',
         None),
    Rule('C4',
         'few launches a step: one region a layer, the top level and the draft block compiled, at most 10 '
         'eager ops a decode step (the report: decode_step.eager_ops) and a speculative step of greedy rows '
         '(acceptance and the draft block with its heads in the verify_draft region; '
         'speculative_step.eager_ops)',
         'tests/neuron/test_op_census.py::test_decode_steps_run_few_eager_ops_and_one_copy_each_way'),
    Rule('C5',
         'prompt-chunk steps split at stage boundaries, decode and verification steps whole',
         'tests/neuron/test_compile_plan.py::test_warm_up_compiles_the_plan_and_the_split_keeps_greedy_tokens'),
    Rule('C6',
         'grid-2 kernels at LNC = 2',
         'tests/neuron/test_nki_kernels.py::test_blockquant_fp8_gemm_padded_rows_and_grid_sizes'),
    Rule('C7',
         'context buckets (prefill cost grows with the compiled context)',
         'tests/neuron/test_buckets.py::test_short_prompt_keeps_a_small_context_bucket'),
    Rule('C8',
         'gather only the referenced KV blocks, in contiguous runs, counts rounded to powers of two',
         None),
    Rule('C9',
         'weights transformed on the host; eager for debugging only',
         None),
    Rule('D1',
         "layer-major caches, so each layer's view is a contiguous graph input",
         None),
    Rule('D2',
         'F.embedding on an int32 / fp16 view, not index_select on int8',
         None),
    Rule('D3',
         'at most one host->device and one device->host copy a decode step (step inputs packed into one '
         'buffer, logits back once) and a speculative step of greedy rows (the plan rows in the same buffer; '
         'tokens, accepted counts and next drafts back once: report speculative_step, '
         'tests/neuron/test_spec_one_copy.py)',
         'report:decode_step.host_to_device_copies'),
    Rule('D4',
         'dequantization in chunks of at most 32M elements, one expert at a time',
         None),
    Rule('D5',
         'the bf16 LM head as a bf16 F.linear (no .float() copy of the head)',
         None),
    Rule('D6',
         'only the local rows of an already replicated table, no all-gather of it',
         None),
    Rule('D7',
         'the candidate-block filter skipped when max_model_len fits the candidate blocks',
         None),
    Rule('E1',
         'no all_to_all: dispatch with an all-gather and a local selection, combine with a reduce-scatter',
         'tests/process/test_multi_rank_model.py::test_four_ranks'),
    Rule('E2',
         'an a2a split matrix shared first, if a2a is ever used',
         None),
    Rule('E3',
         'collective payloads moved as uint8 bytes',
         None),
    Rule('E4',
         'groups of consecutive ranks, two levels',
         None),
    Rule('E5',
         'several payloads packed into one 64-rank collective',
         None),
    Rule('E6',
         'a rank-local branch into collectives max-all-reduces its flag first',
         None),
    Rule('E7',
         'every rank runs the same collective sequence each step',
         'tests/process/test_multi_rank_model.py::test_four_ranks'),
    Rule('E8',
         'no broadcast: host metadata through shared memory',
         'tests/unit/test_step_ring.py::test_ring_passes_messages_in_order_and_holds_back_the_writer'),
    Rule('E9',
         "the bucket chosen from values synced across the group (the driver's), one token count for every "
         "data-parallel group",
         'tests/process/test_multi_rank_engine.py::test_tokens_equal_single_rank'),
    Rule('F1',
         'traced code reads no layer id: one compiled entry per layer kind',
         'tests/neuron/test_regions.py::test_graph_count_does_not_grow_with_layers'),
    Rule('F2',
         'one allocation per dtype (no false overlap of differently typed views)',
         None),
    Rule('F3',
         'root allocations as graph inputs, views sliced inside the graph',
         None),
    Rule('F4',
         'env vars resolved before tracing; devices compared as torch.device',
         'tests/neuron/test_neuron_platform.py::test_env_vars_are_resolved_at_construction'),
    Rule('F5',
         'never branch on is_inference()',
         None),
    Rule('G1',
         'a process sees its core as device 0 of a local world of one',
         'tests/engine/test_model_runner.py::test_neuron_set_device_pins_the_core_in_device_mode'),
    Rule('G2',
         'followers claim core cp_rank through an environment variable set at spawn',
         'tests/unit/test_follower_env.py::test_spawned_followers_get_the_follower_environment'),
    Rule('G3',
         'shared-memory names published through the store, followers open (never create) and check the '
         'size',
         'tests/process/test_shared_tables.py::test_three_ranks_share_one_mapped_table'),
    Rule('G4',
         'prefill-attempt interval 1 on Neuron',
         None),
    Rule('G5',
         'no CPU binding in host mode',
         None),
    Rule('G6',
         'large read-only tables (Engram) once per host in /dev/shm',
         'tests/process/test_shared_tables.py::test_three_ranks_share_one_mapped_table'),
    Rule('G7',
         'torch.utils._device imported before torch_neuronx',
         None),
    Rule('G8',
         'benchmark prompts salted per rank',
         None),
)


def report_rules() -> list[dict]:
    return [{"id": r.id, "status": r.status, "check": r.check} for r in RULES]


def markdown_table() -> str:
    """The §4 summary table of docs/neuron.md (generated; tests/repo/test_device_rules.py compares)."""
    lines = ["| rule | safe formulation | status | check |", "|---|---|---|---|"]
    for r in RULES:
        check = f"`{r.check}`" if r.check else "documented only"
        lines.append(f"| {r.id} | {r.text} | {r.status} | {check} |")
    return "\n".join(lines)


def doc_block(text: str) -> str:
    """The generated table of a doc (between the markers)."""
    start, end = text.index(DOC_BEGIN) + len(DOC_BEGIN), text.index(DOC_END)
    return text[start:end].strip()


def write_doc(path: str) -> None:
    with open(path) as f:
        text = f.read()
    start, end = text.index(DOC_BEGIN) + len(DOC_BEGIN), text.index(DOC_END)
    with open(path, "w") as f:
        f.write(text[:start] + "\n" + markdown_table() + "\n" + text[end:])


if __name__ == "__main__":
    import sys
    write_doc(sys.argv[1])
