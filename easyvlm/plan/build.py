"""`build_plan`: a validated `PPOConfig` -> the immutable `RunPlan`, once, in the driver.

Here and nowhere else: local paths become absolute and plug-ins that run in Ray workers carry
their file's text (a worker on another node needs none of the driver's files: docs/cluster.md);
the policy's files are loaded once; the checks that need the model or the device run, before Ray
starts; each role gets its typed slice (``easyvlm.<package>.specs``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from easyvlm.config.derived import Derived, derive
from easyvlm.config.errors import ConfigError, Problem
from easyvlm.utils.dtypes import canonical_dtype
from easyvlm.config.schema import PPOConfig
from easyvlm.models.settings import ModelConfig
from easyvlm.data.settings import DataConfig
from easyvlm.config.validate import notices
from easyvlm.agents.specs import AgentSpec
from easyvlm.models.specs import ModelBundle
from easyvlm.plan.specs import DriverSpec, LaunchSpec
from easyvlm.rewards.settings import RewardConfig
from easyvlm.rewards.specs import JudgeSpec
from easyvlm.rollout.specs import RolloutSpec
from easyvlm.workers.specs import ActorSpec, CriticSpec, RefSpec, RewardModelSpec
from easyvlm.utils.plugins import is_plugin_spec, resolve_plugin_spec
from easyvlm.plan.driver import driver_spec
from easyvlm.plan.stages import batch_stages
from easyvlm.plan.models import load_bundle
from easyvlm.plan.roles import actor_spec, critic_spec, judge_spec, ref_spec, reward_model_spec, rollout_spec, teacher_spec


@dataclass(frozen=True)
class RunPlan:
    """Everything a run needs, resolved once; every role gets only its slice, the driver's loop its
    `DriverSpec`, the data loaders the ``data`` section (paths absolute), Ray's start `LaunchSpec`."""

    device: str
    data: DataConfig
    launch: LaunchSpec
    bundle: ModelBundle
    actor: ActorSpec
    ref: Optional[RefSpec]
    teacher: Optional[RefSpec]
    """On-policy distillation's teacher (``worker.teacher``); None = off."""
    critic: Optional[CriticSpec]
    rollout: RolloutSpec
    agent: Optional[AgentSpec]
    """Multi-turn rollouts with tools or an environment; None = one turn."""
    reward: Any
    """``easyvlm.rewards.manager.RewardSettings``."""
    reward_model: Optional[RewardModelSpec]
    """``worker.reward_model``; None = off."""
    judge: Optional[JudgeSpec]
    """``worker.judge``; None = off."""
    notices: tuple[str, ...]
    """Valid settings that do something the user may not expect; printed at start."""
    driver: DriverSpec
    for_cuda: Optional[Callable[[], "RunPlan"]] = field(default=None, compare=False, repr=False)
    """``trainer.device=auto`` planned on a machine without a GPU: builds this plan for ``cuda``, for
    a joined cluster that turns out to have GPUs (``easyvlm.trainer.main``)."""


# ------------------------------------------------------------------------------------------- paths
def abs_if_local(path: Optional[str]) -> Optional[str]:
    """An absolute path if ``path`` names something on disk (keeps ``builtin:`` and hub ids)."""
    if not path:
        return path
    head, at, split = path.partition("@")
    return str(Path(head).resolve()) + at + split if Path(head).exists() else path


