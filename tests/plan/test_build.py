"""build_plan (easyvlm/plan/build.py): every config key that a role receives lands in the right
field of its spec, and what the builder decides itself (KL mode, LoRA's comma form, validation
sampling, the checks that need the model or the device, device notices, which roles exist).

Plans are cheap (no worker is built; the tiny model's config and tokenizer load in a fraction of a
second after the first), so each group of PLUMBING builds one plan with all its overrides and one
with its context alone, and checks every row against both: the override's value arrives, and the
default plan holds something else there (else the row would show nothing).
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest
from plan_testing import REPO, config_for, plan_for

from easyvlm.algorithms.settings import KLSettings
from easyvlm.config.errors import ConfigError
from easyvlm.plan.build import pick_device
from easyvlm.models.specs import LoraSpec
from easyvlm.rewards.loader import RewardFunctionSpec

GAE = ("algorithm.adv_estimator=gae",)
SYNTHETIC = f"{REPO / 'reward_functions' / 'synthetic.py'}:compute_score"
MATH = f"{REPO / 'reward_functions' / 'math.py'}:compute_score"

# The plan builder's test run (tests/plan_testing.py): 1 rank, n = 1, 24 prompts per step, actor and
# critic mini-batches of 4 prompts, micro-batches of 2 (critic: 1 for the update), lr 1e-3, no
# dynamic batching, no gradient checkpointing, torch.compile off, the hf rollout.

# Values that differ from every default, for the FSDP and offload sections of each role.
FSDP_VALUES = {
    "enable_full_shard": ("false", False),
    "enable_cpu_offload": ("true", True),
    "enable_rank0_init": ("false", False),
    "use_orig_params": ("true", True),
    "torch_dtype": ("bf16", "bf16"),
    "fsdp_size": ("1", 1),  # divides the 1 rank
    "mp_param_dtype": ("fp32", "fp32"),
    "mp_reduce_dtype": ("bf16", "bf16"),
    "mp_buffer_dtype": ("bf16", "bf16"),
}
OFFLOAD_VALUES = {"offload_params": ("true", True), "offload_optimizer": ("true", True)}
OPTIM_VALUES = {
    "lr": ("2e-3", 2e-3),
    "betas": ("[0.8,0.9]", (0.8, 0.9)),
    "weight_decay": ("0.1", 0.1),
    "strategy": ("adamw_bf16", "adamw_bf16"),
    "lr_warmup_ratio": ("0.1", 0.1),
    "lr_warmup_steps": ("3", 3),
    "min_lr_ratio": ("0.1", 0.1),
    "lr_scheduler_type": ("cosine", "cosine"),
}


def sections(role: str, spec: str) -> list[tuple[str, str, str, object]]:
    """Rows for the fsdp, offload (and, for trained roles, optim) keys of ``worker.<role>``, found in
    the plan at ``<spec>.fsdp``, ``<spec>.offload`` and ``<spec>.update.optim``."""
    rows = [(f"worker.{role}.fsdp.{k}", v, f"{spec}.fsdp.{k}", e) for k, (v, e) in FSDP_VALUES.items()]
    # the reference model has no optimizer to offload (the config check refuses the key)
    offload = {k: v for k, v in OFFLOAD_VALUES.items() if role != "ref" or k != "offload_optimizer"}
    rows += [(f"worker.{role}.offload.{k}", v, f"{spec}.offload.{k}", e) for k, (v, e) in offload.items()]
    if role != "ref":
        rows += [(f"worker.{role}.optim.{k}", v, f"{spec}.update.optim.{k}", e) for k, (v, e) in OPTIM_VALUES.items()]
    return rows


# group -> (context overrides, device, rows of (key, override value, attribute path in the RunPlan, expected))
PLUMBING: dict[str, tuple[tuple[str, ...], str, list[tuple[str, str, str, object]]]] = {
    "actor update": ((), "cpu", [
        ("worker.actor.global_batch_size", "8", "actor.update.mini_batch_per_rank", 8),  # 8 prompts x n 1 / 1 rank
        ("worker.actor.ppo_epochs", "2", "actor.update.settings.ppo_epochs", 2),
        ("worker.actor.micro_batch_size_per_device_for_update", "4", "actor.update.micro.micro_batch_size", 4),
        ("worker.actor.micro_batch_size_per_device_for_experience", "3", "actor.forward.experience.micro_batch_size", 3),
        ("worker.actor.dynamic_batching", "true", "actor.update.micro.dynamic", True),
        ("worker.actor.max_token_len_per_device", "1000", "actor.update.micro.max_token_len", 1000),
        ("worker.actor.max_grad_norm", "0.5", "actor.update.settings.max_grad_norm", 0.5),
        ("worker.actor.loss_avg_mode", "seq-mean-token-sum-norm", "actor.policy_loss.settings.loss_avg_mode",
         "seq-mean-token-sum-norm"),  # the update's normaliser follows the policy loss's mode
        ("data.max_response_length", "48", "actor.update.norm_length", 48),
    ]),
    "vision cache": (("worker.actor.model.freeze_vision_tower=true", "algorithm.use_kl_loss=true"), "cpu", [
        ("worker.actor.vision_cache_mb", "64", "actor.forward.vision_cache_mb", 64),
        ("worker.actor.vision_cache_mb", "64", "ref.forward.vision_cache_mb", 64),
    ]),
    "actor loss": (("algorithm.use_kl_loss=true",), "cpu", [
        ("worker.actor.loss_type", "sapo", "actor.policy_loss.settings.loss_type", "sapo"),
        ("worker.actor.clip_ratio_low", "0.1", "actor.policy_loss.settings.clip_ratio_low", 0.1),
        ("worker.actor.clip_ratio_high", "0.4", "actor.policy_loss.settings.clip_ratio_high", 0.4),
        ("worker.actor.clip_ratio_dual", "4.0", "actor.policy_loss.settings.clip_ratio_dual", 4.0),
        ("worker.actor.tau_positive", "0.9", "actor.policy_loss.settings.tau_positive", 0.9),
        ("worker.actor.tau_negative", "1.2", "actor.policy_loss.settings.tau_negative", 1.2),
        ("worker.actor.loss_avg_mode", "seq", "actor.policy_loss.settings.loss_avg_mode", "seq"),
        ("worker.actor.entropy_coeff", "0.01", "actor.entropy.entropy_coeff", 0.01),
        ("algorithm.kl_penalty", "low_var_kl", "actor.kl_loss.kl_penalty", "low_var_kl"),
        ("algorithm.kl_coef", "0.05", "actor.kl_loss.kl_coef", 0.05),
        ("trainer.seed", "7", "actor.seed", 7),
        ("worker.actor.top_entropy_quantile", "0.2", "actor.policy_loss.settings.top_entropy_quantile", 0.2),
        ("worker.actor.off_policy_mask_threshold", "0.5", "actor.policy_loss.settings.off_policy_mask_threshold", 0.5),
        ("algorithm.use_bias_correction_kl", "true", "actor.kl_loss.use_bias_correction_kl", True),
    ]),
    "actor loss clip_cov": (("worker.actor.loss_type=clip_cov",), "cpu", [
        ("worker.actor.clip_cov_ratio", "0.01", "actor.policy_loss.settings.clip_cov_ratio", 0.01),
        ("worker.actor.clip_cov_lb", "0.5", "actor.policy_loss.settings.clip_cov_lb", 0.5),
        ("worker.actor.clip_cov_ub", "4.0", "actor.policy_loss.settings.clip_cov_ub", 4.0),
    ]),
    "actor loss kl_cov": (("worker.actor.loss_type=kl_cov",), "cpu", [
        ("worker.actor.kl_cov_ratio", "0.002", "actor.policy_loss.settings.kl_cov_ratio", 0.002),
        ("worker.actor.ppo_kl_coef", "0.5", "actor.policy_loss.settings.ppo_kl_coef", 0.5),
    ]),
    "actor and ref forward": ((), "cpu", [
        ("worker.actor.padding_free", "false", "actor.forward.settings.padding_free", False),
        ("worker.actor.share_prompts", "false", "actor.forward.settings.share_prompts", False),
        ("worker.actor.use_torch_compile", "true", "actor.forward.use_torch_compile", True),
        ("worker.rollout.temperature", "0.7", "actor.forward.temperature", 0.7),
        # the reference model runs the actor's forward settings (EasyR1 has them on the actor only)
        ("worker.actor.padding_free", "false", "ref.forward.settings.padding_free", False),
        ("worker.actor.share_prompts", "false", "ref.forward.settings.share_prompts", False),
        ("worker.actor.use_torch_compile", "true", "ref.forward.use_torch_compile", True),
        ("worker.actor.micro_batch_size_per_device_for_experience", "3", "ref.forward.experience.micro_batch_size", 3),
    ]),
    "ulysses": (("trainer.n_gpus_per_node=2",), "cpu", [
        # 4 heads, 2 key/value heads: divisible
        ("worker.actor.ulysses_size", "2", "actor.forward.settings.ulysses_size", 2),
        ("worker.actor.ulysses_size", "2", "ref.forward.settings.ulysses_size", 2),
    ]),
    "actor model": ((), "cpu", [
        ("worker.actor.model.enable_gradient_checkpointing", "true", "actor.model.gradient_checkpointing", True),
        ("worker.actor.model.freeze_vision_tower", "true", "actor.model.freeze_vision_tower", True),
        ("worker.actor.model.attn_implementation", "eager", "actor.model.attn_implementation", "eager"),
        ("worker.actor.model.trust_remote_code", "true", "actor.model.trust_remote_code", True),
        ("worker.actor.model.trust_remote_code", "true", "rollout.engine.trust_remote_code", True),
        ("worker.actor.model.override_config", "{text_config: {rms_norm_eps: 0.001}}", "actor.model.hf_config.text_config.rms_norm_eps",
         0.001),
        ("worker.actor.model.override_config", "{text_config: {rms_norm_eps: 0.001}}", "rollout.engine.hf_config_overrides",
         {"text_config": {"rms_norm_eps": 0.001}}),  # vLLM loads the directory itself and applies them
        # EasyR1's comma form becomes module names (peft matches a list by name suffix, a string as a regex)
        ("worker.actor.model.lora.rank", "4", "actor.model.lora.rank", 4),
        ("worker.actor.model.lora.alpha", "8", "actor.model.lora.alpha", 8),
        ("worker.actor.model.lora.target_modules", "q_proj,v_proj", "actor.model.lora.target_modules", ("q_proj", "v_proj")),
        ("worker.actor.model.lora.exclude_modules", ".*visual.*", "actor.model.lora.exclude_modules", ".*visual.*"),
    ]),
    "actor sections": ((), "cpu", sections("actor", "actor")),
    "ref sections": ((), "cpu", sections("ref", "ref")),
    "critic": (GAE, "cpu", [
        ("worker.critic.global_batch_size", "8", "critic.update.mini_batch_per_rank", 8),
        ("worker.critic.ppo_epochs", "2", "critic.update.settings.ppo_epochs", 2),
        ("worker.critic.micro_batch_size_per_device_for_update", "2", "critic.update.micro.micro_batch_size", 2),
        ("worker.critic.micro_batch_size_per_device_for_experience", "4", "critic.forward.experience.micro_batch_size", 4),
        ("worker.critic.dynamic_batching", "true", "critic.update.micro.dynamic", True),
        ("worker.critic.max_grad_norm", "0.5", "critic.update.settings.max_grad_norm", 0.5),
        ("worker.critic.cliprange_value", "0.2", "critic.value_loss.cliprange_value", 0.2),
        ("worker.critic.loss_avg_mode", "seq", "critic.value_loss.loss_avg_mode", "seq"),
        ("worker.critic.padding_free", "true", "critic.forward.settings.padding_free", True),
        ("worker.critic.share_prompts", "false", "critic.forward.settings.share_prompts", False),
        ("trainer.seed", "7", "critic.seed", 7),
    ]),
    "critic ulysses": ((*GAE, "trainer.n_gpus_per_node=2", "worker.critic.padding_free=true"), "cpu", [
        ("worker.critic.ulysses_size", "2", "critic.forward.settings.ulysses_size", 2),
    ]),
    "critic model": (GAE, "cpu", [
        ("worker.critic.model.override_config", "{text_config: {rms_norm_eps: 0.001}}", "critic.model.hf_config.text_config.rms_norm_eps",
         0.001),
        ("worker.critic.model.enable_gradient_checkpointing", "true", "critic.model.gradient_checkpointing", True),
        ("worker.critic.model.freeze_vision_tower", "true", "critic.model.freeze_vision_tower", True),
        ("worker.critic.model.attn_implementation", "eager", "critic.model.attn_implementation", "eager"),
        ("worker.critic.model.trust_remote_code", "true", "critic.model.trust_remote_code", True),
    ]),
    "critic sections": (GAE, "cpu", sections("critic", "critic")),
    "rollout": ((), "cpu", [
        ("worker.rollout.name", "vllm", "rollout.engine.generation.name", "vllm"),
        ("worker.rollout.n", "3", "rollout.sampling.n", 3),
        ("worker.rollout.temperature", "0.7", "rollout.sampling.temperature", 0.7),
        ("worker.rollout.top_p", "0.9", "rollout.sampling.top_p", 0.9),
        ("worker.rollout.top_k", "20", "rollout.sampling.top_k", 20),
        ("worker.rollout.ignore_eos", "true", "rollout.sampling.ignore_eos", True),
        ("data.max_response_length", "48", "rollout.sampling.max_tokens", 48),
        ("data.max_response_length", "48", "rollout.response_length", 48),
        ("worker.rollout.seed", "5", "rollout.engine.generation.seed", 5),
        ("worker.rollout.per_request_seed", "true", "rollout.per_request_seed", True),
        ("worker.rollout.limit_images", "2", "rollout.engine.generation.limit_images", 2),
        ("worker.rollout.dtype", "float16", "rollout.engine.dtype", "fp16"),  # one spelling for the engines
        ("worker.rollout.gpu_memory_utilization", "0.5", "rollout.engine.generation.gpu_memory_utilization", 0.5),
        ("worker.rollout.enforce_eager", "true", "rollout.engine.generation.enforce_eager", True),
        ("worker.rollout.enable_chunked_prefill", "true", "rollout.engine.generation.enable_chunked_prefill", True),
        ("worker.rollout.max_model_len", "400", "rollout.engine.max_model_len", 400),
        ("worker.rollout.max_num_batched_tokens", "4096", "rollout.engine.generation.max_num_batched_tokens", 4096),
        ("worker.rollout.max_num_seqs", "64", "rollout.engine.max_num_seqs", 64),
        ("worker.rollout.disable_log_stats", "false", "rollout.engine.generation.disable_log_stats", False),
        ("worker.rollout.disable_tqdm", "true", "rollout.engine.generation.disable_tqdm", True),
    ]),
    "rollout on gpus": (("trainer.n_gpus_per_node=2", "worker.rollout.name=vllm"), "cuda", [
        ("worker.rollout.tensor_parallel_size", "2", "rollout.engine.generation.tensor_parallel_size", 2),  # refused on the CPU
    ]),
    "reward": ((), "cpu", [
        ("worker.reward.reward_type", "sequential", "reward.functions[0].reward_type", "sequential"),
        ("worker.reward.reward_function_kwargs", "{format_weight: 0.5}", "reward.functions[0].reward_function_kwargs",
         {"format_weight": 0.5}),
        ("worker.reward.timeout", "10", "reward.calls.timeout", 10.0),
        ("worker.reward.on_error", "zero", "reward.calls.on_error", "zero"),
        ("worker.reward.num_workers", "2", "reward.calls.num_workers", 2),
    ]),
    "steps and sizes": ((), "cpu", [
        ("data.rollout_batch_size", "48", "driver.length.rollout_batch_size", 48),
        ("data.mini_rollout_batch_size", "12", "driver.rounds.prompts_per_round", 12),
        ("trainer.nnodes", "2", "launch.world_size", 2),
        ("trainer.total_epochs", "3", "driver.length.total_epochs", 3),
        ("trainer.max_steps", "5", "driver.length.max_steps", 5),
        ("trainer.find_last_checkpoint", "false", "driver.find_last_checkpoint", False),
    ]),
    "devices per node": ((), "cpu", [
        ("trainer.n_gpus_per_node", "2", "launch.world_size", 2),
        ("trainer.n_gpus_per_node", "2", "launch.n_gpus_per_node", 2),
    ]),
    "separate engines": (("worker.rollout.placement=separate",), "cpu", [
        ("worker.rollout.num_devices", "2", "launch.separate_rollout_devices", 2),
    ]),
    "algorithm": ((), "cpu", [
        ("algorithm.adv_estimator", "gae", "critic.value_loss.cliprange_value", 0.5),
        ("algorithm.disable_kl", "true", "driver.advantage.use_reference", False),
    ]),
    "kl loss": ((), "cpu", [("algorithm.use_kl_loss", "true", "driver.advantage.kl_in_loss", True)]),
    # the driver's adaptive entropy controller (none in the default plan: the actor keeps entropy_coeff)
    "adaptive entropy": ((), "cpu", [
        ("worker.actor.use_adaptive_entropy", "true", "driver.entropy_control.entropy_coeff_max", 0.5),
        ("worker.actor.entropy_coeff", "0.01", "driver.entropy_control.entropy_coeff", 0.01),
        ("worker.actor.entropy_target", "0.3", "driver.entropy_control.entropy_target", 0.3),
        ("worker.actor.entropy_coeff_delta", "0.002", "driver.entropy_control.entropy_coeff_delta", 0.002),
        ("worker.actor.entropy_coeff_min", "0.001", "driver.entropy_control.entropy_coeff_min", 0.001),
        ("worker.actor.entropy_coeff_max", "0.5", "driver.entropy_control.entropy_coeff_max", 0.5),
    ]),
}


def at(obj: object, path: str) -> object:
    """The value at a dotted ``path`` (``a.b[0].c``) of ``obj``; None past a None (no LoRA, no KL loss)."""
    for part in path.split("."):
        if obj is None:
            return None
        name, index = re.fullmatch(r"(\w+)(?:\[(\d+)\])?", part).groups()
        obj = getattr(obj, name)
        if index is not None:
            obj = obj[int(index)]
    return obj


@pytest.mark.parametrize("group", list(PLUMBING))
def test_keys_reach_their_spec_fields(tiny_model_path, tmp_path, group):
    context, device, rows = PLUMBING[group]
    context = (*context, f"trainer.save_checkpoint_path={tmp_path}")
    default = plan_for(tiny_model_path, *context, device=device)
    plan = plan_for(tiny_model_path, *context, *dict.fromkeys(f"{key}={value}" for key, value, _, _ in rows), device=device)
    for key, _, path, expected in rows:
        assert at(plan, path) == expected, f"{key}: {path} is {at(plan, path)!r}"
        assert at(default, path) != expected, f"{key}: the default plan already has {expected!r} at {path}"


def test_the_key_table_credits_this_test_only_with_keys_it_checks(monkeypatch):
    """tests/config/key_effects.py names test_keys_reach_their_spec_fields for a key only if a
    PLUMBING row checks that key (its coverage test can only see that the key's name occurs here)."""
    spec = importlib.util.spec_from_file_location("key_effects_for_plan", REPO / "tests" / "config" / "key_effects.py")
    table = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, table)  # its dataclasses look their module up there
    spec.loader.exec_module(table)
    checked = {key for _, _, rows in PLUMBING.values() for key, *_ in rows}
    credited = {key for key, entry in table.KEY_EFFECTS.items() if isinstance(entry, table.Effects) and table.PLAN in entry.tests}
    assert sorted(credited - checked) == []


