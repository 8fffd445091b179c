"""Which test shows each config key's effect, or why the key needs none (tests/config/test_key_coverage.py).

Every leaf key of the schema has exactly one entry:

- ``effects(key, test ids...)``: tests that show what the key's value changes, checked on values.
  Each test's source (with its decorators, and the fixtures, helpers and constants of its own file
  that it uses) must name the key: its full dotted name, its leaf name, or an alias from ``via``
  (the spec field or parameter the key becomes: ``via=("norm_by_std",)``). Many keys are plumbing:
  ``PLAN`` shows the value reaching its field of the run plan, and the consumer's own test (which
  takes that field) shows what the field does.
- ``refused(key, context...)``: the check refuses every non-default value (the coverage test tries
  one or two, under the ``context`` overrides, e.g. the critic's keys with gae).
- ``fixed(key)``: a ``Literal`` with a single value; the loader refuses any other.
- ``gap(key, why)``: accepted and acts nowhere: a bug until the key is wired (then ``effects``) or
  refused by the check (then ``refused``). The coverage test runs the refusal check on it, so it
  fails until one of the two happens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

# test files, so that the rows stay readable
ACTOR = "tests/workers/test_actor.py"
AGENTS = "tests/agents/test_multi_turn.py"
TOOLS = "tests/agents/test_tools.py"
ADV = "tests/algorithms/test_advantages.py"
AGG = "tests/algorithms/test_aggregation.py"
BUILD = "tests/plan/test_build.py"
CKPT = "tests/run/test_checkpoint.py"
DATASET = "tests/data/test_dataset.py"
DERIVED = "tests/config/test_derived.py"
FSDP = "tests/workers/test_fsdp.py"
HF = "tests/rollout/test_hf.py"
IMAGES = "tests/data/test_images.py"
VIDEOS = "tests/data/test_videos.py"
KL = "tests/algorithms/test_kl.py"
LOADER = "tests/data/test_dataloader.py"
LOOP = "tests/trainer/test_loop.py"
LOSSES = "tests/algorithms/test_policy_losses.py"
NEW_LOSSES = "tests/algorithms/test_entropy_aware.py"
MECH = "tests/workers/test_mechanics.py"
MODELS = "tests/models/test_model_loading.py"
MOE = "tests/workers/test_moe_actor.py"
OPTIM = "tests/workers/test_optim.py"
REWARDS = "tests/rewards/test_reward_manager.py"
ROLLOUT = "tests/rollout/test_rollout_base.py"
VLLM = "tests/rollout/test_vllm.py"
LORA_ROLLOUT = "tests/rollout/test_lora_rollout.py"
VISION_CACHE = "tests/workers/test_vision_cache.py"

# MoE experts: the keys in the plan (an MoE model: the dense test model refuses them) and expert parallelism on 2 ranks
EXPERT_PLAN = "tests/plan/test_expert_parallel_plan.py::test_expert_keys_reach_every_role"
EXPERT_PARALLEL = "tests/workers/test_expert_parallel.py::test_expert_parallel_equals_experts_sharded_by_fsdp"
CORRECTION = "tests/algorithms/test_rollout_correction.py"
SEPARATE = "tests/trainer/test_e2e_separate_rollout.py::TestSeparateRollout"
SERVICE = "tests/trainer/test_rollout_service.py"
CORRECTION_LOOP = f"{LOOP}::test_rollout_correction_settings_the_loop_applies"
PLAN = f"{BUILD}::test_keys_reach_their_spec_fields"  # the key's value reaches its field of the run plan
GPU_ENGINE = f"{VLLM}::test_gpu_engine_settings"  # EngineSpec -> vllm.LLM keyword arguments on GPUs
OFFLOAD = "tests/workers/test_update.py::test_offload_moves_what_the_keys_ask_and_brings_it_back"
FLOW = f"{LOOP}::test_validation_and_checkpoint_schedule"
FILTER = f"{LOOP}::test_online_filtering_keeps_the_groups_in_range"
KL_LOOP = f"{LOOP}::test_adaptive_kl_controller_follows_the_step_kl"
KL_CONTROLLER = f"{KL}::test_adaptive_controller_follows_ziegler_update"
ENT_HAND = "tests/algorithms/test_entropy.py::test_adaptive_controller_steps_gates_and_clamps_by_hand"
ENT_LOOP = "tests/trainer/test_entropy_control_loop.py::test_the_loop_steps_the_coefficient_on_each_updates_entropy"
ENT_ACTOR = "tests/workers/test_actor_entropy_control.py::test_the_drivers_coefficient_enters_the_loss_as_minus_c_times_entropy"
E2E = "tests/trainer/test_e2e.py::TestEstimators::test_trains_two_steps"  # every estimator and loss trains 2 steps (slow)
RM_WORKER = "tests/workers/test_reward_model_worker.py"
RM_PLAN = f"{RM_WORKER}::test_keys_reach_the_reward_model_spec"
RM_EQUAL = f"{RM_WORKER}::test_worker_scores_equal_transformers_forward"
RM_CHECKS = f"{RM_WORKER}::test_reward_model_keys_are_checked"
RM_E2E = "tests/trainer/test_e2e_reward_model.py::TestRewardModelRuns::test_trains_on_the_reward_model_score"
DISTILL = "tests/workers/test_distill_actor.py"
TEACHER_PLAN = f"{DISTILL}::test_teacher_keys_reach_the_teacher_spec"
DISTILL_TERM = f"{DISTILL}::test_the_distillation_term_is_the_reverse_kl_to_the_teacher"
DISTILL_CHECKS = "tests/config/test_validate_distill.py"
DISTILL_STAGE = "tests/trainer/test_distill_advantages_stage.py"
STAGES_LISTED = "tests/plan/test_plan_stages.py::test_the_plan_lists_the_recipes_stages_in_order"
JUDGE = "tests/trainer/test_e2e_judge.py"
JUDGE_PLAN = f"{JUDGE}::test_judge_keys_reach_the_spec"
JUDGE_CHECKS = f"{JUDGE}::test_judge_keys_are_checked"
JUDGE_POOL = f"{JUDGE}::test_pool_batches_caches_and_counts_parse_failures"
JUDGE_RUN = f"{JUDGE}::test_a_judged_run_trains_two_steps_and_its_eval_is_judged_alike"


@dataclass(frozen=True)
class Effects:
    tests: tuple[str, ...]
    via: tuple[str, ...] = ()


@dataclass(frozen=True)
class Refused:
    context: tuple[str, ...] = ()


@dataclass(frozen=True)
class Fixed:
    pass


@dataclass(frozen=True)
class Gap:
    why: str
    context: tuple[str, ...] = ()


Entry = Union[Effects, Refused, Fixed, Gap]
GAE = ("algorithm.adv_estimator=gae", "worker.critic.model.model_path=builtin:tiny-qwen2.5-vl")


def effects(key: str, *tests: str, via: tuple[str, ...] = ()) -> tuple[str, Entry]:
    return key, Effects(tests, via)


def refused(key: str, *context: str) -> tuple[str, Entry]:
    return key, Refused(context)


def fixed(key: str) -> tuple[str, Entry]:
    return key, Fixed()


def gap(key: str, why: str, *context: str) -> tuple[str, Entry]:
    return key, Gap(why, context)


# a valid distillation run, for the refusal checks of the teacher's keys
TEACHER_CONTEXT = ("algorithm.distill_coef=1.0", "worker.teacher.enable=true",
                   "worker.teacher.model.model_path=builtin:tiny-qwen2.5-vl")


def _fsdp(role: str, plan: str = "") -> list[tuple[str, Entry]]:
    """The FSDP keys of a role: the plan carries the role's FSDPConfig as is (``<role>.fsdp``), and
    tests/workers/test_fsdp.py shows what each field does (fsdp_plan, apply_fsdp, model_dtype).
    ``plan``: the test that shows the keys reaching the role's spec (default: PLAN)."""
    p = f"worker.{role}.fsdp"
    PLAN = plan or globals()["PLAN"]  # noqa: N806 (the rows below read as the other roles')
    return [
        effects(f"{p}.enable_full_shard", PLAN, f"{FSDP}::test_cuda_plan_takes_every_precision_key"),
        effects(f"{p}.enable_cpu_offload", PLAN, f"{FSDP}::test_cuda_cpu_offload_is_fsdp2s_policy"),
        effects(f"{p}.enable_rank0_init", PLAN, f"{FSDP}::test_rank0_init_plan"),
        # FSDP2 always keeps the original parameters (one DTensor per parameter, names and values kept):
        # both values act alike, which these tests show; accepted for EasyR1 configs (documented)
        effects(f"{p}.use_orig_params", PLAN, f"{FSDP}::test_use_orig_params_changes_nothing",
                f"{FSDP}::test_fsdp2_keeps_the_original_parameters_either_way"),
        effects(f"{p}.torch_dtype", PLAN, f"{FSDP}::test_torch_dtype_is_the_load_dtype_on_gpus"),
        # fsdp_size below the world size: hybrid sharding (HSDP), checked on 2 gloo ranks
        effects(f"{p}.fsdp_size", PLAN, f"{FSDP}::test_fsdp_size_gives_the_mesh",
                f"{FSDP}::test_fsdp_size_1_keeps_whole_parameters_on_each_rank", via=("hsdp",)),
        effects(f"{p}.mp_param_dtype", PLAN, f"{FSDP}::test_cuda_plan_takes_every_precision_key"),
        effects(f"{p}.mp_reduce_dtype", PLAN, f"{FSDP}::test_cuda_plan_takes_every_precision_key"),
        effects(f"{p}.mp_buffer_dtype", PLAN, f"{FSDP}::test_cuda_plan_takes_every_precision_key",
                f"{FSDP}::test_cast_buffers_keeps_rotary_frequencies_float32", via=("buffer_dtype", "cast_buffers")),
    ]