def resolve_paths(cfg: PPOConfig) -> PPOConfig:
    """The same config with local paths made absolute and ``file.py:func`` specs resolved."""
    r = dataclasses.replace

    def model(m: ModelConfig) -> ModelConfig:
        return r(m, model_path=abs_if_local(m.model_path), tokenizer_path=abs_if_local(m.tokenizer_path))

    def spec(value: str) -> str:
        return resolve_plugin_spec(value) if is_plugin_spec(value) else value

    rollout = cfg.worker.rollout
    rollout = r(rollout, tools=[spec(t) for t in rollout.tools],
                environment=spec(rollout.environment) if rollout.environment else rollout.environment)
    reward = cfg.worker.reward
    reward = r(
        reward,
        reward_function=spec(reward.reward_function) if reward.reward_function else reward.reward_function,
        reward_functions=[r(f, reward_function=spec(f.reward_function)) for f in reward.reward_functions],
    )
    actor = r(cfg.worker.actor, model=model(cfg.worker.actor.model), loss_type=spec(cfg.worker.actor.loss_type))
    critic = r(cfg.worker.critic, model=model(cfg.worker.critic.model))
    reward_model = cfg.worker.reward_model
    reward_model = r(reward_model, model=r(reward_model.model, model_path=abs_if_local(reward_model.model.model_path)))
    teacher = cfg.worker.teacher
    teacher = r(teacher, model=r(teacher.model, model_path=abs_if_local(teacher.model.model_path)))
    judge = cfg.worker.judge
    judge = r(judge, model_path=abs_if_local(judge.model_path), template=abs_if_local(judge.template),
              parser=spec(judge.parser) if judge.parser else judge.parser)
    data = r(
        cfg.data,
        train_files=abs_if_local(cfg.data.train_files),
        val_files=abs_if_local(cfg.data.val_files),
        image_dir=abs_if_local(cfg.data.image_dir),
        format_prompt=abs_if_local(cfg.data.format_prompt),
        override_chat_template=abs_if_local(cfg.data.override_chat_template),
    )
    trainer = r(
        cfg.trainer,
        save_checkpoint_path=str(Path(cfg.trainer.save_checkpoint_path).resolve()) if cfg.trainer.save_checkpoint_path else None,
        load_checkpoint_path=abs_if_local(cfg.trainer.load_checkpoint_path),
        ray_timeline=str(Path(cfg.trainer.ray_timeline).resolve()) if cfg.trainer.ray_timeline else None,
    )
    return r(
        cfg,
        data=data,
        algorithm=r(cfg.algorithm, adv_estimator=spec(cfg.algorithm.adv_estimator)),
        worker=r(cfg.worker, actor=actor, critic=critic, reward=reward, reward_model=reward_model, judge=judge,
                 rollout=rollout, teacher=teacher),
        trainer=trainer,
    )


# ------------------------------------------------------------------------------------------- build
def pick_device(cfg: PPOConfig) -> str:
    """``trainer.device``; ``auto`` = cuda when this machine sees a GPU (a cluster joined through
    ``trainer.ray_address`` is asked again once Ray is up: ``easyvlm.trainer.main``)."""
    if cfg.trainer.device != "auto":
        return cfg.trainer.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def build_plan(cfg: PPOConfig, device: str) -> RunPlan:
    """The run plan of a config that passed ``validate``; raises ConfigError for problems that need
    the model files or the device (still before Ray starts)."""
    from easyvlm.plan.checks import model_problems

    derived = derive(cfg)
    cfg = resolve_paths(cfg)
    derived = dataclasses.replace(derived, save_checkpoint_path=str(Path(derived.save_checkpoint_path).resolve()))
    reward = reward_settings(cfg)  # cheap, so before the model files (a builtin model may be built first)
    bundle = load_bundle(cfg.worker.actor.model)
    problems = model_problems(cfg, bundle.policy.hf_config, device)
    if problems:
        raise ConfigError(problems)
    rollout = rollout_spec(cfg, derived, bundle, device)
    actor = actor_spec(cfg, derived, bundle)
    critic = critic_spec(cfg, derived, bundle) if derived.use_critic else None
    driver = driver_spec(cfg, derived)
    return RunPlan(
        device=device,
        data=cfg.data,
        launch=launch_spec(cfg, derived),
        bundle=bundle,
        actor=actor,
        ref=ref_spec(cfg, bundle) if derived.use_reference else None,
        teacher=teacher_spec(cfg, bundle),
        critic=critic,
        rollout=rollout,
        agent=agent_spec(cfg, bundle),
        reward=reward,
        reward_model=reward_model_spec(cfg, bundle),
        judge=judge_spec(cfg, rollout),
        notices=tuple(notices(cfg) + device_notices(cfg, device)),
        driver=dataclasses.replace(driver, stages=batch_stages(driver, actor, critic)),
        for_cuda=functools.partial(build_plan, cfg, "cuda") if cfg.trainer.device == "auto" and device == "cpu" else None,
    )


def launch_spec(cfg: PPOConfig, derived: Derived) -> LaunchSpec:
    t, r, judge = cfg.trainer, cfg.worker.rollout, cfg.worker.judge
    return LaunchSpec(
        ray_address=t.ray_address,
        world_size=derived.world_size,
        n_gpus_per_node=t.n_gpus_per_node,
        judge_engines=judge.num_workers if judge.enable else 0,
        separate_rollout_devices=r.num_devices if r.placement == "separate" else 0,
    )


