"""`build_plan`: a validated `PPOConfig` -> the immutable `RunPlan`, once, in the driver.

What happens here and nowhere else:
- local paths become absolute (Ray workers do not share the driver's working directory) and
  ``file.py:func`` plug-ins are resolved; the plug-ins that run in Ray workers (reward functions,
  a policy loss) carry their file's text, and models their config name beside the driver's
  directory, so that a worker on another node of a cluster needs neither the driver's files nor its
  caches (docs/cluster.md);
- the policy's files are loaded once: its transformers config (``override_config`` applied), its
  tokenizer and processor (``trust_remote_code`` honoured), the token ids every role agrees on;
- the checks that need the model or the device (`model_problems`) run, still before Ray starts;
- each role gets its typed slice (``easyvlm.specs``) with its loss bound to its hyperparameters.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import easyvlm.builtin
from easyvlm.config.derived import Derived, RoleBatching, derive
from easyvlm.config.errors import ConfigError, Problem
from easyvlm.config.schema import ActorConfig, CriticConfig, ModelConfig, PPOConfig, canonical_dtype
from easyvlm.config.checks import lora_module_names
from easyvlm.config.validate import notices
from easyvlm.specs import (
    ActorSpec,
    AgentSpec,
    CriticSpec,
    EngineSpec,
    ForwardSpec,
    KLLossSpec,
    LoraSpec,
    MicroBatching,
    ModelBundle,
    ModelSpec,
    PolicyLossSpec,
    JudgeSpec,
    RefSpec,
    RewardModelSpec,
    RolloutSpec,
    Sampling,
    TokenIds,
    UpdateSpec,
)
from easyvlm.utils.plugins import is_plugin_spec, read_plugin_source, resolve_plugin_spec


@dataclass(frozen=True)
class RunPlan:
    """Everything a run needs, resolved once. The driver reads ``config`` (paths absolute) for the
    loop's own settings; every role gets only its slice."""

    config: PPOConfig
    derived: Derived
    device: str
    bundle: ModelBundle
    actor: ActorSpec
    ref: Optional[RefSpec]
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
                 rollout=rollout),
        trainer=trainer,
    )


# ------------------------------------------------------------------------------------------ models
def load_bundle(model: ModelConfig, key: str = "worker.actor.model") -> ModelBundle:
    """Resolve the model and tokenizer paths and load config, tokenizer, processor and token ids.

    Raises ConfigError naming ``key`` when the files do not fit together (a tokenizer that is not
    the model's, a vision-language family easyvlm does not know)."""
    from transformers import GenerationConfig

    from easyvlm.models.paths import resolve_model_path
    from easyvlm.models.loading import load_tokenizer_and_processor
    from easyvlm.rollout.tokens import blocked_token_ids, eos_token_ids, pad_token_id

    assert model.model_path, "validate() requires worker.actor.model.model_path"
    easyvlm.builtin.register()  # builtin: model paths and data sets resolve from here on (rm calls this alone)
    spec = model_spec(model, resolve_model_path(model.model_path), trainable_lora=True)
    same_tokenizer = model.tokenizer_path in (None, model.model_path)
    tokenizer_dir = spec.model_dir if same_tokenizer else resolve_model_path(model.tokenizer_path)
    tokenizer_path = model.model_path if same_tokenizer else model.tokenizer_path
    tokenizer, processor = load_tokenizer_and_processor(tokenizer_dir, model.trust_remote_code)
    try:
        generation_config = GenerationConfig.from_pretrained(spec.model_dir)
    except OSError:  # no generation_config.json: the tokenizer's EOS alone ends responses
        generation_config = None
    try:
        tokens = TokenIds(
            pad=pad_token_id(tokenizer),
            eos=tuple(eos_token_ids(tokenizer, generation_config)),
            blocked=tuple(blocked_token_ids(tokenizer, spec.hf_config)),
        )
    except ValueError as err:
        raise ConfigError([Problem(f"{key}.tokenizer_path", str(err))]) from err
    return ModelBundle(spec, tokenizer, processor, generation_config, tokens, tokenizer_dir, tokenizer_path)