def copy_of(model_dir: str, to: Path, weights: bool = True) -> Path:
    """Another directory holding the model's files (``weights=False``: tokenizer, processor, configs)."""
    to.mkdir()
    for file in Path(model_dir).iterdir():
        if weights or file.suffix != ".safetensors":
            shutil.copy(file, to / file.name)
    return to


def test_model_paths_choose_the_files(tiny_model_path, tmp_path):
    other = copy_of(tiny_model_path, tmp_path / "other")
    plan = plan_for(str(other), *GAE, f"worker.critic.model.model_path={tiny_model_path}")
    # the policy, the reference model and the engine read worker.actor.model.model_path; the critic its own
    assert plan.bundle.policy.model_dir == plan.ref.model.model_dir == plan.rollout.engine.model_dir == str(other)
    assert plan.bundle.tokenizer.name_or_path == str(other)
    assert plan.critic.model.model_dir == tiny_model_path
    # tokenizer_path: the tokenizer and processor from there, the weights still from model_path
    tokenizer_dir = copy_of(tiny_model_path, tmp_path / "tokenizer", weights=False)
    plan = plan_for(tiny_model_path, f"worker.actor.model.tokenizer_path={tokenizer_dir}")
    assert plan.bundle.tokenizer.name_or_path == str(tokenizer_dir)
    assert plan.bundle.policy.model_dir == tiny_model_path
    # the engine's processor comes from there too (vLLM: LLM(tokenizer=...)), its weights from model_path
    assert (plan.rollout.engine.tokenizer_dir, plan.rollout.engine.model_dir) == (str(tokenizer_dir), tiny_model_path)


