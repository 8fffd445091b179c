"""Loading: YAML + dotted overrides, EasyR1-shaped files, and every unknown key or bad type reported."""

from __future__ import annotations

import math
import textwrap

import pytest

from easyvlm.config.errors import ConfigError
from easyvlm.config.loader import apply_overrides, load_config, load_config_collecting, to_yaml
from easyvlm.config.schema import PPOConfig
from easyvlm.rewards.settings import RewardFunctionConfig

# An EasyR1-style examples/config.yaml (EasyR1's keys and layout; values of a 7B math run).
EASYR1_YAML = """\
data:
  train_files: hiyouga/math12k@train
  val_files: hiyouga/math12k@test
  prompt_key: problem
  answer_key: answer
  image_key: images
  video_key: videos
  image_dir: null
  video_fps: 2.0
  max_prompt_length: 2048
  max_response_length: 2048
  rollout_batch_size: 512  # equivalent to verl's data.train_batch_size
  mini_rollout_batch_size: null
  val_batch_size: 1024
  format_prompt: ./examples/format_prompt/math.jinja
  override_chat_template: null
  shuffle: true
  seed: 1
  min_pixels: 262144
  max_pixels: 4194304
  filter_overlong_prompts: true

algorithm:
  adv_estimator: grpo
  disable_kl: false
  use_kl_loss: true
  kl_penalty: low_var_kl
  kl_coef: 1.0e-2
  online_filtering: false
  filter_key: overall
  filter_low: 0.01
  filter_high: 0.99

worker:
  actor:
    global_batch_size: 128
    micro_batch_size_per_device_for_update: 1
    micro_batch_size_per_device_for_experience: 2
    max_grad_norm: 1.0
    padding_free: true
    dynamic_batching: true
    ulysses_size: 1
    model:
      model_path: Qwen/Qwen2.5-VL-7B-Instruct
      enable_gradient_checkpointing: true
      trust_remote_code: false
      freeze_vision_tower: false
      lora:
        rank: 0
        alpha: 64
        target_modules: all-linear
        exclude_modules: .*visual.*
    optim:
      lr: 1.0e-6
      weight_decay: 1.0e-2
      strategy: adamw  # {adamw, adamw_bf16}
      lr_warmup_ratio: 0.0
    fsdp:
      enable_full_shard: true
      enable_cpu_offload: false
      enable_rank0_init: true
    offload:
      offload_params: true
      offload_optimizer: true

  rollout:
    n: 5
    temperature: 1.0
    top_p: 1.0
    limit_images: 0
    gpu_memory_utilization: 0.6
    enforce_eager: false
    enable_chunked_prefill: false
    tensor_parallel_size: 2
    disable_tqdm: false
    val_override_config:
      temperature: 0.6
      top_p: 0.95
      n: 1

  ref:
    fsdp:
      enable_full_shard: true
      enable_cpu_offload: true
      enable_rank0_init: true
    offload:
      offload_params: false

  reward:
    reward_type: batch
    reward_function: ./examples/reward_function/math.py:compute_score

trainer:
  total_epochs: 15
  max_steps: null
  project_name: easy_r1
  experiment_name: qwen2_5_vl_7b_math_grpo
  logger: ["file", "wandb"]
  nnodes: 1
  n_gpus_per_node: 8
  max_try_make_batch: 20  # -1 means no limit
  val_freq: 5  # -1 to disable
  val_before_train: true
  val_only: false
  val_generations_to_log: 3
  save_freq: 5  # -1 to disable
  save_limit: 3  # -1 to disable
  save_model_only: false
  save_checkpoint_path: null
  load_checkpoint_path: null
  find_last_checkpoint: true
"""