def model_spec(model: ModelConfig, model_dir: str, trainable_lora: bool, key: str = "worker.actor.model") -> ModelSpec:
    """The `ModelSpec` of ``model`` whose files are in ``model_dir`` (loads its config; an unknown
    ``override_config`` key is a ConfigError naming it)."""
    from easyvlm.models.loading import UnknownOverrideError, load_hf_config

    lora = model.lora
    lora_spec = None
    if trainable_lora and lora.rank > 0:
        names = lora_module_names(lora.target_modules)
        lora_spec = LoraSpec(lora.rank, lora.alpha, names if names is not None else lora.target_modules, lora.exclude_modules)
    try:
        hf_config = load_hf_config(model_dir, dict(model.override_config), model.trust_remote_code)
    except UnknownOverrideError as err:
        raise ConfigError([Problem(err.key.replace("model.override_config", f"{key}.override_config", 1), str(err))]) from err
    return ModelSpec(
        model_dir=model_dir,
        hf_config=hf_config,
        trust_remote_code=model.trust_remote_code,
        attn_implementation=model.attn_implementation,
        lora=lora_spec,
        freeze_vision_tower=model.freeze_vision_tower,
        gradient_checkpointing=model.enable_gradient_checkpointing,
        model_path=model.model_path or "",
    )


# ----------------------------------------------------------------------------------------- slices
def _micro(role: ActorConfig | CriticConfig, size: int) -> MicroBatching:
    budget = role.max_token_len_per_device if isinstance(role, ActorConfig) else None
    return MicroBatching(micro_batch_size=size, dynamic=role.dynamic_batching, max_token_len=budget)


def _forward(cfg: PPOConfig, role: ActorConfig | CriticConfig, tokens: TokenIds) -> ForwardSpec:
    actor = cfg.worker.actor
    return ForwardSpec(
        padding_free=role.padding_free,
        share_prompts=role.share_prompts,
        temperature=cfg.worker.rollout.temperature,
        blocked_token_ids=tokens.blocked,
        use_torch_compile=actor.use_torch_compile,  # EasyR1 has the key on the actor only
        ulysses_size=role.ulysses_size,
        experience=_micro(role, role.micro_batch_size_per_device_for_experience),
    )


def _update(cfg: PPOConfig, role: ActorConfig | CriticConfig, batching: RoleBatching) -> UpdateSpec:
    return UpdateSpec(
        ppo_epochs=role.ppo_epochs,
        mini_batch_per_rank=batching.mini_batch_per_device,
        optimizer_steps_per_step=batching.optimizer_steps_per_step,
        micro=_micro(role, role.micro_batch_size_per_device_for_update),
        max_grad_norm=role.max_grad_norm,
        loss_avg_mode=role.loss_avg_mode,
        norm_length=cfg.data.max_response_length,
        optim=role.optim,
    )


def actor_spec(cfg: PPOConfig, derived: Derived, bundle: ModelBundle) -> ActorSpec:
    actor, algo = cfg.worker.actor, cfg.algorithm
    return ActorSpec(
        model=bundle.policy,
        fsdp=actor.fsdp,
        offload=actor.offload,
        forward=_forward(cfg, actor, bundle.tokens),
        update=_update(cfg, actor, derived.actor),
        policy_loss=PolicyLossSpec(
            name=actor.loss_type,
            clip_ratio_low=actor.clip_ratio_low,
            clip_ratio_high=actor.clip_ratio_high,
            clip_ratio_dual=actor.clip_ratio_dual,
            tau_positive=actor.tau_positive,
            tau_negative=actor.tau_negative,
            loss_avg_mode=actor.loss_avg_mode,
            # a file.py:func loss runs in the workers, maybe on nodes without the file: its text travels
            source=read_plugin_source(actor.loss_type) if is_plugin_spec(actor.loss_type) else None,
        ),
        kl_loss=KLLossSpec(algo.kl_coef, algo.kl_penalty) if derived.kl_in_loss else None,
        entropy_coeff=actor.entropy_coeff,
        seed=cfg.trainer.seed,
        files=bundle,
    )


def ref_spec(cfg: PPOConfig, bundle: ModelBundle) -> RefSpec:
    """The reference model: the actor's model without LoRA adapters (with LoRA, the base weights
    are the initial policy), the actor's forward settings, the ref section's FSDP and offload."""
    ref = cfg.worker.ref
    model = dataclasses.replace(bundle.policy, lora=None, gradient_checkpointing=False, freeze_vision_tower=False)
    return RefSpec(model=model, fsdp=ref.fsdp, offload=ref.offload, forward=_forward(cfg, cfg.worker.actor, bundle.tokens))


def critic_spec(cfg: PPOConfig, derived: Derived, bundle: ModelBundle) -> CriticSpec:
    from easyvlm.models.paths import resolve_model_path

    critic = cfg.worker.critic
    assert critic.model.model_path and derived.critic is not None, "validate() requires the critic for gae"
    if critic.model.model_path == cfg.worker.actor.model.model_path and critic.model.override_config == cfg.worker.actor.model.override_config:
        model = dataclasses.replace(bundle.policy, lora=None)
    else:
        model = model_spec(critic.model, resolve_model_path(critic.model.model_path), trainable_lora=False,
                           key="worker.critic.model")
    model = dataclasses.replace(
        model,
        freeze_vision_tower=critic.model.freeze_vision_tower,
        gradient_checkpointing=critic.model.enable_gradient_checkpointing,
        attn_implementation=critic.model.attn_implementation,
        trust_remote_code=critic.model.trust_remote_code,
    )
    return CriticSpec(
        model=model,
        fsdp=critic.fsdp,
        offload=critic.offload,
        forward=_forward(cfg, critic, bundle.tokens),
        update=_update(cfg, critic, derived.critic),
        cliprange_value=critic.cliprange_value,
        seed=cfg.trainer.seed,
    )