def _optim(role: str) -> list[tuple[str, Entry]]:
    """The optimizer keys of a trained role: the plan carries its OptimConfig (``<role>.update.optim``),
    tests/workers/test_optim.py builds the optimizer and schedule from one."""
    p = f"worker.{role}.optim"
    return [
        effects(f"{p}.lr", PLAN, f"{OPTIM}::test_every_strategy_gets_the_hyperparameters",
                f"{OPTIM}::test_scheduler_drives_the_optimizer_lr", via=("lr",)),
        effects(f"{p}.betas", PLAN, f"{OPTIM}::test_every_strategy_gets_the_hyperparameters"),
        effects(f"{p}.weight_decay", PLAN, f"{OPTIM}::test_every_strategy_gets_the_hyperparameters"),
        effects(f"{p}.strategy", PLAN, f"{OPTIM}::test_every_strategy_gets_the_hyperparameters"),
        effects(f"{p}.lr_warmup_ratio", PLAN, f"{OPTIM}::test_warmup_steps", f"{OPTIM}::test_scheduler_drives_the_optimizer_lr"),
        effects(f"{p}.lr_warmup_steps", PLAN, f"{OPTIM}::test_warmup_steps", f"{ACTOR}::test_lr_schedule_reaches_the_optimizer"),
        effects(f"{p}.min_lr_ratio", PLAN, f"{OPTIM}::test_cosine_by_hand", f"{ACTOR}::test_lr_schedule_reaches_the_optimizer"),
        effects(f"{p}.lr_scheduler_type", PLAN, f"{OPTIM}::test_scheduler_drives_the_optimizer_lr",
                f"{ACTOR}::test_lr_schedule_reaches_the_optimizer"),
    ]