def write(tmp_path, text: str, name: str = "config.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def problems_of(argv):
    _, problems = load_config_collecting(argv)
    return problems


def only_problem(argv):
    problems = problems_of(argv)
    assert len(problems) == 1, problems
    return problems[0]


# -------------------------------------------------------------------------------------- merging
def test_defaults_without_arguments():
    assert load_config([]) == PPOConfig()


def test_yaml_then_overrides_in_order(tmp_path):
    path = write(tmp_path, "worker:\n  rollout:\n    n: 5\n    temperature: 0.7\ndata:\n  max_prompt_length: 64\n")
    cfg = load_config([f"config={path}", "worker.rollout.n=7", "data.max_prompt_length=32", "data.max_prompt_length=16"])
    assert cfg.worker.rollout.n == 7  # the override beats the file
    assert cfg.worker.rollout.temperature == 0.7  # the file beats the default
    assert cfg.data.max_prompt_length == 16  # the later override wins
    assert cfg.worker.rollout.top_p == 1.0  # untouched default
    # the config= argument may come after overrides: files are merged first anyway
    cfg = load_config(["worker.rollout.n=7", f"config={path}"])
    assert cfg.worker.rollout.n == 7


def test_values_are_typed_by_the_schema():
    cfg = load_config(
        [
            "worker.actor.optim.lr=1",  # int -> float
            "algorithm.kl_coef=1e-2",  # YAML 1.1 would read this as a string; the schema says float
            "worker.rollout.n='8'",  # a quoted number still converts to int
            "trainer.logger=[console,file]",
            "worker.actor.optim.betas=[0.8,0.95]",
            "worker.rollout.val_override_config={n: 1, temperature: 0.5}",
            "data.val_files=",  # empty value for a string key: the empty string
            "worker.actor.model.tokenizer_path=null",
        ]
    )
    assert cfg.worker.actor.optim.lr == 1.0 and isinstance(cfg.worker.actor.optim.lr, float)
    assert cfg.algorithm.kl_coef == 0.01
    assert cfg.worker.rollout.n == 8
    assert cfg.trainer.logger == ["console", "file"]
    assert cfg.worker.actor.optim.betas == (0.8, 0.95)
    assert cfg.worker.rollout.val_override_config == {"n": 1, "temperature": 0.5}
    assert cfg.data.val_files == ""
    assert cfg.worker.actor.model.tokenizer_path is None


def test_mappings_merge_key_by_key(tmp_path):
    path = write(tmp_path, "worker:\n  rollout:\n    val_override_config: {n: 1, temperature: 0.6}\n")
    cfg = load_config([f"config={path}", "worker.rollout.val_override_config={n: 2}"])
    assert cfg.worker.rollout.val_override_config == {"n": 2, "temperature": 0.6}
    cfg = load_config([f"config={path}", "worker.rollout.val_override_config.top_p=0.9"])
    assert cfg.worker.rollout.val_override_config == {"n": 1, "temperature": 0.6, "top_p": 0.9}


def test_reward_functions_list_becomes_dataclasses():
    cfg = load_config(["worker.reward.reward_functions=[{reward_function: a.py:f, weight: 0.5}, {reward_function: b.py}]"])
    assert cfg.worker.reward.reward_functions == [
        RewardFunctionConfig("a.py:f", {}, 0.5),
        RewardFunctionConfig("b.py", {}, 1.0),
    ]


def test_easyr1_yaml_loads(tmp_path):
    cfg = load_config([f"config={write(tmp_path, EASYR1_YAML)}"])
    assert cfg.data.train_files == "hiyouga/math12k@train"
    assert cfg.algorithm.kl_coef == 0.01 and cfg.algorithm.kl_penalty == "low_var_kl"
    assert cfg.worker.actor.model.lora.exclude_modules == ".*visual.*"
    assert cfg.worker.rollout.val_override_config == {"temperature": 0.6, "top_p": 0.95, "n": 1}
    assert cfg.worker.ref.fsdp.enable_cpu_offload is True
    assert cfg.trainer.logger == ["file", "wandb"]
    assert cfg.trainer.save_limit == 3


def test_to_yaml_round_trips(tmp_path):
    cfg = load_config([f"config={write(tmp_path, EASYR1_YAML)}", "worker.reward.reward_functions=[{reward_function: a.py}]"])
    again = load_config([f"config={write(tmp_path, to_yaml(cfg), 'printed.yaml')}"])
    assert again == cfg


def test_apply_overrides_returns_a_changed_copy():
    base = PPOConfig()
    changed = apply_overrides(base, ["worker.rollout.n=4"])
    assert (base.worker.rollout.n, changed.worker.rollout.n) == (1, 4)
    with pytest.raises(ConfigError, match="worker.rollout.nn"):
        apply_overrides(base, ["worker.rollout.nn=4"])


# --------------------------------------------------------------------------------- unknown keys
def test_unknown_key_with_nothing_close_lists_the_valid_keys():
    problem = only_problem(["worker.actor.bogus_key=1"])
    assert problem.key == "worker.actor.bogus_key"
    assert "did you mean" not in problem.message
    assert "valid keys there: strategy, global_batch_size" in problem.message
    assert "on the command line" in problem.message


@pytest.mark.parametrize(
    "arg, key, hint",
    [
        ("worker.rollout.temprature=0.5", "worker.rollout.temprature", "did you mean worker.rollout.temperature?"),
        ("workers.rollout.n=2", "workers", "did you mean worker?"),
        ("worker.actor.lr=1e-5", "worker.actor.lr", "'lr' is a key of worker.actor.optim.lr and worker.critic.optim.lr"),
        ("trainer.rollout_batch_size=8", "trainer.rollout_batch_size", "is a key of data.rollout_batch_size"),
        ("worker.actor.ulysses_sequence_parallel_size=2", "worker.actor.ulysses_sequence_parallel_size",
         "set worker.actor.ulysses_size instead"),
        ("worker.reward.score_function=./m.py:f", "worker.reward.score_function", "set worker.reward.reward_function instead"),
        ("trainer.total_episodes=3", "trainer.total_episodes", "set trainer.total_epochs instead"),
        ("worker.actor.kl_coef=0.1", "worker.actor.kl_coef", "set algorithm.kl_coef instead"),
        ("data.train_batch_size=8", "data.train_batch_size", "set data.rollout_batch_size instead"),
    ],
)
def test_unknown_key_hints(arg, key, hint):
    problem = only_problem([arg])
    assert problem.key == key
    assert hint in problem.message


def test_unknown_key_inside_a_list_of_sections():
    problem = only_problem(["worker.reward.reward_functions=[{reward_function: a.py, wieght: 2}]"])
    assert problem.key == "worker.reward.reward_functions[0].wieght"
    assert "did you mean 'weight'?" in problem.message


def test_every_problem_of_a_yaml_file_and_the_overrides_is_reported(tmp_path):
    path = write(
        tmp_path,
        """\
        data:
          max_prompt_lenght: 64
          rollout_batch_size: many
        worker:
          actor:
            optim:
              lr: fast
          rollout:
            name: sglang
        trainer:
          logger: [console, wandbb]
        """,
    )
    cfg, problems = load_config_collecting([f"config={path}", "worker.actor.bogus_key=1", "algorithm.kl_penalty=k3"])
    found = {p.key: p.message for p in problems}
    assert set(found) == {
        "data.max_prompt_lenght",
        "data.rollout_batch_size",
        "worker.actor.optim.lr",
        "worker.rollout.name",
        "trainer.logger",
        "worker.actor.bogus_key",
        "algorithm.kl_penalty",
    }
    assert "did you mean data.max_prompt_length?" in found["data.max_prompt_lenght"]
    assert f"in {path}" in found["data.max_prompt_lenght"]
    assert "expected an integer, got 'many'" in found["data.rollout_batch_size"]
    assert "expected a number, got 'fast'" in found["worker.actor.optim.lr"]
    assert "'sglang' is not one of 'vllm', 'hf'" in found["worker.rollout.name"]
    assert "'wandbb' not allowed" in found["trainer.logger"] and "'tensorboard'" in found["trainer.logger"]
    assert "one of 'kl', 'abs', 'mse', 'low_var_kl', 'full'" in found["algorithm.kl_penalty"]
    # the valid settings of the same sources still apply
    assert cfg == PPOConfig()


@pytest.mark.parametrize(
    "arg, key, text",
    [
        ("worker.rollout.n=abc", "worker.rollout.n", "expected an integer, got 'abc'"),
        ("data.max_prompt_length=1.5", "data.max_prompt_length", "expected an integer, got 1.5"),
        ("data.shuffle=maybe", "data.shuffle", "expected true or false"),
        ("data.prompt_truncation=middle", "data.prompt_truncation", "one of 'error', 'left', 'right'"),
        ("worker.reward.on_error=ignore", "worker.reward.on_error", "one of 'raise', 'zero'"),
        ("worker.actor.loss_avg_mode=seq-mean", "worker.actor.loss_avg_mode", "did you mean 'seq-mean-token-sum'?"),
        ("worker.actor.optim.betas=[0.9]", "worker.actor.optim.betas", "expected a list of 2 numbers"),
        ("worker.actor.model=3", "worker.actor.model", "is a section"),
        ("trainer.device=tpu", "trainer.device", "one of 'auto', 'cpu', 'cuda'"),
        ("worker.rollout.dtype=half", "worker.rollout.dtype", "'bf16', 'bfloat16'"),
        ("data.seed=${data.nope}", "data.seed", "data.nope"),
    ],
)
def test_bad_values(arg, key, text):
    problem = only_problem([arg])
    assert problem.key == key
    assert text in problem.message


def test_argument_without_equals_sign():
    problem = only_problem(["worker.rollout.n"])
    assert "key=value" in problem.message


def test_missing_and_broken_config_files(tmp_path):
    problem = only_problem([f"config={tmp_path / 'nope.yaml'}"])
    assert (problem.key, "not found") == ("config", "not found") and "nope.yaml" in problem.message
    broken = write(tmp_path, "data: [unclosed\n", "broken.yaml")
    problem = only_problem([f"config={broken}"])
    assert problem.key == "config" and "cannot read" in problem.message
    listing = write(tmp_path, "- a\n- b\n", "list.yaml")
    assert "must hold a mapping" in only_problem([f"config={listing}"]).message


def test_load_config_raises_with_all_problems():
    with pytest.raises(ConfigError) as info:
        load_config(["worker.actor.bogus_key=1", "worker.rollout.n=abc"])
    assert [p.key for p in info.value.problems] == ["worker.actor.bogus_key", "worker.rollout.n"]
    assert str(info.value).startswith("2 problems in the config:\n  - worker.actor.bogus_key: unknown key")


def test_special_floats_parse():
    cfg = load_config(["worker.reward.reward_functions=[{reward_function: a.py, weight: .inf}]"])
    assert math.isinf(cfg.worker.reward.reward_functions[0].weight)