def rollout_spec(cfg: PPOConfig, derived: Derived, bundle: ModelBundle, device: str) -> RolloutSpec:
    from easyvlm.data.images import vllm_mm_processor_kwargs
    from easyvlm.rollout.base import sampling_with_overrides

    r, data = cfg.worker.rollout, cfg.data
    sampling = Sampling(
        n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=data.max_response_length,
        ignore_eos=r.ignore_eos,
    )
    mm = vllm_mm_processor_kwargs(bundle.processor)  # vLLM resizes with the processor's limits, as the data does
    engine = EngineSpec(
        name=r.name,
        model_dir=bundle.policy.model_dir,
        hf_config=bundle.policy.hf_config,
        hf_config_overrides=dict(cfg.worker.actor.model.override_config),
        tokenizer_dir=bundle.tokenizer_dir,
        trust_remote_code=bundle.policy.trust_remote_code,
        device=device,
        dtype=canonical_dtype(r.dtype),
        seed=r.seed,
        max_model_len=derived.rollout_max_model_len,
        max_num_batched_tokens=r.max_num_batched_tokens,
        max_num_seqs=derived.rollout_max_num_seqs,
        gpu_memory_utilization=r.gpu_memory_utilization,
        enforce_eager=r.enforce_eager,
        enable_chunked_prefill=r.enable_chunked_prefill,
        tensor_parallel_size=r.tensor_parallel_size,
        limit_images=r.limit_images,
        disable_log_stats=r.disable_log_stats,
        disable_tqdm=r.disable_tqdm,
        mm_processor_kwargs=mm,
        sequence_tokens=data.max_prompt_length + data.max_response_length,
        model_path=bundle.policy.model_path,
        tokenizer_path=bundle.tokenizer_path,
    )
    return RolloutSpec(
        engine=engine,
        sampling=sampling,
        val_sampling=sampling_with_overrides(sampling, r.val_override_config),
        response_length=data.max_response_length,
        tokens=bundle.tokens,
        per_request_seed=r.per_request_seed,
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
    return RunPlan(
        config=cfg,
        derived=derived,
        device=device,
        bundle=bundle,
        actor=actor_spec(cfg, derived, bundle),
        ref=ref_spec(cfg, bundle) if derived.use_reference else None,
        critic=critic_spec(cfg, derived, bundle) if derived.use_critic else None,
        rollout=rollout,
        agent=agent_spec(cfg, bundle),
        reward=reward,
        reward_model=reward_model_spec(cfg, bundle),
        judge=judge_spec(cfg, rollout),
        notices=tuple(notices(cfg) + device_notices(cfg, device)),
    )


def agent_spec(cfg: PPOConfig, bundle: ModelBundle) -> Optional[AgentSpec]:
    """The multi-turn settings, with every tool and the environment loaded here, in the driver, and
    the chat template checked for a tool-call format: a tool without a docstring or a template that
    cannot show tools is a config error before anything heavy starts."""
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
    return AgentSpec(
        tools=tuple(r.tools), tool_schemas=schemas, environment=r.environment, max_turns=r.max_turns,
        max_tokens_per_turn=r.max_tokens_per_turn, tool_timeout=r.tool_timeout,
    )


def reward_model_spec(cfg: PPOConfig, bundle: ModelBundle) -> Optional[RewardModelSpec]:
    """The reward model's slice, its files checked here: a scalar sequence classifier that reads the
    policy's token ids (it scores the policy's prompt + response tokens as they are)."""
    from transformers import AutoTokenizer

    from easyvlm.models.paths import resolve_model_path
    from easyvlm.models.reward_model import reward_model_problem

    rm = cfg.worker.reward_model
    if not rm.enable:
        return None
    key = "worker.reward_model.model"
    assert rm.model.model_path, "validate() requires the reward model's path"
    files = ModelConfig(model_path=rm.model.model_path, override_config=dict(rm.model.override_config),
                        trust_remote_code=rm.model.trust_remote_code, attn_implementation=rm.model.attn_implementation,
                        enable_gradient_checkpointing=False)
    model = model_spec(files, resolve_model_path(rm.model.model_path), trainable_lora=False, key=key)
    problem = reward_model_problem(model.hf_config, f"{key}.model_path ({model.model_dir})")
    if problem is None:
        try:
            same = AutoTokenizer.from_pretrained(model.model_dir, trust_remote_code=rm.model.trust_remote_code).get_vocab() \
                == bundle.tokenizer.get_vocab()
        except (OSError, ValueError):
            same = True  # no tokenizer files: the vocabulary size check below still holds
        policy_text, rm_text = bundle.policy.hf_config.get_text_config(), model.hf_config.get_text_config()
        if not same or policy_text.vocab_size != rm_text.vocab_size:
            problem = (f"{key}.model_path ({model.model_dir}) has another tokenizer than the policy; the reward model "
                       "scores the policy's token ids as they are, so it must share the policy's tokenizer "
                       "(train it from the policy's family with `python -m easyvlm.rm`)")
    if problem is not None:
        raise ConfigError([Problem(f"{key}.model_path", problem)])
    forward = ForwardSpec(
        padding_free=rm.padding_free, share_prompts=True, temperature=1.0, blocked_token_ids=(), use_torch_compile=False,
        ulysses_size=1, experience=MicroBatching(rm.micro_batch_size_per_device, dynamic=False, max_token_len=None),
    )
    return RewardModelSpec(model=model, fsdp=rm.fsdp, forward=forward, normalize=rm.normalize)


def judge_spec(cfg: PPOConfig, policy_rollout: RolloutSpec) -> Optional[JudgeSpec]:
    """The judge's slice: its files loaded here (model config, tokenizer, processor), its template
    compiled and its parser loaded, so that a broken one is a config error before anything starts."""
    from easyvlm.config.schema import DataConfig
    from easyvlm.data.images import vllm_mm_processor_kwargs
    from easyvlm.rewards.judge import load_template
    from easyvlm.utils.plugins import PluginError, load_plugin

    j = cfg.worker.judge
    if not j.enable:
        return None
    assert j.model_path and j.template and j.parser, "validate() requires the judge's model, template and parser"
    bundle = load_bundle(ModelConfig(model_path=j.model_path, trust_remote_code=j.trust_remote_code), key="worker.judge")
    try:
        load_template(j.template)
    except Exception as err:  # jinja2.TemplateSyntaxError, OSError
        raise ConfigError([Problem("worker.judge.template", f"{j.template}: {type(err).__name__}: {err}")]) from err
    try:
        load_plugin(j.parser)
    except PluginError as err:
        raise ConfigError([Problem("worker.judge.parser", str(err))]) from err
    sampling = Sampling(n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=j.max_tokens, ignore_eos=False)
    engine = dataclasses.replace(
        policy_rollout.engine, name=j.engine, model_dir=bundle.policy.model_dir, hf_config=bundle.policy.hf_config,
        hf_config_overrides={}, tokenizer_dir=bundle.tokenizer_dir, trust_remote_code=j.trust_remote_code,
        model_path=bundle.policy.model_path, tokenizer_path=bundle.tokenizer_path,
        max_model_len=j.max_prompt_length + j.max_tokens, sequence_tokens=j.max_prompt_length + j.max_tokens,
        mm_processor_kwargs=vllm_mm_processor_kwargs(bundle.processor),
        tensor_parallel_size=1,
    )
    rollout = RolloutSpec(engine=engine, sampling=sampling, val_sampling=sampling, response_length=j.max_tokens,
                          tokens=bundle.tokens, per_request_seed=False)
    data = DataConfig(prompt_key="prompt", answer_key="answer", image_key="images", max_prompt_length=j.max_prompt_length,
                      min_pixels=j.min_pixels, max_pixels=j.max_pixels, prompt_truncation="error")
    return JudgeSpec(rollout=rollout, data=data, tokenizer=bundle.tokenizer, processor=bundle.processor,
                     template=j.template, parser=j.parser, num_workers=j.num_workers, timeout=j.timeout,
                     on_error=j.on_error, cache_size=j.cache_size)


def reward_settings(cfg: PPOConfig) -> Any:
    """The reward settings, with every reward file loaded and its function's signature checked here,
    in the driver: a missing function or a wrong signature is a config error, not a traceback later."""
    from easyvlm.rewards.loader import load_reward_function
    from easyvlm.rewards.manager import RewardSettings
    from easyvlm.rewards.types import RewardError

    try:
        settings = RewardSettings.from_config(cfg.worker.reward)
        for spec in settings.functions:
            load_reward_function(spec)
    except RewardError as err:
        raise ConfigError([Problem("worker.reward", str(err.args[0]))]) from err
    return settings


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
    return lines