def agent_spec(cfg: PPOConfig, bundle: ModelBundle) -> Optional[AgentSpec]:
    """The multi-turn settings, with every tool and the environment loaded and the chat template
    checked for a tool-call format here (ConfigError before anything heavy starts)."""
    from easyvlm.agents.environment import load_environment
    from easyvlm.agents.parse import tool_call_format
    from easyvlm.agents.tools import ToolError, load_tools
    from easyvlm.data.prompts import resolve_chat_template

    r = cfg.worker.rollout
    if not r.tools and r.environment is None:
        return None
    schemas: tuple[dict, ...] = ()
    try:
        if r.tools:
            schemas = tuple(tool.schema for tool in load_tools(r.tools).values())
        if r.environment is not None:
            load_environment(r.environment)
    except ToolError as err:
        key = "worker.rollout.tools" if r.tools else "worker.rollout.environment"
        raise ConfigError([Problem(key, str(err))]) from err
    if r.tools:
        templater = bundle.processor if bundle.processor is not None else bundle.tokenizer
        template = resolve_chat_template(cfg.data.override_chat_template) or getattr(templater, "chat_template", None)
        if tool_call_format(template) is None:
            raise ConfigError([Problem("worker.rollout.tools", (
                "the model's chat template shows the model no tool-call format (no <tool_call> tags), so it cannot "
                "call tools; use a tool-calling model (Qwen2.5-VL, Qwen3-VL) or data.override_chat_template"))])
    return AgentSpec(settings=r.agent, tool_schemas=schemas)


def reward_settings(cfg: PPOConfig) -> Any:
    """The reward settings, every reward file loaded and its function's signature checked here."""
    from easyvlm.rewards.loader import load_reward_function
    from easyvlm.rewards.types import RewardError

    try:
        settings = reward_settings_of(cfg.worker.reward)
        for spec in settings.functions:
            load_reward_function(spec)
    except RewardError as err:
        raise ConfigError([Problem("worker.reward", str(err.args[0]))]) from err
    return settings


def reward_settings_of(reward: RewardConfig) -> Any:
    """``worker.reward`` as the reward manager's `RewardSettings` (relative paths resolved here)."""
    from easyvlm.rewards.loader import RewardFunctionSpec
    from easyvlm.rewards.manager import RewardSettings
    from easyvlm.rewards.types import RewardError

    if reward.reward_functions:
        specs = [RewardFunctionSpec(f.reward_function, dict(f.reward_function_kwargs), float(f.weight), reward.reward_type)
                 for f in reward.reward_functions]
    elif reward.reward_function:
        specs = [RewardFunctionSpec(reward.reward_function, dict(reward.reward_function_kwargs), 1.0, reward.reward_type)]
    else:
        raise RewardError("worker.reward.reward_function is unset: give path/to/file.py:func")
    return RewardSettings(tuple(specs), reward.calls)


def device_notices(cfg: PPOConfig, device: str) -> list[str]:
    """What the CPU does differently from the GPU path the config describes."""
    if device != "cpu":
        return []
    lines = []
    roles = {"worker.actor": cfg.worker.actor}  # the roles this run builds
    if not cfg.algorithm.disable_kl:
        roles["worker.ref"] = cfg.worker.ref
    if cfg.algorithm.adv_estimator == "gae":
        roles["worker.critic"] = cfg.worker.critic
    offloaded = [f"{k}.offload" for k, role in roles.items() if role.offload.offload_params or role.offload.offload_optimizer]
    if offloaded:
        lines.append(f"{', '.join(offloaded)}: offloading moves GPU memory to the host; on the CPU it does nothing")
    fsdp = [role.fsdp for role in roles.values()]
    dtypes = [cfg.worker.rollout.dtype] + [d for f in fsdp for d in (f.mp_param_dtype, f.mp_reduce_dtype, f.mp_buffer_dtype)]
    if any(canonical_dtype(d) != "fp32" for d in dtypes) or any(f.torch_dtype not in (None, "fp32", "float32") for f in fsdp):
        lines.append("on the CPU models run in float32 (worker.rollout.dtype, fsdp.torch_dtype and the fsdp.mp_* "
                     "dtypes apply on GPUs)")
    if cfg.worker.rollout.name == "vllm" and cfg.worker.actor.router_replay == "R3":
        # easyvlm/rollout/vllm_routing.py: a token served from the prefix cache is never routed
        lines.append("worker.actor.router_replay=R3 with vLLM on the CPU: the engine records each token's experts with "
                     "vLLM's prefix cache off, so each of a prompt's n samples prefills the whole prompt")
    return lines
