"""The schema: EasyR1's defaults, the documented differences, a docstring for every field."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from easyvlm.config.introspect import all_keys, field_docs, type_at
from easyvlm.config.names import canonical_dtype
from easyvlm.config.schema import PPOConfig

REPO = Path(__file__).resolve().parents[2]

# Hand-copied from /work/shared/EASYR1_COMPAT.md ("Config fields"), which lists EasyR1's defaults.
EASYR1_DEFAULTS = {
    "data.train_files": "",
    "data.prompt_key": "prompt",
    "data.answer_key": "answer",
    "data.image_key": "images",
    "data.video_key": "videos",
    "data.image_dir": None,
    "data.video_fps": 2.0,
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    "data.rollout_batch_size": 512,
    "data.mini_rollout_batch_size": None,
    "data.val_batch_size": -1,
    "data.shuffle": True,
    "data.seed": 1,
    "data.min_pixels": 262144,
    "data.max_pixels": 4194304,
    "data.filter_overlong_prompts": True,
    "data.filter_overlong_prompts_workers": 16,
    "algorithm.gamma": 1.0,
    "algorithm.lam": 1.0,
    "algorithm.adv_estimator": "grpo",
    "algorithm.disable_kl": False,
    "algorithm.use_kl_loss": False,
    "algorithm.kl_penalty": "kl",
    "algorithm.kl_coef": 1e-3,
    "algorithm.kl_type": "fixed",
    "algorithm.kl_horizon": 10000,
    "algorithm.kl_target": 0.1,
    "algorithm.online_filtering": False,
    "algorithm.filter_key": "overall",
    "algorithm.filter_low": 0.01,
    "algorithm.filter_high": 0.99,
    "worker.actor.strategy": "fsdp",
    "worker.actor.global_batch_size": 256,
    "worker.actor.micro_batch_size_per_device_for_update": 4,
    "worker.actor.micro_batch_size_per_device_for_experience": 16,
    "worker.actor.max_grad_norm": 1.0,
    "worker.actor.clip_ratio_low": 0.2,
    "worker.actor.clip_ratio_high": 0.3,
    "worker.actor.clip_ratio_dual": 3.0,
    "worker.actor.loss_avg_mode": "token",
    "worker.actor.loss_type": "default",
    "worker.actor.ppo_epochs": 1,
    "worker.actor.padding_free": True,
    "worker.actor.dynamic_batching": True,
    "worker.actor.ulysses_size": 1,
    "worker.actor.use_torch_compile": True,
    "worker.actor.model.model_path": None,
    "worker.actor.model.tokenizer_path": None,
    "worker.actor.model.override_config": {},
    "worker.actor.model.enable_gradient_checkpointing": True,
    "worker.actor.model.freeze_vision_tower": False,
    "worker.actor.model.lora.rank": 0,
    "worker.actor.model.lora.alpha": 64,
    "worker.actor.model.lora.target_modules": "all-linear",
    "worker.actor.model.lora.exclude_modules": None,
    "worker.actor.optim.lr": 1e-6,
    "worker.actor.optim.betas": (0.9, 0.999),
    "worker.actor.optim.weight_decay": 1e-2,
    "worker.actor.optim.strategy": "adamw",
    "worker.actor.optim.lr_warmup_ratio": 0,
    "worker.actor.optim.lr_warmup_steps": None,
    "worker.actor.optim.min_lr_ratio": None,
    "worker.actor.optim.lr_scheduler_type": "constant",
    "worker.actor.fsdp.enable_full_shard": True,
    "worker.actor.fsdp.enable_cpu_offload": False,
    "worker.actor.fsdp.enable_rank0_init": True,
    "worker.actor.fsdp.use_orig_params": False,
    "worker.actor.fsdp.torch_dtype": None,
    "worker.actor.fsdp.fsdp_size": -1,
    "worker.actor.fsdp.mp_param_dtype": "bf16",
    "worker.actor.fsdp.mp_reduce_dtype": "fp32",
    "worker.actor.fsdp.mp_buffer_dtype": "fp32",
    "worker.actor.offload.offload_params": False,
    "worker.actor.offload.offload_optimizer": False,
    "worker.critic.cliprange_value": 0.5,
    "worker.critic.global_batch_size": 256,
    "worker.ref.strategy": "fsdp",
    "worker.reward.reward_function": None,
    "worker.reward.reward_function_kwargs": {},
    "worker.reward.skip_special_tokens": True,
    "worker.reward.num_cpus": 1,
    "worker.rollout.name": "vllm",
    "worker.rollout.n": 1,
    "worker.rollout.temperature": 1.0,
    "worker.rollout.top_p": 1.0,
    "worker.rollout.top_k": -1,
    "worker.rollout.seed": 1,
    "worker.rollout.limit_images": 0,
    "worker.rollout.dtype": "bf16",
    "worker.rollout.gpu_memory_utilization": 0.6,
    "worker.rollout.ignore_eos": False,
    "worker.rollout.enforce_eager": False,
    "worker.rollout.enable_chunked_prefill": False,
    "worker.rollout.max_model_len": None,
    "worker.rollout.max_num_batched_tokens": 8192,
    "worker.rollout.disable_log_stats": True,
    "worker.rollout.disable_tqdm": False,
    "worker.rollout.val_override_config": {},
    "trainer.total_epochs": 15,
    "trainer.max_steps": None,
    "trainer.experiment_name": "demo",
    "trainer.nnodes": 1,
    "trainer.n_gpus_per_node": 8,
    "trainer.max_try_make_batch": 20,
    "trainer.critic_warmup": 0,
    "trainer.val_freq": -1,
    "trainer.val_before_train": True,
    "trainer.val_only": False,
    "trainer.val_generations_to_log": 0,
    "trainer.rollout_log_freq": -1,
    "trainer.save_freq": -1,
    "trainer.save_limit": -1,
    "trainer.save_model_only": False,
    "trainer.save_checkpoint_path": None,
    "trainer.load_checkpoint_path": None,
    "trainer.find_last_checkpoint": True,
}

# Deliberate differences: key -> (EasyR1's default, easyvlm's default). Each docstring says why.
DIFFERENCES = {
    "worker.actor.model.trust_remote_code": (True, False),
    "worker.critic.model.trust_remote_code": (True, False),
    "worker.rollout.tensor_parallel_size": (2, 1),
    "worker.reward.reward_type": ("batch", None),
    "trainer.project_name": ("easy_r1", "easyvlm"),
    "trainer.logger": (["console", "wandb"], ["console", "file", "tensorboard"]),
}


def get(obj, key: str):
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("key", sorted(EASYR1_DEFAULTS))
def test_default_matches_easyr1(key):
    assert get(PPOConfig(), key) == EASYR1_DEFAULTS[key]


@pytest.mark.parametrize("key", sorted(DIFFERENCES))
def test_documented_difference_from_easyr1(key):
    easyr1, ours = DIFFERENCES[key]
    assert get(PPOConfig(), key) == ours != easyr1
    parent, _, name = key.rpartition(".")
    assert "differs from EasyR1" in field_docs(type(get(PPOConfig(), parent)))[name]


def test_no_other_docstring_claims_a_difference():
    # A new "differs from EasyR1" docstring must come with an entry in DIFFERENCES (and a check).
    claimed = set()
    for key in all_keys(PPOConfig):
        parent, _, name = key.rpartition(".")
        cls = type_at(PPOConfig, parent) if parent else PPOConfig
        if "differs from EasyR1" in field_docs(cls).get(name, ""):
            claimed.add(key)
    assert claimed == set(DIFFERENCES)


def test_every_field_has_a_docstring():
    missing = []
    for key in all_keys(PPOConfig):
        parent, _, name = key.rpartition(".")
        cls = type_at(PPOConfig, parent) if parent else PPOConfig
        if not field_docs(cls).get(name):
            missing.append(key)
    assert missing == []


def test_sections_have_the_contract_names():
    # The names other modules code against (TEAM_BRIEF "Contracts").
    cfg = PPOConfig()
    for key in ("data", "algorithm", "worker.actor.model.lora", "worker.actor.optim", "worker.actor.fsdp",
                "worker.actor.offload", "worker.critic", "worker.ref", "worker.reward", "worker.rollout", "trainer"):
        assert dataclasses.is_dataclass(get(cfg, key)), key


def test_config_is_frozen():
    cfg = PPOConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.worker.rollout.n = 8  # type: ignore[misc]


def test_canonical_dtype():
    assert [canonical_dtype(n) for n in ("bfloat16", "bf16", "float32", "fp16")] == ["bf16", "bf16", "fp32", "fp16"]
    with pytest.raises(ValueError, match="known"):
        canonical_dtype("int8")


def test_config_package_imports_neither_torch_nor_vllm():
    # the config check runs before anything heavy: it and the components' settings modules it
    # composes stay torch-free (the packages' __init__ modules included), and so does the CLI's
    # parse-and-validate path on a real config
    code = (
        "import sys, easyvlm.config, easyvlm.config.cli, easyvlm.config.reference, easyvlm.config.validate; "
        "import easyvlm.algorithms.settings, easyvlm.algorithms.rollout_correction_settings, "
        "easyvlm.workers.settings, easyvlm.data.settings, easyvlm.agents.settings, easyvlm.utils.dtypes; "
        "cfg = easyvlm.config.cli.parse_and_validate(['config=examples/config.yaml']); "
        "cfg.worker.actor.policy_loss, cfg.algorithm.kl; "
        "bad = [m for m in ('torch', 'vllm', 'transformers', 'ray') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
