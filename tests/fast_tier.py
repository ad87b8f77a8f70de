"""The fast tier: `python -m pytest -m fast` runs the tests named here (tests/conftest.py marks
them `fast`). At least one test of each source area's core behaviour, chosen among the
cheap ones (a module's expensive set-up, a Ray cluster or a served app, starts once for the
area). An entry is a test id as pytest prints it: with its parameters, one case; without,
all of them. tests/test_fast_tier.py (in the tier itself) checks that every entry names a
test."""

from __future__ import annotations

import pytest

FAST_TIER = [
    # moe: planning, gating, capacity, balancing, the cost model and simulator
    "tests/moe/test_plan.py::test_dropped_assignments_contribute_zero",
    "tests/moe/test_plan.py::test_replicas_take_turns_in_token_order",
    "tests/moe/test_gating.py::test_mixtral_example_by_hand",
    "tests/moe/test_capacity.py::test_first_choices_beat_earlier_tokens_second_choices",
    "tests/moe/test_exchange_plan.py::test_combine_adds_a_tokens_rows_in_a_fixed_order_in_float32",
    "tests/moe/test_balance_global.py::test_replication_matches_eplb_reference",
    "tests/moe/test_cost_model.py::test_seed_worked_payload_numbers",
    "tests/moe/test_simulator.py::test_bytes_and_dedup_by_hand",
    "tests/moe/test_memory_plan.py::test_a_small_cpu_deployment_counted_by_hand",
    "tests/moe/test_resize_plan.py::test_shrink_copies_only_what_the_leaving_worker_alone_holds",
    "tests/moe/test_autoscale_policy.py::test_a_load_wobbling_around_a_size_boundary_never_flaps",
    # kernels: attention, expert MLP, packed linear, the native CPU kernels, comm
    "tests/kernels/test_attention.py::test_bfloat16_tracks_the_float64_reference",
    "tests/kernels/test_attention.py::test_metadata_slots_for_a_batch_of_decodes",
    "tests/kernels/test_expert_mlp.py::test_rows_of_one_slot_do_not_see_other_slots",
    "tests/kernels/test_packed_linear.py::test_equals_linear_within_float32_rounding_and_is_row_invariant",
    "tests/kernels/test_native_cpu.py::test_the_kernel_builds_and_runs_where_the_machine_allows_it",
    "tests/kernels/test_native_cpu.py::test_the_library_reports_every_shared_constant_as_the_python_side_defines_it",
    "tests/kernels/test_native_bf16.py::test_linear_is_the_float64_result_rounded_once_and_row_invariant",
    "tests/kernels/test_huge_pages.py::test_read_stacked_is_the_checkpoints_tensors_concatenated",
    "tests/kernels/test_comm_layout.py::test_row_offsets_are_an_exclusive_prefix_sum",
    "tests/kernels/test_comm_cpu.py::test_single_rank_validates_inputs_and_sends_to_itself",
    "tests/kernels/test_comm_cpu.py::test_dead_peer_raises_peer_lost_naming_it[sockets]",
    # engine core, and parity with transformers
    "tests/engine/test_engine.py::test_batched_outputs_equal_one_at_a_time",
    "tests/engine/test_engine.py::test_abort_releases_blocks",
    "tests/engine/test_parity_transformers.py::test_prefill_logits_match_transformers",
    "tests/engine/test_parity_transformers.py::test_greedy_decode_matches_generate_with_midflight_joins[mixtral]",
    "tests/engine/test_sampler.py::test_penalties_follow_vllm_formulas_by_hand",
    "tests/engine/test_prefix_cache.py::test_shared_blocks_are_reference_counted_and_never_written",
    "tests/engine/test_checkpoint.py::test_tokenizer_round_trips_and_renders_chat",
    "tests/engine/test_hf_config.py::test_every_architecture_parses_with_its_semantics",
    # the OpenAI API: chat, completions, tools, structured output, streamed text
    "tests/engine/test_tool_calls.py::test_content_never_shows_a_half_marker",
    "tests/engine/test_tool_calls.py::test_plans_per_tool_choice",
    "tests/engine/test_structured_output.py::test_first_step_mask_equals_the_regex_reference",
    "tests/engine/test_stream_text.py::test_a_stop_string_split_across_tokens_is_held_back_then_cut",
    "tests/engine/test_run_batch.py::test_completions_equal_the_engine_and_carry_token_ids",
    # the EP exchange
    "tests/engine/test_ep_native_layer.py::test_the_factory_picks_the_python_sides_where_the_native_layer_does_not_apply",
    "tests/engine/test_ep_native_layer.py::test_a_silent_router_times_out_naming_it",
    "tests/engine/test_ep_native_layer.py::test_native_bf16_sides_give_the_python_sides_outputs_bit_for_bit",
    "tests/engine/test_ep_host_syncs.py::test_at_most_two_syncs_per_layer_per_side_and_outputs_equal_the_engine",
    # actors: the EP group on Ray, the controller, recovery, routers
    "tests/actors/test_expert_parallel.py::test_outputs_equal_the_in_process_engine[contiguous-2w-1r-unpinned-system-malloc]",
    "tests/actors/test_controller.py::test_skewed_load_is_rebalanced_and_balanced_load_is_left_alone",
    "tests/actors/test_recovery.py::test_a_worker_lost_mid_flight_loses_no_request[no-replicas-killed]",
    "tests/actors/test_router_idle_wait.py::test_a_router_without_work_agrees_at_once_right_after_a_group_step",
    "tests/actors/test_delta_channel.py::test_submits_and_aborts_reach_the_router_in_order_with_the_connections_queue",
    "tests/actors/test_delta_channel.py::test_a_wrong_secret_is_closed_unanswered_and_registers_nothing",
    "tests/actors/test_delta_channel.py::test_each_connection_has_a_queue_of_its_own_and_its_end_is_detached",
    "tests/actors/test_heap_freeze.py::test_the_cycles_loading_left_are_collected_before_freezing",
    "tests/actors/test_reload_in_place.py::test_a_cycle_takes_one_row_aside",
    "tests/actors/test_progress_slot.py::test_a_single_reading_decides_busy_or_wedged",
    # serve: HTTP through the openai client
    "tests/serve/test_http.py::test_models_lists_the_served_model",
    "tests/serve/test_http.py::test_greedy_completions_on_token_ids_equal_the_in_process_engine",
    "tests/serve/test_http.py::test_chat_works_with_the_template",
    "tests/serve/test_http.py::test_health_reports_every_actor",
    "tests/serve/test_event_stream_response.py::test_a_send_that_raises_closes_the_events_at_once",
    # cluster: config, CLI, import directions
    "tests/cluster/test_config.py::test_minimum_loads_exactly_as_written",
    "tests/cluster/test_config.py::test_errors_name_the_yaml_path",
    "tests/cluster/test_plan_cli.py::test_payload_table",
    "tests/cluster/test_import_directions.py::test_no_module_imports_in_a_circle",
    "tests/benchmarks/test_bench_vs_vllm_ratios.py::test_a_round_with_failed_requests_is_left_out_of_the_ratio",
]

# fast-tier entries that matched none of the tests collected from their file (set by conftest)
UNMATCHED = pytest.StashKey[list]()


def in_fast_tier(nodeid: str, entries: list[str]) -> bool:
    return any(nodeid == e or nodeid.startswith(e + "[") or nodeid.startswith(e + "::") for e in entries)
