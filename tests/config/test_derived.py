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
    assert d.prompts_per_generation_round == 64  # no mini_rollout_batch_size
    assert d.rollout_max_model_len == 128  # 100 + 28
    assert d.actor == RoleBatching(
        mini_batch_per_device=16,  # 16 prompts x 8 = 128 samples / 8 devices
        optimizer_steps_per_step=8,  # 64 / 16 = 4 mini-batches x 2 epochs
    )
    assert d.critic is None and not d.use_critic
    assert (d.use_reference, d.kl_in_reward, d.kl_in_loss) == (True, True, False)
    assert d.save_checkpoint_path == "checkpoints/proj/exp"


def run_length(args):
    from easyvlm.plan.driver import driver_spec

    cfg = load_config(args)
    return driver_spec(cfg, derive(cfg)).length


def test_total_steps():
    d = run_length(ARGS)
    assert d.steps_per_epoch(1000) == 15  # 1000 // 64, the partial batch dropped
    assert d.total_steps(1000) == 45  # 3 epochs x 15
    assert d.total_steps(64) == 3
    with pytest.raises(ConfigError) as info:
        d.total_steps(63)
    assert info.value.problems[0].key == "data.rollout_batch_size"
    assert "63 prompts" in str(info.value)
    assert run_length(ARGS + ["trainer.max_steps=7"]).total_steps(1000) == 7  # max_steps wins


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


def test_engine_sequences_follow_the_work():
    """worker.rollout.max_num_seqs unset: the most sequences one generation call gives one of the 8
    engines (one per device), at most 256; set, as written."""
    # ARGS: 64 prompts x n 8 over 8 engines = 64; validation on (val_before_train, the default) with the
    # whole validation set in one call (val_batch_size -1, size unknown) counts as the cap 256
    assert derive(load_config(ARGS)).rollout_max_num_seqs == 256
    no_val = ARGS + ["trainer.val_before_train=false", "trainer.val_freq=-1"]
    assert derive(load_config(no_val)).rollout_max_num_seqs == 64
    # validation batches of 100 prompts x its n 1 over 8 engines: ceil(100 / 8) = 13 x 1 < 64
    assert derive(load_config(ARGS + ["data.val_batch_size=100"])).rollout_max_num_seqs == 64
    # ... x validation n 8 (its override): 13 x 8 = 104 > 64
    with_n = ["data.val_batch_size=100", "worker.rollout.val_override_config={n: 8}"]
    assert derive(load_config(ARGS + with_n)).rollout_max_num_seqs == 104
    # rounds of 16 prompts (mini_rollout_batch_size) over 8 engines: 2 x 8 = 16; over 2 (one node of 2
    # devices): 8 x 8 = 64; one device: 16 x 8 = 128
    rounds = no_val + ["data.mini_rollout_batch_size=16"]
    assert derive(load_config(rounds)).rollout_max_num_seqs == 16
    two = ["trainer.nnodes=1", "trainer.n_gpus_per_node=2"]
    assert derive(load_config(rounds + two)).rollout_max_num_seqs == 64
    one = ["trainer.nnodes=1", "trainer.n_gpus_per_node=1", "worker.rollout.tensor_parallel_size=1"]
    assert derive(load_config(rounds + one)).rollout_max_num_seqs == 128
    # engines of their own (placement=separate): the call is split over num_devices = 2 of them, 8 x 8 = 64
    separate = ["worker.rollout.placement=separate", "worker.rollout.num_devices=2", "worker.rollout.tensor_parallel_size=1"]
    assert derive(load_config(rounds + separate)).rollout_max_num_seqs == 64
    # a larger call than 256 sequences is capped at vLLM's default; an explicit value wins
    one_device = no_val + ["trainer.nnodes=1", "trainer.n_gpus_per_node=1", "worker.rollout.tensor_parallel_size=1"]
    assert derive(load_config(one_device)).rollout_max_num_seqs == 256  # 64 x 8 = 512
    assert derive(load_config(ARGS + ["worker.rollout.max_num_seqs=40"])).rollout_max_num_seqs == 40
