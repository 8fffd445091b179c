"""Entry point: ``python -m easyvlm.trainer.main config=examples/config.yaml key=value ...``

1. parse and validate the config (exit 2 with a message on any problem, before anything heavy);
2. make every local path absolute (Ray workers do not share the driver's working directory);
3. start Ray locally, or join a cluster (``trainer.ray_address`` or ``RAY_ADDRESS``);
4. build the trainer (data, reward actor, worker groups) and run the loop.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from easyvlm.config.cli import exit_with_problems, parse_and_validate
from easyvlm.config.derived import derive
from easyvlm.config.errors import Problem
from easyvlm.config.schema import PPOConfig
from easyvlm.utils.plugins import is_plugin_spec, resolve_plugin_spec

# what Ray workers need to see from the driver's environment
_FORWARDED_ENV = (
    "HF_HUB_OFFLINE",
    "HF_HOME",
    "EASYVLM_CACHE",
    "TOKENIZERS_PARALLELISM",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_LOGGING_LEVEL",
    "PYTHONPATH",
    "OMP_NUM_THREADS",  # torch threads per CPU rank (easyvlm.distributed.worker_group.cpu_threads)
)


def _abs_if_local(path: str | None) -> str | None:
    """An absolute path if ``path`` names something on disk (keeps ``builtin:`` and hub ids)."""
    if not path:
        return path
    head, at, split = path.partition("@")
    return str(Path(head).resolve()) + at + split if Path(head).exists() else path


def resolve_paths(cfg: PPOConfig) -> PPOConfig:
    """The same config with local paths made absolute; ``file.py:func`` specs resolved."""
    r = dataclasses.replace

    def model(m):
        return r(m, model_path=_abs_if_local(m.model_path), tokenizer_path=_abs_if_local(m.tokenizer_path))

    def spec(value: str) -> str:
        return resolve_plugin_spec(value) if is_plugin_spec(value) else value

    reward = cfg.worker.reward
    reward = r(
        reward,
        reward_function=spec(reward.reward_function) if reward.reward_function else reward.reward_function,
        reward_functions=[r(f, reward_function=spec(f.reward_function)) for f in reward.reward_functions],
    )
    actor = r(cfg.worker.actor, model=model(cfg.worker.actor.model), loss_type=spec(cfg.worker.actor.loss_type))
    critic = r(cfg.worker.critic, model=model(cfg.worker.critic.model))
    data = r(
        cfg.data,
        train_files=_abs_if_local(cfg.data.train_files),
        val_files=_abs_if_local(cfg.data.val_files),
        image_dir=_abs_if_local(cfg.data.image_dir),
        format_prompt=_abs_if_local(cfg.data.format_prompt),
        override_chat_template=_abs_if_local(cfg.data.override_chat_template),
    )
    trainer = r(
        cfg.trainer,
        save_checkpoint_path=_abs_path(cfg.trainer.save_checkpoint_path),
        load_checkpoint_path=_abs_if_local(cfg.trainer.load_checkpoint_path),
    )
    return r(
        cfg,
        data=data,
        algorithm=r(cfg.algorithm, adv_estimator=spec(cfg.algorithm.adv_estimator)),
        worker=r(cfg.worker, actor=actor, critic=critic, reward=reward),
        trainer=trainer,
    )


def reward_function_problems(cfg: PPOConfig) -> list[Problem]:
    """Load every reward file and check its function's signature, in the driver, before Ray starts:
    a missing function or a wrong signature is a config error, not a traceback minutes later."""
    from easyvlm.rewards.loader import load_reward_function
    from easyvlm.rewards.manager import RewardSettings
    from easyvlm.rewards.types import RewardError

    try:
        for spec in RewardSettings.from_config(cfg.worker.reward).functions:
            load_reward_function(spec)
    except RewardError as err:
        return [Problem("worker.reward", str(err.args[0]))]
    return []


def _abs_path(path: str | None) -> str | None:
    return str(Path(path).resolve()) if path else path


def start_ray(cfg: PPOConfig) -> Any:
    """Join ``trainer.ray_address`` / ``RAY_ADDRESS`` if given, else start a local cluster."""
    import ray

    env = {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM's per-call INFO/WARNING lines drown the progress bar
    address = cfg.trainer.ray_address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        return ray
    if address:
        ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=True)
    else:
        # logical CPUs: one per training process plus the reward actor's; the OS shares the cores
        cpus = max(os.cpu_count() or 1, cfg.trainer.n_gpus_per_node) + cfg.worker.reward.num_cpus
        ray.init(num_cpus=cpus, include_dashboard=False, runtime_env={"env_vars": env})
    return ray


def pick_device(cfg: PPOConfig, ray_module: Any) -> str:
    if cfg.trainer.device != "auto":
        return cfg.trainer.device
    return "cuda" if ray_module.cluster_resources().get("GPU", 0) > 0 else "cpu"


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    cfg = parse_and_validate(sys.argv[1:] if argv is None else argv)
    derived = derive(cfg)
    cfg = resolve_paths(cfg)
    problems = reward_function_problems(cfg)
    if problems:
        exit_with_problems(problems)
    derived = dataclasses.replace(derived, save_checkpoint_path=str(Path(derived.save_checkpoint_path).resolve()))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from easyvlm.distributed.worker_group import Resources
    from easyvlm.models.builtin import resolve_model_path
    from easyvlm.trainer.loop import Trainer

    # build builtin assets once here, not racing in every worker
    resolve_model_path(cfg.worker.actor.model.model_path)
    ray = start_ray(cfg)
    device = pick_device(cfg, ray)
    cpus_per_worker = max(1, (os.cpu_count() or 1) // cfg.trainer.n_gpus_per_node) if device == "cpu" else 4
    resources = Resources(world_size=derived.world_size, cpus_per_worker=cpus_per_worker, use_gpu=device == "cuda")
    trainer = Trainer(cfg, derived, resources, device)
    try:
        metrics = trainer.fit()
    finally:
        trainer.shutdown()
    print("easyvlm: done. final metrics: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()) if k.startswith(("val/", "reward/"))))
    return metrics


if __name__ == "__main__":
    main()