def _offload(role: str) -> list[tuple[str, Entry]]:
    p = f"worker.{role}.offload"
    return [effects(f"{p}.offload_params", PLAN, OFFLOAD), effects(f"{p}.offload_optimizer", PLAN, OFFLOAD)]


# Shared by the actor and the critic: the role's value reaches its spec (PLAN), and the consumer's test
# (actor or critic alike: the same ForwardSpec / UpdateSpec / MicroBatching) shows what it does.
def _trained(role: str) -> list[tuple[str, Entry]]:
    p = f"worker.{role}"
    return [
        effects(f"{p}.global_batch_size", PLAN, f"{DERIVED}::test_gae_critic_ulysses_and_overrides"),
        # MicroBatching.micro_batch_size of the update and of the no-grad passes (forward.experience)
        effects(f"{p}.micro_batch_size_per_device_for_update", PLAN, f"{MECH}::test_micro_batches_follow_the_micro_batching_spec",
                via=("micro_batch_size",)),
        effects(f"{p}.micro_batch_size_per_device_for_experience", PLAN, f"{MECH}::test_micro_batches_follow_the_micro_batching_spec",
                via=("micro_batch_size",)),
        effects(f"{p}.max_grad_norm", PLAN, f"{ACTOR}::test_update_equals_a_hand_written_ppo_step"),
        effects(f"{p}.loss_avg_mode", PLAN, f"{ACTOR}::test_update_equals_a_hand_written_ppo_step",
                f"{LOSSES}::test_ppo_clip_seq_mode" if role == "actor" else "tests/algorithms/test_value_loss.py::test_seq_mode"),
        effects(f"{p}.ppo_epochs", PLAN, f"{DERIVED}::test_grpo_values"),
        effects(f"{p}.padding_free", PLAN, f"{MODELS}::test_vl_policy_padding_free_uses_varlen_for_text_only"),
        effects(f"{p}.share_prompts", PLAN, "tests/workers/test_shared_prompts.py::test_shared_prompts_shorten_the_packed_row"),
        effects(f"{p}.dynamic_batching", PLAN, f"{MECH}::test_micro_batches_follow_the_micro_batching_spec",
                f"{ACTOR}::test_dynamic_batching_gives_the_same_logprobs", via=("dynamic",)),
        effects(f"{p}.ulysses_size", PLAN, f"{DERIVED}::test_gae_critic_ulysses_and_overrides",
                "tests/models/test_ulysses.py::test_ulysses_layout_by_hand"),
        effects(f"{p}.expert_parallel_size", EXPERT_PLAN, EXPERT_PARALLEL),  # the critic builds its model as the actor does
        *_model(role),
        *_optim(role),
        *_fsdp(role),
        *_offload(role),
    ]


def _model(role: str) -> list[tuple[str, Entry]]:
    p = f"worker.{role}.model"
    rows = [
        effects(f"{p}.model_path", f"{BUILD}::test_model_paths_choose_the_files"),
        effects(f"{p}.override_config", PLAN, f"{MODELS}::test_override_config_in_the_spec_reaches_the_model"),
        effects(f"{p}.enable_gradient_checkpointing", PLAN, f"{MODELS}::test_vl_policy_padding_free_uses_varlen_for_text_only",
                via=("gradient_checkpointing",)),
        effects(f"{p}.trust_remote_code", PLAN, f"{MODELS}::test_trust_remote_code_is_honoured_for_the_config"),
        effects(f"{p}.freeze_vision_tower", PLAN, f"{MODELS}::test_freeze_vision_tower"),
        # sdpa / eager run everywhere; flash attention falls back to sdpa without CUDA
        effects(f"{p}.attn_implementation", PLAN, f"{MODELS}::test_flash_attention_falls_back_to_sdpa_without_cuda"),
        effects(f"{p}.experts_implementation", EXPERT_PLAN, "tests/models/test_moe_experts.py::test_grouped_experts_equal_the_eager_loop"),
    ]
    if role == "actor":
        rows += [
            effects(f"{p}.tokenizer_path", f"{BUILD}::test_model_paths_choose_the_files",
                    "tests/rollout/test_tokens.py::test_the_plan_names_the_key_of_a_tokenizer_that_does_not_fit"),
            effects(f"{p}.lora.rank", PLAN, f"{ACTOR}::test_lora_actor_syncs_merged_weights"),
            # scaling = alpha / rank: what the merged weights handed to the rollout are made with
            effects(f"{p}.lora.alpha", PLAN, f"{ACTOR}::test_lora_actor_syncs_merged_weights",
                    f"{MECH}::test_merge_lora_state_dict_by_hand", via=("scaling",)),
            effects(f"{p}.lora.target_modules", PLAN, f"{MODELS}::test_lora_comma_form_targets_exactly_those_modules",
                    f"{MODELS}::test_lora_regex_string_matches_full_names"),
            effects(f"{p}.lora.exclude_modules", PLAN, f"{MODELS}::test_lora_all_linear_excluding_the_vision_tower"),
            # merged weights or the base once and then the adapters; the plan's choice where the engine cannot
            effects(f"{p}.lora.merge_for_rollout", f"{LORA_ROLLOUT}::test_unmerged_adapters_give_the_actors_logprobs_for_fewer_bytes",
                    f"{LORA_ROLLOUT}::test_merge_for_rollout_in_the_plan"),
        ]
    else:  # the critic trains its value head and backbone in full, with the actor's token ids
        rows += [
            refused(f"{p}.tokenizer_path", *GAE),
            refused(f"{p}.lora.rank", *GAE),
            refused(f"{p}.lora.alpha", *GAE),  # the critic has no LoRA
            refused(f"{p}.lora.target_modules", *GAE),
            refused(f"{p}.lora.exclude_modules", *GAE),
            refused(f"{p}.lora.merge_for_rollout", *GAE),
        ]
    return rows