def test_reward_functions_list(tiny_model_path):
    plan = plan_for(tiny_model_path, "worker.reward.reward_function=null", "worker.reward.reward_type=sequential",
                    f"worker.reward.reward_functions=[{{reward_function: {SYNTHETIC}, weight: 0.5}}, "
                    f"{{reward_function: {MATH}, weight: 2, reward_function_kwargs: {{format_weight: 0.2}}}}]")
    assert plan.reward.functions == (
        RewardFunctionSpec(SYNTHETIC, {}, 0.5, "sequential"),
        RewardFunctionSpec(MATH, {"format_weight": 0.2}, 2.0, "sequential"),
    )
    assert plan_for(tiny_model_path).reward.functions == (RewardFunctionSpec(SYNTHETIC, {}, 1.0, None),)


# ------------------------------------------------------------------------------ what build_plan decides
def test_disable_kl_wins_over_the_kl_loss(tiny_model_path):
    plan = plan_for(tiny_model_path, "algorithm.use_kl_loss=true", "algorithm.disable_kl=true")
    assert plan.actor.kl_loss is None and plan.ref is None
    assert any("algorithm.disable_kl=true turns the KL penalty off" in line for line in plan.notices)
    # the KL as a loss term: the actor's loss is bound to it, the reference model exists
    plan = plan_for(tiny_model_path, "algorithm.use_kl_loss=true", "algorithm.kl_coef=0.05")
    assert plan.actor.kl_loss == KLSettings(use_kl_loss=True, kl_coef=0.05) and plan.ref is not None
    assert not any("disable_kl" in line for line in plan.notices)
    # the KL in the reward (the default): no loss term, the reference model exists
    plan = plan_for(tiny_model_path)
    assert plan.actor.kl_loss is None and plan.ref is not None


