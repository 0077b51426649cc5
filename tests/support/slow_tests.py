"""What `make test` leaves to `make test-all`, chosen by measured cost (tests/conftest.py marks these
slow). The seconds are one run on the 2-core development machine under load (setup included).
`make test` must stay within 8 minutes on 2 cores, and every tier keeps fast cases of each kind
(multi-rank, faults, server, speculative, regions). Benchmarks are marked slow in their files.

An entry is a test file, a test function (all its parameters) or one parametrized case, relative to
tests/; tests/repo/test_test_layout.py checks that each one names a test that exists."""

SLOW = {
    # unit
    "unit/test_intermediates.py::test_v41_flash_prompt_chunk_regions_stay_within_256_mib": 267,
    "unit/test_memory_report.py::test_v41_flash_builds_on_meta_without_allocating": 59,
    "unit/test_step_prediction.py::test_cli_decode_steps": 127,   # fast case: test_decode_steps_at_cp2_ep2
    "unit/test_step_prediction.py::test_bytes_follow_the_shard_plan_and_time_the_bandwidth_without_kernels": 8,
    # engine
    "engine/test_spec_decode.py::test_confidence_scheduled_greedy_equals_plain_greedy": 29,
    "engine/test_spec_decode.py::test_sampled_requests_reproduce_per_seed_across_batches": 28,
    "engine/test_spec_draft_vocab.py::test_sampled_drafts_stay_in_the_vocabulary_and_reproduce_per_seed": 11,
    "engine/test_spec_decode.py::test_greedy_with_oracle_drafts_mixed_lengths_chunked_and_preempted": 23,
    "engine/test_spec_decode.py::test_confidence_scheduled_sampling_runs_and_frees_everything": 10,
    "engine/test_spec_constrained.py::test_grammar_rows_draft_and_keep_the_text_and_the_matcher": 32,
    "engine/test_spec_constrained.py::test_sampled_logprobs_rows_report_the_entries_of_their_own_tokens": 10,
    "engine/test_v41_model.py::test_prefill_decode_chunked_agree": 25,   # packed form: test_packed_weights
    "engine/test_row_chunks.py::test_prompt_rows_in_chunks_give_the_same_logits[v4]": 10,   # v41 stays fast
    "engine/test_v41_model.py::test_compact_records_prefill_equals_decode_and_track_plain": 10,
    "engine/test_distill_drafts.py": 22,
    # the compiled cpu step: Dynamo traces every layer kind's region (aot_eager), measured at load ~10
    "engine/test_cpu_compiled.py::test_compiled_steps_give_the_eager_greedy_tokens": 1037,
    "engine/test_cpu_compiled.py::test_compiled_verification_gives_the_plain_tokens": 130,
    "engine/test_cpu_compiled.py::test_prompt_buckets_compile_prompt_and_mixed_steps_with_the_eager_greedy_tokens": 122,
    "engine/test_cpu_compiled.py::test_warm_up_compiles_the_regions_and_the_prompt_kernels_before_the_first_request": 39,
    "engine/test_cpu_compiled.py::test_greedy_speculative_steps_in_one_step_graph_give_plain_greedy": 62,
    # compiled regions of both tiny checkpoints over two step shapes (the v4 case ~33 s, v41 ~131 s)
    "engine/test_shared_scope.py::test_compiled_indexer_reads_the_scope_with_the_eager_selections": 164,
    "engine/test_train_tiny.py::test_train_write_expand_load_and_speculate": 53,
    "engine/test_trained_artifact.py": 40,   # the quality-table case runs three engines in subprocesses
    "engine/test_engine_sampling.py::test_preemption_keeps_the_matcher_state": 14,
    "engine/test_request_fuzz.py": 13,
    "engine/test_prompt_logprobs.py::test_prompt_logprobs_survive_preemption_without_duplicates": 6,
    "engine/test_cuda_graph_runner.py::test_padded_decode_step_is_capturable[v4-dtype0-plain-dense]": 2,
    "engine/test_cuda_graph_runner.py::test_padded_decode_step_is_capturable[v4-dtype1-plain-dense]": 2,
    "engine/test_cuda_graph_runner.py::test_padded_decode_step_is_capturable[v4-dtype2-compact-dense]": 3,
    "engine/test_cuda_graph_runner.py::test_padded_decode_step_is_capturable[v4-dtype3-plain-packed]": 4,
    "engine/test_cuda_graph_runner.py::test_padded_decode_step_is_capturable[v41-dtype1-plain-dense]": 2,
    # neuron (host mode)
    "neuron/test_nki_active_experts.py::test_active_kernel_equals_the_all_experts_kernel_bitwise[dtype0-sweep]": 22,
    "neuron/test_nki_active_experts.py::test_active_kernel_equals_the_all_experts_kernel_bitwise[dtype1-sweep]": 16,
    "neuron/test_nki_active_experts.py::test_active_kernel_equals_the_all_experts_kernel_bitwise[dtype1-fast]": 10,
    "neuron/test_op_census.py": 215,
    "neuron/test_regions.py::test_a_step_wanting_more_logits_rows_than_the_exit_holds_runs_its_exit_eagerly": 14,
    "neuron/test_device_report.py::test_v41_flash_report_at_cp64_ep64": 700,
    "neuron/test_regions.py::test_compact_kv_records_compile_into_regions": 16,
    "neuron/test_scripts.py::test_dockerfile_self_check_runs_on_the_host": 13,
    "neuron/test_regions.py::test_warm_up_compiles_every_bucket_before_the_first_request": 12,
    "neuron/test_spec_regions.py": 17,
    "neuron/test_spec_one_copy.py": 690,   # 9 engines at ~30-100 s each under load
    # the tiny V4.1 engine's warm-up (its draft region with the heads); the tie rule and the row choice stay fast
    "neuron/test_draft_heads_in_graph.py::test_in_graph_argmax_drafts_equal_the_host_path": 72,
    # nextn 5 stays fast: the one speculative region-graph case of make test
    "neuron/test_verify_buckets.py::test_power_of_two_verification_buckets_keep_plain_greedy_tokens[1]": 36,
    "neuron/test_verify_buckets.py::test_power_of_two_verification_buckets_keep_plain_greedy_tokens[2]": 38,
    "neuron/test_verify_buckets.py::test_power_of_two_verification_buckets_keep_plain_greedy_tokens[3]": 35,
    "neuron/test_verify_buckets.py::test_power_of_two_verification_buckets_keep_plain_greedy_tokens[4]": 46,
    "neuron/test_verify_buckets.py::test_power_of_two_verification_buckets_keep_plain_greedy_tokens_long": 122,
    "neuron/test_verify_buckets.py::test_warm_up_compiles_the_planned_verification_graphs": 90,
    "neuron/test_verify_buckets.py::test_platform_buckets_verify_in_the_decode_bucket_with_its_graphs": 35,
    "neuron/test_nki_wiring.py::test_tiny_v41_simulated_kernels_give_the_cpu_tokens": 15,
    "neuron/test_packed_regions.py::test_packed_regions_give_the_cpu_tokens[v4]": 8,
    "neuron/test_engram_host.py::test_host_mode_greedy_tokens_equal_the_cpu_platform[dense]": 5,
    "neuron/test_float8_carriers.py::test_packed_compact_regions_hold_no_float8": 92,
    "neuron/test_float8_carriers.py::test_region_scan_catches_a_record_decode_traced_inline": 43,
    # moved for the 8-minute budget (each has fast neighbours of its kind)
    "neuron/test_verify_buckets.py::test_power_of_two_verification_buckets_keep_plain_greedy_tokens[5]": 13,
    "neuron/test_packed_regions.py::test_packed_regions_give_the_cpu_tokens[v41]": 12,
    "neuron/test_device_report.py::test_tiny_v41_report_traces_every_planned_graph": 8,
    "engine/test_engine_model.py::test_chunking_and_batching_do_not_change_tokens": 9,
    "engine/test_prefix_cache.py::test_speculative_decoding_with_prefix_caching": 6,
    "engine/test_prefix_cache.py::test_eviction_reclaims_idle_blocks_lru_and_never_held_ones": 6,
    "engine/test_startup_log.py::test_debug_shows_the_startup_lines_and_each_step_and_error_shows_none": 6,
    "engine/test_spec_constrained.py::test_greedy_logprobs_rows_draft_and_report_the_plain_entries": 5,
    "engine/test_prompt_logprobs.py::test_prompt_logprobs_equal_teacher_forced_logits_under_any_chunking": 5,
    # process: one fast case of each kind stays (multi-rank tokens, a follower killed, drafts across
    # ranks, the server's requests, the bench offline)
    "process/test_multi_rank_model.py": 87,
    "process/test_vocab_parallel_ranks.py": 212,
    "process/test_ep_active_experts.py": 55,
    "process/test_shared_tables.py::test_three_ranks_share_one_mapped_table": 63,
    "process/test_shared_tables.py::test_rank_that_never_maps_fails_the_host_and_leaves_nothing": 32,
    "process/test_shared_tables.py::test_rank_killed_after_mapping_leaves_nothing": 29,
    **{f"process/test_multi_rank_engine.py::test_tokens_equal_single_rank[{case}]": sec for case, sec in (
        ("cp4-lanes2-v41", 31), ("ep4-v41", 17), ("cp2-v4", 16), ("cp4-lanes2-v4", 16), ("ep2-v4", 6),
        ("ep4-v4", 11), ("cp2-ep2-v4", 7), ("cp2-v41", 11), ("ep2-v41", 10))},
    "process/test_multi_rank_engine.py::test_server_and_bench_with_cp2_ep2": 19,
    "process/test_multi_rank_engine.py::test_two_nodes_on_localhost": 18,
    "process/test_multi_rank_engine.py::test_bench_offline_records_the_layout": 11,
    "process/test_multi_rank_faults.py::test_exit_without_close_stops_followers": 40,
    "process/test_multi_rank_faults.py::test_driver_killed_followers_exit": 11,
    "process/test_multi_rank_spec.py::test_drafts_across_ranks_equal_single_rank[ep2-dp2]": 12,
    "process/test_multi_rank_spec.py::test_follower_killed_in_a_draft_block": 7,
    "process/test_multi_rank_greedy_program.py": 160,   # 5 engines (3 over two ranks) in host-mode regions
    "process/test_server.py::test_server_still_serves_after_bad_requests": 17,
    "process/test_server.py::test_32_concurrent_streams_mixed_lengths": 11,
    "process/test_server.py::test_openai_client_response_format_json_schema": 10,
    "process/test_server_shutdown.py": 58,
    "process/test_soak.py": 48,
    "process/test_bench_neuron.py::test_server_matrix": 7,
    "process/test_bench_prompts_file.py::test_offline_cell_runs_the_files_prompts": 46,   # at load ~15
    # rank liveness: the idle SIGKILL through LLM and the engine loop's policy (fake engine) stay fast
    "process/test_rank_liveness.py::test_llm_follower_stopped_mid_generation_is_named_hung": 25,
    "process/test_rank_liveness.py::test_llm_follower_on_other_host_killed_while_idle": 20,
    "process/test_rank_liveness.py::test_llm_other_host_killed_while_idle": 20,
    "process/test_rank_liveness.py::test_llm_other_host_frozen_mid_generation": 30,
    "process/test_rank_liveness.py::test_server_follower_killed": 120,
    "process/test_rank_liveness.py::test_server_follower_stopped_is_named_hung": 60,
    # chat tools and prefix caching through a real server (the units: unit/test_reply_parser.py,
    # unit/test_chat_dsml.py, unit/test_prefix_cache_blocks.py, engine/test_prefix_cache.py)
    "process/test_server_tools.py": 87,
    "process/test_prefix_cache_server.py": 40,
    "process/test_prefix_cache_multirank.py": 40,
    "process/test_prefix_cache_bench.py": 40,
    "neuron/test_compile_cache.py::test_warm_up_reports_the_cache_without_claiming_device_work": 190,
    "neuron/test_compile_plan.py::test_warm_up_compiles_the_plan_and_the_split_keeps_greedy_tokens": 60,
}
