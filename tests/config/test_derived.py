"""derive(): every derived number checked against a hand computation."""

from __future__ import annotations

import dataclasses

import pytest

from easyvlm.config.derived import RoleBatching, derive
from easyvlm.config.errors import ConfigError
from easyvlm.config.loader import load_config

# 2 nodes x 4 devices; 64 prompts x 8 samples per step; actor mini-batch 16 prompts.
ARGS = [
    "data.train_files=builtin:synthetic@train",
    "data.val_files=builtin:synthetic@val",
    "data.max_prompt_length=100",
    "data.max_response_length=28",
    "data.rollout_batch_size=64",
    "worker.rollout.n=8",
    "worker.rollout.tensor_parallel_size=2",
    "worker.rollout.val_override_config={n: 1, temperature: 0.5}",
    "worker.actor.global_batch_size=16",
    "worker.actor.micro_batch_size_per_device_for_update=4",
    "worker.actor.micro_batch_size_per_device_for_experience=8",
    "worker.actor.ppo_epochs=2",
    "worker.actor.model.model_path=builtin:tiny-qwen2.5-vl",
    "worker.reward.reward_function=r.py:f",
    "trainer.nnodes=2",
    "trainer.n_gpus_per_node=4",
    "trainer.total_epochs=3",
    "trainer.project_name=proj",
    "trainer.experiment_name=exp",
]


def test_grpo_values():
    d = derive(load_config(ARGS))
    assert d.world_size == 8  # 2 nodes x 4
    assert d.data_parallel_size == 8  # ulysses_size 1
    assert d.prompts_per_generation_round == 64  # no mini_rollout_batch_size
    assert d.rollout_max_model_len == 128  # 100 + 28
    assert d.actor == RoleBatching(
        mini_batch_per_device=16,  # 16 prompts x 8 = 128 samples / 8 devices
        optimizer_steps_per_step=8,  # 64 / 16 = 4 mini-batches x 2 epochs
    )
    assert d.critic is None and not d.use_critic
    assert (d.use_reference, d.kl_in_reward, d.kl_in_loss) == (True, True, False)
    assert d.save_checkpoint_path == "checkpoints/proj/exp"


def test_total_steps():
    d = derive(load_config(ARGS))
    assert d.steps_per_epoch(1000) == 15  # 1000 // 64, the partial batch dropped
    assert d.total_steps(1000) == 45  # 3 epochs x 15
    assert d.total_steps(64) == 3
    with pytest.raises(ConfigError) as info:
        d.total_steps(63)
    assert info.value.problems[0].key == "data.rollout_batch_size"
    assert "63 prompts" in str(info.value)
    assert derive(load_config(ARGS + ["trainer.max_steps=7"])).total_steps(1000) == 7  # max_steps wins


def test_gae_critic_ulysses_and_overrides():
    cfg = load_config(
        ARGS
        + [
            "algorithm.adv_estimator=gae",
            "algorithm.use_kl_loss=true",
            "worker.critic.model.model_path=builtin:tiny-qwen2.5-vl",
            "worker.critic.global_batch_size=32",
            "worker.critic.micro_batch_size_per_device_for_update=8",
            "worker.critic.micro_batch_size_per_device_for_experience=16",
            "worker.actor.ulysses_size=2",
            "worker.actor.max_token_len_per_device=3000",
            "worker.actor.model.tokenizer_path=./tok",
            "data.mini_rollout_batch_size=32",
            "trainer.save_checkpoint_path=/ckpt/run",
        ]
    )
    d = derive(cfg)
    assert d.data_parallel_size == 4  # 8 devices / ulysses 2
    assert d.actor.mini_batch_per_device == 32  # 128 samples / 4 ranks
    assert d.critic == RoleBatching(
        mini_batch_per_device=32,  # 32 prompts x 8 = 256 samples / 8 devices
        optimizer_steps_per_step=2,  # 64 / 32 = 2 mini-batches, ppo_epochs 1
    )
    assert (d.use_critic, d.kl_in_reward, d.kl_in_loss) == (True, False, True)
    assert d.prompts_per_generation_round == 32
    assert d.rollout_max_model_len == 128
    assert d.save_checkpoint_path == "/ckpt/run"


def test_disable_kl_means_no_reference():
    d = derive(load_config(ARGS + ["algorithm.disable_kl=true"]))
    assert (d.use_reference, d.kl_in_reward, d.kl_in_loss) == (False, False, False)
    # EasyR1's dapo/gspo/sapo recipes set both: disable_kl wins, so no KL loss either
    d = derive(load_config(ARGS + ["algorithm.disable_kl=true", "algorithm.use_kl_loss=true"]))
    assert (d.use_reference, d.kl_in_reward, d.kl_in_loss) == (False, False, False)


def test_derive_validates_and_never_writes_to_the_config():
    cfg = load_config(ARGS)
    before = dataclasses.asdict(cfg)
    derive(cfg)
    assert dataclasses.asdict(cfg) == before
    with pytest.raises(ConfigError, match="data.rollout_batch_size"):
        derive(load_config(ARGS + ["data.rollout_batch_size=60"]))