def test_reference_model_is_the_policy_without_its_adapters(tiny_model_path):
    plan = plan_for(tiny_model_path, "worker.actor.model.lora.rank=4", "worker.actor.model.enable_gradient_checkpointing=true",
                    "worker.actor.model.freeze_vision_tower=true")
    assert plan.actor.model.lora == LoraSpec(4, 64, "all-linear", None)  # a string stays a string (peft: regex)
    assert plan.ref.model.lora is None
    assert (plan.ref.model.gradient_checkpointing, plan.ref.model.freeze_vision_tower) == (False, False)
    assert plan.ref.model.model_dir == plan.actor.model.model_dir


def test_critic_only_for_gae(tiny_model_path):
    assert plan_for(tiny_model_path).critic is None
    plan = plan_for(tiny_model_path, *GAE, "worker.actor.model.lora.rank=4")
    # the value model starts from the policy's files, without the actor's adapters
    assert plan.critic is not None and plan.critic.model.lora is None
    assert plan.critic.model.model_dir == plan.actor.model.model_dir
    assert plan.critic.update.mini_batch_per_rank == 4  # critic.global_batch_size 4 x n 1 / 1 rank


def test_validation_sampling_is_training_sampling_with_the_overrides(tiny_model_path):
    plan = plan_for(tiny_model_path, "worker.rollout.name=vllm", "worker.rollout.n=4", "worker.rollout.top_p=0.9",
                    "worker.rollout.val_override_config={n: 1, temperature: 0.6, repetition_penalty: 1.1, seed: 3}")
    train, val = plan.rollout.sampling, plan.rollout.val_sampling
    assert (train.n, train.temperature, train.top_p, train.extra) == (4, 1.0, 0.9, ())
    # Sampling's own fields replaced, what vLLM alone knows goes to extra (sorted by name); the rest kept
    assert (val.n, val.temperature, val.top_p, val.top_k, val.max_tokens) == (1, 0.6, 0.9, -1, 32)
    assert val.extra == (("repetition_penalty", 1.1), ("seed", 3))
    assert plan_for(tiny_model_path).rollout.val_sampling == plan_for(tiny_model_path).rollout.sampling