ENTRIES: list[tuple[str, Entry]] = [
    # ------------------------------------------------------------------------------------- data
    effects("data.train_files", f"{LOADER}::test_create_dataloaders"),
    effects("data.val_files", f"{LOADER}::test_create_dataloaders"),
    effects("data.prompt_key", f"{DATASET}::test_column_keys_name_the_columns"),
    effects("data.answer_key", f"{DATASET}::test_column_keys_name_the_columns"),
    effects("data.image_key", f"{DATASET}::test_column_keys_name_the_columns"),
    effects("data.video_key", f"{DATASET}::test_column_keys_name_the_columns"),
    effects("data.image_dir", f"{DATASET}::test_images_without_placeholder_go_first_and_image_dir",
            f"{IMAGES}::test_image_dir_set_is_the_only_place"),
    effects("data.video_fps", f"{VIDEOS}::test_a_video_file_is_decoded_and_sampled",
            f"{VIDEOS}::test_rows_mixing_text_images_and_videos"),
    effects("data.video_max_frames", f"{VIDEOS}::test_a_video_file_is_decoded_and_sampled",
            f"{VIDEOS}::test_rows_mixing_text_images_and_videos"),
    effects("data.max_prompt_length", f"{DATASET}::test_truncation_left_and_right_on_text",
            f"{DATASET}::test_filter_overlong_prompts_drops_and_counts"),
    effects("data.max_response_length", PLAN, f"{ROLLOUT}::test_the_plan_has_training_and_validation_sampling",
            f"{AGG}::test_seq_mean_token_sum_norm_uses_given_constant_length", via=("norm_length",)),
    effects("data.rollout_batch_size", f"{DERIVED}::test_total_steps", f"{DERIVED}::test_grpo_values", FILTER),
    effects("data.mini_rollout_batch_size", f"{DERIVED}::test_gae_critic_ulysses_and_overrides", f"{LOADER}::test_create_dataloaders"),
    effects("data.val_batch_size", f"{LOADER}::test_create_dataloaders"),
    effects("data.format_prompt", f"{DATASET}::test_format_prompt_and_system_prompt"),
    effects("data.override_chat_template", f"{DATASET}::test_override_chat_template"),
    effects("data.shuffle", f"{LOADER}::test_create_dataloaders_shuffle_and_seed"),
    effects("data.seed", f"{LOADER}::test_create_dataloaders_shuffle_and_seed"),
    effects("data.min_pixels", f"{DATASET}::test_pixel_limits_resize_the_rows_images"),
    effects("data.max_pixels", f"{DATASET}::test_pixel_limits_resize_the_rows_images", f"{IMAGES}::test_the_two_numbers_from_the_brief"),
    effects("data.filter_overlong_prompts", f"{DATASET}::test_filter_overlong_prompts_drops_and_counts"),
    effects("data.filter_overlong_prompts_workers", f"{DATASET}::test_scan_threads_follow_filter_overlong_prompts_workers"),
    effects("data.prompt_truncation", f"{DATASET}::test_truncation_left_and_right_on_text"),
    effects("data.system_prompt", f"{DATASET}::test_format_prompt_and_system_prompt"),
    effects("data.on_bad_row", f"{DATASET}::test_skip_bad_rows_counts_them"),
    # -------------------------------------------------------------------------------- algorithm
    effects("algorithm.gamma", f"{LOOP}::test_advantage_settings_reach_the_estimator", f"{ADV}::test_reinforce_plus_plus_hand_values"),
    effects("algorithm.lam", f"{LOOP}::test_advantage_settings_reach_the_estimator",
            f"{ADV}::test_gae_hand_values_at_b3_with_different_lengths"),
    effects("algorithm.adv_estimator", f"{LOOP}::test_advantage_settings_reach_the_estimator", PLAN,
            E2E),
    effects("algorithm.disable_kl", PLAN, f"{BUILD}::test_disable_kl_wins_over_the_kl_loss"),
    effects("algorithm.use_kl_loss", PLAN, f"{BUILD}::test_disable_kl_wins_over_the_kl_loss",
            f"{ACTOR}::test_kl_loss_and_entropy_bonus_enter_the_loss"),
    effects("algorithm.kl_penalty", PLAN, f"{KL}::test_token_estimators_hand_values",
            f"{ACTOR}::test_kl_loss_and_entropy_bonus_enter_the_loss"),
    effects("algorithm.kl_coef", PLAN, KL_LOOP, f"{KL}::test_apply_kl_penalty_hand_values"),
    # the controller of the KL in the reward: built by the loop from these three, updated each step
    effects("algorithm.kl_type", KL_LOOP, KL_CONTROLLER,
            via=("build_kl_controller",)),
    effects("algorithm.kl_horizon", KL_LOOP, KL_CONTROLLER),
    effects("algorithm.kl_target", KL_LOOP, KL_CONTROLLER),
    effects("algorithm.use_bias_correction_kl", PLAN, f"{ACTOR}::test_use_bias_correction_kl_weighs_the_kl_loss_by_the_ratio",
            f"{NEW_LOSSES}::test_bias_corrected_kl_hand_values_and_gradient", via=("bias_correction", "old_logprobs")),
    effects("algorithm.online_filtering", FILTER, f"{LOOP}::test_without_online_filtering_every_group_is_kept"),
    effects("algorithm.filter_key", FILTER),
    effects("algorithm.filter_low", FILTER, "tests/trainer/test_core.py::test_groups_in_range_drops_all_right_and_all_wrong_groups",
            via=("groups_in_range",)),  # groups_in_range(uids, values, filter_low, filter_high)
    effects("algorithm.filter_high", FILTER, "tests/trainer/test_core.py::test_groups_in_range_drops_all_right_and_all_wrong_groups",
            via=("groups_in_range",)),
    effects("algorithm.norm_adv_by_std_in_grpo", f"{LOOP}::test_grpo_advantages_with_and_without_std_normalisation",
            f"{ADV}::test_dr_grpo_does_not_divide_by_std", via=("norm_by_std",)),
    # GDPO: the loop replaces the weighted sum by the decoupled score (refusals: tests/config/test_validate_multi_objective.py)
    effects("algorithm.multi_objective_aggregation",
            "tests/trainer/test_loop_multi_objective.py::test_normalize_then_sum_keeps_the_weighted_functions_apart",
            "tests/trainer/test_loop_multi_objective.py::test_normalize_then_sum_is_the_score_of_other_outcome_estimators",
            "tests/algorithms/test_multi_objective.py::test_normalize_then_sum_hand_values",
            "tests/algorithms/test_multi_objective.py::test_gdpo_scores_hand_values_and_batch_normalisation",
            via=("normalize_then_sum", "gdpo_scores")),
    # verl's rollout correction: the loop makes weights and masks (test_loop), the losses apply them
    # on-policy distillation (issue 48): the loss term against two transformers models, the stages
    effects("algorithm.distill_coef", DISTILL_TERM, f"{DISTILL_STAGE}::test_the_teachers_advantage_is_added_to_the_estimators",
            f"{DISTILL_CHECKS}::test_a_coefficient_without_a_teacher_and_a_teacher_without_a_coefficient"),
    effects("algorithm.distill_full_kl", DISTILL_TERM, STAGES_LISTED),
    effects("algorithm.distill_as_reward", f"{DISTILL_STAGE}::test_the_teachers_advantage_is_added_to_the_estimators",
            STAGES_LISTED),
    effects("algorithm.distill_only", f"{DISTILL}::test_pure_distillation_takes_no_gradient_from_the_advantages",
            f"{DISTILL_STAGE}::test_pure_distillation_as_reward_is_the_teachers_advantage_alone", STAGES_LISTED),
    effects("algorithm.rollout_correction.rollout_is", CORRECTION_LOOP, f"{CORRECTION}::test_token_tis_truncates_at_the_threshold",
            f"{CORRECTION}::test_sequence_is_is_the_product_over_the_sequence_and_batch_normalizes_over_sequences"),
    effects("algorithm.rollout_correction.rollout_is_threshold", CORRECTION_LOOP,
            f"{CORRECTION}::test_icepop_zeroes_weights_outside_the_band",
            f"{DISTILL}::test_off_policy_tokens_weight_the_one_sample_loss", via=("parse_is_threshold",)),
    effects("algorithm.rollout_correction.rollout_is_batch_normalize", CORRECTION_LOOP,
            f"{CORRECTION}::test_token_batch_normalize_divides_by_the_token_mean", via=("batch_normalize",)),
    effects("algorithm.rollout_correction.rollout_rs", CORRECTION_LOOP, f"{CORRECTION}::test_sequence_rejection_criteria",
            via=("parse_rejection",)),
    effects("algorithm.rollout_correction.rollout_rs_threshold", CORRECTION_LOOP,
            f"{CORRECTION}::test_k1_bounds_follow_verls_convention", via=("parse_rejection",)),
    effects("algorithm.rollout_correction.bypass_mode", CORRECTION_LOOP),
    refused("algorithm.rollout_correction.loss_type"),  # only ppo_clip; verl's reinforce is not implemented
    # ---------------------------------------------------------------------------------- worker
    refused("worker.hybrid_engine"),  # actor and reference always share devices; engines: placement=separate
    # actor
    fixed("worker.actor.strategy"),
    effects("worker.actor.clip_ratio_low", PLAN, f"{LOSSES}::test_ppo_clip_hand_values_and_gradient"),
    effects("worker.actor.clip_ratio_high", PLAN, f"{LOSSES}::test_ppo_clip_hand_values_and_gradient"),
    effects("worker.actor.clip_ratio_dual", PLAN, f"{LOSSES}::test_ppo_clip_hand_values_and_gradient"),
    effects("worker.actor.loss_type", PLAN, f"{LOSSES}::test_gspo_hand_values_and_gradient", E2E,
            via=("get_policy_loss",)),  # the name the loss is looked up by
    effects("worker.actor.tau_positive", PLAN, f"{LOSSES}::test_sapo_temperatures_apply_to_the_right_advantage_sign"),
    effects("worker.actor.tau_negative", PLAN, f"{LOSSES}::test_sapo_temperatures_apply_to_the_right_advantage_sign"),
    *(effects(f"worker.actor.{key}", PLAN, f"{NEW_LOSSES}::test_clip_cov_hand_values_and_gradient")
      for key in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub")),
    *(effects(f"worker.actor.{key}", PLAN, f"{NEW_LOSSES}::test_kl_cov_hand_values_and_gradient")
      for key in ("kl_cov_ratio", "ppo_kl_coef")),
    effects("worker.actor.top_entropy_quantile", PLAN,
            f"{ACTOR}::test_top_entropy_quantile_gates_the_update_by_the_micro_batch_entropies"),
    effects("worker.actor.off_policy_mask_threshold", PLAN,
            f"{ACTOR}::test_off_policy_mask_threshold_drops_stale_negative_sequences"),
    effects("worker.actor.use_torch_compile", PLAN, f"{ACTOR}::test_torch_compile_gives_the_eager_logprobs_and_update"),
    effects("worker.actor.entropy_coeff", PLAN, f"{ACTOR}::test_kl_loss_and_entropy_bonus_enter_the_loss"),
    # adaptive entropy control: the driver's controller (pure, by hand), its loop, the actor's loss
    effects("worker.actor.use_adaptive_entropy", PLAN, ENT_LOOP, ENT_ACTOR),
    effects("worker.actor.entropy_target", PLAN, ENT_LOOP, ENT_HAND, via=("target",)),
    effects("worker.actor.entropy_coeff_delta", PLAN, ENT_LOOP, ENT_HAND, via=("delta",)),
    effects("worker.actor.entropy_coeff_min", PLAN, ENT_LOOP, ENT_HAND, via=("coeff_min",)),
    effects("worker.actor.entropy_coeff_max", PLAN, ENT_LOOP, ENT_HAND, via=("coeff_max",)),
    effects("worker.actor.max_token_len_per_device", PLAN, f"{MECH}::test_micro_batches_follow_the_micro_batching_spec",
            f"{ACTOR}::test_dynamic_batching_gives_the_same_logprobs", via=("max_token_len",)),
    # MoE policies: router replay (recorded and replayed experts) and the load-balancing loss
    effects("worker.actor.router_replay", f"{MOE}::test_router_replay_reaches_the_policy_passes",
            f"{MOE}::test_r2_records_the_routers_choices", f"{MOE}::test_the_update_replays_the_recorded_experts"),
    effects("worker.actor.router_aux_loss_coef", f"{MOE}::test_default_coefficient_is_the_models",
            f"{MOE}::test_aux_loss_is_the_models_and_trains_the_router"),
    effects("worker.actor.vision_cache_mb", PLAN, f"{VISION_CACHE}::test_cached_logprobs_are_bitwise_the_recomputed_ones",
            f"{VISION_CACHE}::test_the_default_budget_follows_the_frozen_tower"),
    *_trained("actor"),
    # critic (gae only)
    fixed("worker.critic.strategy"),
    effects("worker.critic.cliprange_value", PLAN, "tests/algorithms/test_value_loss.py::test_hand_values_gradient_and_metrics"),
    *_trained("critic"),
    # reference model: the actor's forward settings, its own FSDP and offload
    fixed("worker.ref.strategy"),
    *_fsdp("ref"),
    effects("worker.ref.offload.offload_params", PLAN,
            "tests/workers/test_ref_critic.py::test_ref_offload_params_moves_the_weights_while_idle"),
    refused("worker.ref.offload.offload_optimizer"),  # the reference model has no optimizer
    # the distillation teacher (issue 48): a RefWorker on its own model; TEACHER_PLAN shows each key
    # reaching its RefSpec, the worker tests what the spec does against transformers' forward
    effects("worker.teacher.enable", TEACHER_PLAN, f"{DISTILL_CHECKS}::test_a_coefficient_without_a_teacher_and_a_teacher_without_a_coefficient"),
    effects("worker.teacher.model.model_path", TEACHER_PLAN, f"{DISTILL}::test_the_teachers_log_probs_are_its_models_forward",
            f"{DISTILL_CHECKS}::test_a_teacher_with_another_tokenizer_is_refused"),
    effects("worker.teacher.model.override_config", TEACHER_PLAN),
    effects("worker.teacher.model.trust_remote_code", TEACHER_PLAN),
    effects("worker.teacher.model.attn_implementation", TEACHER_PLAN),
    *_fsdp("teacher", plan=TEACHER_PLAN),
    effects("worker.teacher.offload.offload_params", TEACHER_PLAN,
            "tests/workers/test_ref_critic.py::test_ref_offload_params_moves_the_weights_while_idle"),
    refused("worker.teacher.offload.offload_optimizer", *TEACHER_CONTEXT),  # the teacher has no optimizer
    # reward
    effects("worker.reward.reward_type", PLAN, "tests/rewards/test_reward_loader.py::test_defaults_without_constants_and_config_override"),
    effects("worker.reward.reward_function", f"{REWARDS}::test_settings_from_the_real_config"),
    effects("worker.reward.reward_function_kwargs", PLAN,
            "tests/rewards/test_reward_loader.py::test_defaults_without_constants_and_config_override"),
    effects("worker.reward.skip_special_tokens", f"{LOOP}::test_reward_settings_the_loop_reads",
            "tests/rewards/test_reward_actor.py::test_build_reward_inputs"),
    effects("worker.reward.num_cpus", f"{LOOP}::test_reward_settings_the_loop_reads",
            "tests/plan/test_launch.py::test_without_ray_address_a_local_cluster_with_the_reward_cpus"),
    effects("worker.reward.timeout", PLAN, f"{REWARDS}::test_timeout_kills_the_call_and_the_manager_recovers"),
    effects("worker.reward.on_error", PLAN, f"{REWARDS}::test_on_error_zero_sequential_counts_failures"),
    effects("worker.reward.num_workers", PLAN, f"{REWARDS}::test_sequential_keeps_sample_order_over_two_workers"),
    # the reward model (issue 20): RM_PLAN shows each key reaching RewardModelSpec, the worker test
    # what the spec does against transformers' forward; every key is refused while enable is false
    effects("worker.reward_model.enable", RM_PLAN, RM_CHECKS),
    effects("worker.reward_model.model.model_path", RM_PLAN, f"{RM_WORKER}::test_a_policy_checkpoint_is_refused"),
    effects("worker.reward_model.model.override_config", RM_PLAN),
    effects("worker.reward_model.model.trust_remote_code", RM_PLAN),
    effects("worker.reward_model.model.attn_implementation", RM_PLAN),
    effects("worker.reward_model.micro_batch_size_per_device", RM_PLAN, RM_EQUAL, RM_CHECKS),
    effects("worker.reward_model.padding_free", RM_PLAN, RM_EQUAL),
    effects("worker.reward_model.normalize", RM_PLAN, RM_E2E,
            "tests/rewards/test_model_scores.py::test_training_scores_update_the_statistics_validation_reads_them",
            via=("running",)),
    *_fsdp("reward_model", plan=RM_PLAN),
    # the generative judge (issue 20): JUDGE_PLAN shows each key reaching JudgeSpec; the judge's own
    # tests (scripted pool, the 2-step run) what the spec does
    effects("worker.judge.enable", JUDGE_PLAN, JUDGE_CHECKS),
    effects("worker.judge.model_path", JUDGE_PLAN, JUDGE_RUN),
    effects("worker.judge.trust_remote_code", JUDGE_PLAN),
    effects("worker.judge.engine", JUDGE_PLAN, JUDGE_RUN),
    effects("worker.judge.template", JUDGE_PLAN, f"{JUDGE}::test_a_broken_template_is_a_config_error", JUDGE_POOL),
    effects("worker.judge.parser", JUDGE_PLAN, JUDGE_POOL, JUDGE_CHECKS),
    effects("worker.judge.max_tokens", JUDGE_PLAN, JUDGE_CHECKS),
    effects("worker.judge.max_prompt_length", JUDGE_PLAN, JUDGE_RUN),
    effects("worker.judge.min_pixels", JUDGE_PLAN, JUDGE_CHECKS),
    effects("worker.judge.max_pixels", JUDGE_PLAN, JUDGE_CHECKS),
    effects("worker.judge.num_workers", JUDGE_PLAN, JUDGE_POOL),
    effects("worker.judge.timeout", JUDGE_PLAN, f"{JUDGE}::test_a_judge_past_its_timeout_is_replaced"),
    effects("worker.judge.on_error", JUDGE_PLAN, JUDGE_POOL,
            f"{JUDGE}::test_a_verdict_that_does_not_parse_names_the_sample_with_on_error_raise"),
    effects("worker.judge.cache_size", JUDGE_PLAN, JUDGE_POOL),
    effects("worker.reward.reward_functions", f"{BUILD}::test_reward_functions_list", f"{REWARDS}::test_weighted_combination_and_key_names",
            via=("RewardFunctionSpec",)),  # each item becomes one
    # rollout: sampling keys reach the plan's Sampling, engine keys its EngineSpec (then vllm.LLM: GPU_ENGINE)
    effects("worker.rollout.name", PLAN, f"{HF}::test_greedy_matches_hand_decoding",
            f"{VLLM}::test_greedy_matches_the_transformers_engine"),
    effects("worker.rollout.n", PLAN, f"{ROLLOUT}::test_the_plan_has_training_and_validation_sampling", f"{DERIVED}::test_grpo_values"),
    effects("worker.rollout.temperature", PLAN, f"{ROLLOUT}::test_the_plan_has_training_and_validation_sampling",
            f"{HF}::test_sampled_logprobs_are_the_temperature_scaled_policy"),
    effects("worker.rollout.top_p", PLAN, f"{ROLLOUT}::test_the_plan_has_training_and_validation_sampling"),
    effects("worker.rollout.top_k", PLAN, f"{ROLLOUT}::test_the_plan_has_training_and_validation_sampling"),
    effects("worker.rollout.seed", PLAN, f"{HF}::test_rollout_seed_seeds_the_engine_stream", GPU_ENGINE,
            f"{LOOP}::test_per_request_seed_seeds_each_generation_call"),
    effects("worker.rollout.per_request_seed", PLAN, f"{LOOP}::test_per_request_seed_seeds_each_generation_call"),
    effects("worker.rollout.limit_images", PLAN, GPU_ENGINE),
    effects("worker.rollout.dtype", PLAN, GPU_ENGINE, f"{VLLM}::test_cpu_engine_settings"),
    effects("worker.rollout.gpu_memory_utilization", PLAN, GPU_ENGINE, f"{VLLM}::test_cpu_kv_cache_bytes",
            f"{BUILD}::test_checks_that_need_the_device_or_the_model"),
    effects("worker.rollout.ignore_eos", PLAN, f"{HF}::test_ignore_eos_samples_past_eos"),
    effects("worker.rollout.enforce_eager", PLAN, GPU_ENGINE),
    effects("worker.rollout.enable_chunked_prefill", PLAN, GPU_ENGINE, f"{VLLM}::test_seeded_sampling_refuses_chunked_prefill_on_the_cpu"),
    effects("worker.rollout.tensor_parallel_size", PLAN, GPU_ENGINE, f"{BUILD}::test_checks_that_need_the_device_or_the_model"),
    effects("worker.rollout.max_model_len", PLAN, GPU_ENGINE, f"{DERIVED}::test_grpo_values", via=("rollout_max_model_len",)),
    effects("worker.rollout.max_num_batched_tokens", PLAN, GPU_ENGINE),
    effects("worker.rollout.max_num_seqs", PLAN, GPU_ENGINE, f"{VLLM}::test_cpu_kv_cache_bytes",
            f"{DERIVED}::test_engine_sequences_follow_the_work", f"{VLLM}::test_the_engine_holds_the_blocks_of_the_work"),
    effects("worker.rollout.disable_log_stats", PLAN, GPU_ENGINE),
    effects("worker.rollout.disable_tqdm", PLAN, f"{VLLM}::test_disable_tqdm_hides_the_progress_bar"),
    effects("worker.rollout.tools", f"{AGENTS}::test_tool_errors_are_shown_to_the_model_and_counted",
            f"{AGENTS}::test_limits_end_samples", f"{TOOLS}::test_a_tool_without_docstring_or_hint_is_refused_with_its_name"),
    effects("worker.rollout.environment", f"{AGENTS}::test_environment_observations_and_rewards"),
    # the engines' own worker group, and the asynchronous loop on it (test_loop with fakes, e2e for real)
    effects("worker.rollout.placement", f"{LOOP}::test_separate_placement_without_one_step_off_syncs_before_each_generation",
            f"{SEPARATE}::test_synchronous_separate_engines_sample_the_current_policy"),
    effects("worker.rollout.num_devices", f"{SEPARATE}::test_synchronous_separate_engines_sample_the_current_policy"),
    effects("worker.rollout.one_step_off", f"{LOOP}::test_one_step_off_generates_the_next_batch_with_the_weights_of_the_last_step",
            f"{SEPARATE}::test_one_step_off_trains_on_samples_one_update_old", f"{SERVICE}::test_one_step_off_is_max_staleness_one"),
    effects("worker.rollout.max_staleness", f"{SERVICE}::test_whole_batches_use_the_weights_of_exactly_k_steps_before",
            f"{SERVICE}::test_streamed_samples_never_exceed_the_staleness_bound",
            f"{SEPARATE}::test_partial_rollouts_train_within_the_staleness_bound"),
    effects("worker.rollout.correct_staleness",
            "tests/plan/test_plan_stages.py::test_asynchronous_rollout_trains_with_the_staleness_correction_unless_told_otherwise",
            STAGES_LISTED),
    effects("worker.rollout.partial_rollout", f"{SERVICE}::test_streamed_tokens_keep_the_version_and_log_prob_that_sampled_them",
            f"{SEPARATE}::test_partial_rollouts_train_within_the_staleness_bound"),
    effects("worker.rollout.weight_transfer",
            f"{SERVICE}::test_weight_transfer_object_store_sends_ray_objects_without_forming_the_group",
            f"{SERVICE}::test_weight_transfer_collective_stops_when_the_group_does_not_form",
            "tests/trainer/test_e2e_weight_transfer.py::TestCollectiveWeightTransfer::"
            "test_object_store_sends_the_same_bytes_as_ray_objects"),
    effects("worker.rollout.max_turns", f"{AGENTS}::test_limits_end_samples"),
    effects("worker.rollout.max_tokens_per_turn", f"{AGENTS}::test_limits_end_samples"),
    effects("worker.rollout.tool_timeout", f"{AGENTS}::test_tool_timeout_comes_from_the_config",
            "tests/agents/test_environments_at_scale.py::test_hanging_environments_cost_one_timeout_not_one_each"),
    effects("worker.rollout.max_images_in_context",
            "tests/agents/test_environments_at_scale.py::test_the_image_budget_keeps_the_last_k_images_and_trains_what_was_sampled_in_the_kept_context",
            "tests/agents/test_environments_at_scale.py::test_an_image_budget_of_zero_shows_no_returned_image_and_trains_every_turn"),
    effects("worker.rollout.val_override_config", f"{BUILD}::test_validation_sampling_is_training_sampling_with_the_overrides",
            f"{ROLLOUT}::test_the_plan_has_training_and_validation_sampling",
            f"{VLLM}::test_validation_extra_fields_change_what_vllm_samples", via=("sampling_with_overrides",)),
    # --------------------------------------------------------------------------------- trainer
    effects("trainer.total_epochs", PLAN, f"{DERIVED}::test_total_steps"),
    effects("trainer.max_steps", PLAN, f"{DERIVED}::test_total_steps", FLOW),
    # the default checkpoint directory checkpoints/<project_name>/<experiment_name> (loggers name the run too)
    effects("trainer.project_name", f"{DERIVED}::test_grpo_values", f"{BUILD}::test_local_paths_become_absolute"),
    effects("trainer.experiment_name", f"{DERIVED}::test_grpo_values", f"{BUILD}::test_local_paths_become_absolute"),
    effects("trainer.logger", "tests/run/test_tracking.py::test_backend_writes_metrics_config_and_samples"),
    effects("trainer.nnodes", PLAN, f"{DERIVED}::test_grpo_values"),  # world size = nnodes x n_gpus_per_node
    effects("trainer.n_gpus_per_node", PLAN, f"{DERIVED}::test_grpo_values"),
    effects("trainer.max_try_make_batch", f"{LOOP}::test_online_filtering_gives_up_after_max_try_make_batch"),
    effects("trainer.critic_warmup", f"{LOOP}::test_critic_warmup_holds_the_actor_back"),
    effects("trainer.val_freq", FLOW, f"{LOOP}::test_no_validation_no_checkpoint_no_timeline"),
    effects("trainer.val_before_train", FLOW, f"{LOOP}::test_no_validation_no_checkpoint_no_timeline"),
    effects("trainer.val_only", f"{LOOP}::test_val_only_validates_once_and_stops"),
    effects("trainer.val_generations_to_log", f"{LOOP}::test_val_generations_to_log"),
    effects("trainer.rollout_log_freq",
            "tests/trainer/test_viewer_e2e.py::TestViewerOfARun::test_each_step_and_the_validation_get_a_page_matching_the_logged_metrics"),
    effects("trainer.save_freq", FLOW, f"{LOOP}::test_no_validation_no_checkpoint_no_timeline"),
    effects("trainer.save_limit", f"{LOOP}::test_save_limit_prunes_the_loops_checkpoints",
            f"{CKPT}::test_save_limit_keeps_latest_and_best"),
    effects("trainer.save_model_only", f"{LOOP}::test_save_model_only_exports_the_policy_alone",
            "tests/trainer/test_checkpoint_model_only.py::test_model_only_commit_is_recorded_and_refused_for_resume"),
    effects("trainer.save_checkpoint_path", f"{DERIVED}::test_gae_critic_ulysses_and_overrides",
            f"{BUILD}::test_local_paths_become_absolute"),
    effects("trainer.load_checkpoint_path", f"{CKPT}::test_resume_checkpoint_follows_load_path_then_the_newest"),
    effects("trainer.find_last_checkpoint", f"{CKPT}::test_resume_checkpoint_follows_load_path_then_the_newest"),
    effects("trainer.seed", PLAN, f"{ACTOR}::test_trainer_seed_sets_the_new_lora_weights"),
    effects("trainer.device", f"{BUILD}::test_trainer_device_picks_the_device"),
    effects("trainer.ray_timeline", FLOW),
    effects("trainer.ray_address", "tests/plan/test_launch.py::test_ray_address_joins_that_cluster"),
]


def table(entries: list[tuple[str, Entry]]) -> dict[str, Entry]:
    """``{key: entry}``; a key listed twice is an error (a dict literal would keep the last silently)."""
    out: dict[str, Entry] = {}
    for key, entry in entries:
        if key in out:
            raise ValueError(f"tests/config/key_effects.py lists {key} twice")
        out[key] = entry
    return out


KEY_EFFECTS: dict[str, Entry] = table(ENTRIES)