def test_checks_that_need_the_device_or_the_model(tiny_model_path):
    with pytest.raises(ConfigError) as err:
        plan_for(tiny_model_path, "worker.rollout.name=vllm", "worker.rollout.tensor_parallel_size=2", "trainer.n_gpus_per_node=2")
    assert [p.key for p in err.value.problems] == ["worker.rollout.tensor_parallel_size"]
    assert "on the CPU" in err.value.problems[0].message
    # the tiny model has 4 attention heads and 2 key/value heads: 4 ranks cannot split the 2
    with pytest.raises(ConfigError) as err:
        plan_for(tiny_model_path, "worker.actor.ulysses_size=4", "trainer.n_gpus_per_node=4")
    [problem] = err.value.problems
    assert problem.key == "worker.actor.ulysses_size"
    assert "(4) must divide the model's 2 key/value heads" in problem.message
    with pytest.raises(ConfigError) as err:
        plan_for(tiny_model_path, *GAE, "worker.critic.ulysses_size=4", "worker.critic.padding_free=true", "trainer.n_gpus_per_node=4",
                 "worker.actor.micro_batch_size_per_device_for_update=1")  # 4 samples over 4 ranks
    assert [p.key for p in err.value.problems] == ["worker.critic.ulysses_size"]
    # vLLM on the CPU: its KV cache must hold one sequence of max_model_len within gpu_memory_utilization of
    # the free memory; the tiny model keeps 1 KiB per token (tests/rollout/test_vllm.py), so 8000 + 32 tokens
    # take 251 blocks of 32 tokens, 252 with vLLM's null block = 7.9 MiB, more than 1e-5 of any machine's free memory
    with pytest.raises(ConfigError) as err:
        plan_for(tiny_model_path, "worker.rollout.name=vllm", "data.max_prompt_length=8000",
                 "worker.rollout.gpu_memory_utilization=1e-5")
    [problem] = err.value.problems
    assert problem.key == "worker.rollout.gpu_memory_utilization"
    assert "less than the 8 MiB the CPU KV cache needs for one sequence of 8032 tokens" in problem.message


def test_device_notices(tiny_model_path):
    plan = plan_for(tiny_model_path, "worker.actor.offload.offload_params=true", "worker.ref.offload.offload_params=true")
    assert plan.device == "cpu"
    assert ("worker.actor.offload, worker.ref.offload: offloading moves GPU memory to the host; on the CPU it does "
            "nothing") in plan.notices
    assert any(line.startswith("on the CPU models run in float32") for line in plan.notices)  # bf16 by default
    # float32 everywhere and no offload: nothing to say; on a GPU neither notice applies
    fp32 = ("worker.rollout.dtype=fp32", "worker.actor.fsdp.mp_param_dtype=fp32", "worker.ref.fsdp.mp_param_dtype=fp32")
    assert plan_for(tiny_model_path, *fp32).notices == ()
    gpu = plan_for(tiny_model_path, "worker.actor.offload.offload_params=true", device="cuda")
    assert gpu.device == "cuda" and gpu.notices == ()


def test_r3_on_the_cpus_vllm_says_the_prefix_cache_is_off(tiny_model_path):
    from easyvlm.plan.build import device_notices

    notice = ("worker.actor.router_replay=R3 with vLLM on the CPU: the engine records each token's experts with "
              "vLLM's prefix cache off, so each of a prompt's n samples prefills the whole prompt")
    fp32 = ("worker.rollout.dtype=fp32", "worker.actor.fsdp.mp_param_dtype=fp32", "worker.ref.fsdp.mp_param_dtype=fp32")
    r3 = config_for(tiny_model_path, *fp32, "worker.actor.router_replay=R3", "worker.rollout.name=vllm")
    assert device_notices(r3, "cpu") == [notice]
    assert device_notices(r3, "cuda") == []  # vLLM's own capture keeps the cached blocks' routing
    assert device_notices(config_for(tiny_model_path, *fp32, "worker.actor.router_replay=R3"), "cpu") == []  # hf


@pytest.mark.parametrize(("device", "cuda_available", "expected"),
                         [("cpu", True, "cpu"), ("cuda", False, "cuda"), ("auto", True, "cuda"), ("auto", False, "cpu")])
def test_trainer_device_picks_the_device(tiny_model_path, monkeypatch, device, cuda_available, expected):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_available)
    assert pick_device(config_for(tiny_model_path, f"trainer.device={device}")) == expected


def test_local_paths_become_absolute(tiny_model_path, tmp_path, monkeypatch):
    """Ray workers do not share the driver's working directory: paths that exist are made absolute."""
    monkeypatch.chdir(tmp_path)
    for name in ("images", "ckpt"):
        (tmp_path / name).mkdir()
    for name in ("f.jinja", "t.jinja"):
        (tmp_path / name).write_text("{{ content }}")
    plan = plan_for(tiny_model_path, "data.image_dir=images", "data.format_prompt=f.jinja", "data.override_chat_template=t.jinja",
                    "trainer.load_checkpoint_path=ckpt", "trainer.ray_timeline=timeline.json",
                    "trainer.save_checkpoint_path=out", "trainer.project_name=p", "trainer.experiment_name=e")
    d, driver = plan.data, plan.driver
    assert (d.image_dir, d.format_prompt, d.override_chat_template) == tuple(
        str(tmp_path / n) for n in ("images", "f.jinja", "t.jinja"))
    assert (driver.load_checkpoint_path, driver.records.ray_timeline) == (str(tmp_path / "ckpt"), str(tmp_path / "timeline.json"))
    assert driver.records.run_dir == str(tmp_path / "out")
    # without save_checkpoint_path: checkpoints/<project_name>/<experiment_name> under the working directory
    plan = plan_for(tiny_model_path, "trainer.project_name=p", "trainer.experiment_name=e")
    assert plan.driver.records.run_dir == str(tmp_path / "checkpoints" / "p" / "e")


def test_workers_on_other_nodes_get_names_and_file_texts(tiny_model_path, tmp_path):
    """What a worker on a node without the driver's files needs: the model's name (each node resolves
    it: docs/cluster.md) beside the driver's directory, and the text of the files it runs."""
    loss = tmp_path / "my_loss.py"
    loss.write_text("from easyvlm.algorithms.policy_losses import get_policy_loss\n"
                    "def ppo(inputs):\n    return get_policy_loss('default')(inputs)\n")
    tokenizer_dir = copy_of(tiny_model_path, tmp_path / "tokenizer", weights=False)
    plan = plan_for("builtin:tiny-qwen2.5-vl", f"worker.actor.loss_type={loss}:ppo",
                    f"worker.actor.model.tokenizer_path={tokenizer_dir}")
    assert plan.actor.model.model_dir == tiny_model_path  # resolved here, in the driver's cache
    for spec in (plan.actor.model, plan.ref.model, plan.rollout.engine):
        assert spec.model_path == "builtin:tiny-qwen2.5-vl"
    assert plan.rollout.engine.tokenizer_path == str(tokenizer_dir)
    assert plan.actor.policy_loss.source == loss.read_text()
    assert plan.reward.functions[0].source == Path(SYNTHETIC.partition(":")[0]).read_text()
    # a worker where the driver's directory exists reads it as is
    from easyvlm.models.paths import local_model_dir

    assert local_model_dir(plan.actor.model.model_dir, plan.actor.model.model_path) == tiny_model_path
    engine = plan.rollout.engine
    assert local_model_dir(engine.tokenizer_dir, engine.tokenizer_path) == str(tokenizer_dir)


def test_dynamic_batching_budget_defaults_to_easyr1s_padded_rows(tiny_model_path):
    """EasyR1's actor and critic cut micro-batches at micro_batch_size x input_ids.size(-1), its
    prompts left-padded to data.max_prompt_length and responses to max_response_length. Prompts 100,
    responses 28: a row of 128; update micro 4 -> 512 tokens, experience micro 3 -> 384 (not the
    width of a batch's longest prompt, which easyvlm pads to). A set max_token_len_per_device wins;
    without dynamic batching there is no budget."""
    common = ("data.max_prompt_length=100", "data.max_response_length=28", "algorithm.adv_estimator=gae",
              "worker.actor.micro_batch_size_per_device_for_update=4",
              "worker.actor.micro_batch_size_per_device_for_experience=3",
              "worker.critic.micro_batch_size_per_device_for_update=2", "worker.actor.dynamic_batching=true",
              "worker.critic.dynamic_batching=true")
    plan = plan_for(tiny_model_path, *common)
    assert plan.actor.update.micro.max_token_len == 4 * 128
    assert plan.actor.forward.experience.max_token_len == 3 * 128
    assert plan.critic.update.micro.max_token_len == 2 * 128
    assert plan_for(tiny_model_path, *common, "worker.actor.max_token_len_per_device=1000").actor.update.micro.max_token_len == 1000
    fixed = plan_for(tiny_model_path, *common, "worker.actor.dynamic_batching=false").actor.update.micro
    assert fixed.dynamic is False and fixed.max_token_len is None


def test_device_auto_planned_without_a_gpu_can_be_planned_again_for_a_gpu_cluster(tiny_model_path, tmp_path):
    """trainer.device=auto on a machine without a GPU: the plan is the CPU's, and it carries the way to
    the same run's plan for cuda (taken when the cluster joined through trainer.ray_address has GPUs);
    a device the user named is never planned again."""
    from easyvlm.plan.build import build_plan

    auto = build_plan(config_for(tiny_model_path, "trainer.device=auto", f"trainer.save_checkpoint_path={tmp_path}"), "cpu")
    assert auto.device == "cpu" and auto.for_cuda is not None
    on_gpus = auto.for_cuda()
    assert on_gpus.device == "cuda" and on_gpus.for_cuda is None
    assert on_gpus.driver.records.run_dir == auto.driver.records.run_dir == str(tmp_path)
    named = build_plan(config_for(tiny_model_path, "trainer.device=cpu", f"trainer.save_checkpoint_path={tmp_path}"), "cpu")
    assert named.for_cuda is None
