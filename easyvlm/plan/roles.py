"""The per-role slices of the run plan (each role's ``specs`` module), made from the validated
config, the derived batch sizes and the model bundle."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

from easyvlm.algorithms.rollout_correction_settings import parse_is_threshold
from easyvlm.config.derived import Derived, RoleBatching
from easyvlm.config.errors import ConfigError, Problem
from easyvlm.config.schema import PPOConfig
from easyvlm.models.settings import ModelConfig
from easyvlm.models.moe_routing import is_moe_config
from easyvlm.models.specs import ModelBundle, ModelSpec, TokenIds
from easyvlm.rewards.specs import JudgeSpec
from easyvlm.rollout.specs import AdapterSpec, EngineSpec, RolloutSpec, Sampling
from easyvlm.workers.settings import ActorConfig, CriticConfig, ForwardSettings
from easyvlm.workers.specs import (
    ActorSpec, CriticSpec, ForwardSpec, MicroBatching, PolicyLossSpec, RefSpec, RewardModelSpec, UpdateSpec,
)
from easyvlm.plan.checks import moe_model_problems
from easyvlm.plan.models import load_bundle, model_spec
from easyvlm.utils.compose import settings_of
from easyvlm.utils.dtypes import canonical_dtype
from easyvlm.utils.plugins import is_plugin_spec, read_plugin_source

logger = logging.getLogger(__name__)


def _micro(cfg: PPOConfig, role: ActorConfig | CriticConfig, size: int) -> MicroBatching:
    """A role's micro-batching. Dynamic batching's default token budget is EasyR1's: ``size`` rows
    padded to max_prompt_length + max_response_length (not to easyvlm's narrower padded width,
    which gave smaller micro-batches than EasyR1's for the same keys)."""
    budget = role.max_token_len_per_device if isinstance(role, ActorConfig) else None
    if role.dynamic_batching and budget is None:
        budget = size * (cfg.data.max_prompt_length + cfg.data.max_response_length)
    return MicroBatching(micro_batch_size=size, dynamic=role.dynamic_batching, max_token_len=budget)


def _forward(cfg: PPOConfig, role: ActorConfig | CriticConfig, tokens: TokenIds, vision_language: bool) -> ForwardSpec:
    """A role's forward passes: its forward keys (padding_free ... expert_parallel_size) whole."""
    return ForwardSpec(
        settings=role.forward,
        temperature=cfg.worker.rollout.temperature,
        blocked_token_ids=tokens.blocked,
        use_torch_compile=cfg.worker.actor.use_torch_compile,  # EasyR1 has the key on the actor only
        experience=_micro(cfg, role, role.micro_batch_size_per_device_for_experience),
        router_replay=getattr(role, "router_replay", "disabled"),  # the actor's (MoE policies)
        vision_cache_mb=vision_cache_budget(role, vision_language),
    )


DEFAULT_VISION_CACHE_MB = 1024


def _vision_language(bundle: ModelBundle) -> bool:
    from easyvlm.models.loading import is_vision_language_config

    return is_vision_language_config(bundle.policy.hf_config)


def vision_cache_budget(role: ActorConfig | CriticConfig, vision_language: bool) -> int:
    """MiB of the frozen vision tower's outputs the role's workers keep (0 = no cache): the actor's
    ``vision_cache_mb``, by default 1024 with a frozen tower; none for text-only models and the critic."""
    if not isinstance(role, ActorConfig) or not vision_language:
        return 0
    if role.vision_cache_mb is not None:
        return role.vision_cache_mb
    return DEFAULT_VISION_CACHE_MB if role.model.freeze_vision_tower else 0


def _update(cfg: PPOConfig, role: ActorConfig | CriticConfig, batching: RoleBatching) -> UpdateSpec:
    """A role's update: its update keys (max_grad_norm, ppo_epochs) whole and its optim section."""
    return UpdateSpec(
        settings=role.update,
        optim=role.optim,
        mini_batch_per_rank=batching.mini_batch_per_device,
        optimizer_steps_per_step=batching.optimizer_steps_per_step,
        micro=_micro(cfg, role, role.micro_batch_size_per_device_for_update),
        norm_length=cfg.data.max_response_length,
    )


def actor_spec(cfg: PPOConfig, derived: Derived, bundle: ModelBundle) -> ActorSpec:
    """The actor: its model, sections and the settings of its losses as configured (fsdp, offload,
    the policy loss, the entropy bonus; the KL settings when the KL is a term of its loss)."""
    actor = cfg.worker.actor
    loss, distill = actor.policy_loss, cfg.algorithm.distill
    # a file.py:func loss runs in the workers, maybe on nodes without the file: its text travels
    source = read_plugin_source(loss.loss_type) if is_plugin_spec(loss.loss_type) else None
    return settings_of(
        ActorSpec, actor,
        model=bundle.policy,
        forward=_forward(cfg, actor, bundle.tokens, _vision_language(bundle)),
        update=_update(cfg, actor, derived.actor),
        policy_loss=PolicyLossSpec(loss, source),
        kl_loss=cfg.algorithm.kl if derived.kl_in_loss else None,
        seed=cfg.trainer.seed,
        files=bundle,
        router_aux_loss_coef=router_aux_loss_coef(actor.router_aux_loss_coef, bundle.policy.hf_config),
        distill=distill if distill.distill_coef > 0 and not distill.distill_as_reward else None,
        # the rollout correction's truncation bound caps the distillation loss's off-policy weight too
        distill_weight_cap=parse_is_threshold(cfg.algorithm.rollout_correction.rollout_is_threshold)[0],
        policy_gradient=not (distill.distill_only and not distill.distill_as_reward),
    )


def router_aux_loss_coef(configured: float | None, hf_config: Any) -> float:
    """The load-balancing loss's weight: the configured one, or the MoE model's own
    (``router_aux_loss_coef`` of its text config); 0 for dense models (the check refuses a value)."""
    if not is_moe_config(hf_config):
        return 0.0
    if configured is not None:
        return float(configured)
    return float(getattr(hf_config.get_text_config(), "router_aux_loss_coef", 0.0) or 0.0)


def ref_spec(cfg: PPOConfig, bundle: ModelBundle) -> RefSpec:
    """The reference model: the actor's model without LoRA adapters (with LoRA, the base weights
    are the initial policy), the actor's forward settings, the ref section's FSDP and offload."""
    ref = cfg.worker.ref
    model = dataclasses.replace(bundle.policy, lora=None, gradient_checkpointing=False, freeze_vision_tower=False)
    forward = _forward(cfg, cfg.worker.actor, bundle.tokens, _vision_language(bundle))
    # the reference replays the sampler's experts under R3 only (R2 replays in the update alone)
    forward = dataclasses.replace(forward, router_replay="R3" if forward.router_replay == "R3" else "disabled")
    return settings_of(RefSpec, ref, model=model, forward=forward)


def frozen_model_spec(section: Any, key: str) -> ModelSpec:
    """The `ModelSpec` of a frozen model with a model section of its own (the reward model's, the
    teacher's): its model_path, override_config, trust_remote_code and attn_implementation keys;
    no adapters, no gradient checkpointing."""
    from easyvlm.models.paths import resolve_model_path

    files = settings_of(ModelConfig, section, override_config=dict(section.override_config),
                        enable_gradient_checkpointing=False)
    return model_spec(files, resolve_model_path(section.model_path), trainable_lora=False, key=key)


def teacher_spec(cfg: PPOConfig, bundle: ModelBundle) -> Optional[RefSpec]:
    """On-policy distillation's teacher (``worker.teacher``): its own model, the actor's forward
    settings (the same packed rows as the reference's), the teacher section's FSDP and offload. Its
    files are checked here: it reads the student's token ids, images and position ids as they are."""
    teacher = cfg.worker.teacher
    if not teacher.enable:
        return None
    key = "worker.teacher.model"
    assert teacher.model.model_path, "validate() requires the teacher's path"
    model = frozen_model_spec(teacher.model, key)
    problem = teacher_problem(bundle, model.model_dir, model.hf_config, teacher.model.trust_remote_code)
    if problem is not None:
        raise ConfigError([Problem(f"{key}.model_path", f"{teacher.model.model_path} ({model.model_dir}): {problem}")])
    experts = cfg.worker.actor.expert_parallel_size
    if is_moe_config(model.hf_config) and experts > 1:  # an MoE teacher follows the actor's expert parallelism
        problems = moe_model_problems("worker.actor", experts, None, model.hf_config)
        if problems:
            raise ConfigError([Problem(p.key, f"{p.message} (the teacher {teacher.model.model_path}, which follows "
                                       "the actor's expert parallelism)") for p in problems])
    forward = dataclasses.replace(_forward(cfg, cfg.worker.actor, bundle.tokens, _vision_language(bundle)),
                                  router_replay="disabled",  # its own experts
                                  blocked_token_ids=teacher_blocked_ids(bundle, model, key))
    return settings_of(RefSpec, teacher, model=model, forward=forward)


def teacher_blocked_ids(bundle: ModelBundle, model: ModelSpec, key: str) -> tuple[int, ...]:
    """The ids the teacher's distribution leaves out (the student's vision placeholders, its own
    output rows past the tokenizer), so both distributions put all their mass on shared ids and
    the full KL over those (``kl.kl_full_shared_rows``) is the KL of the two."""
    from easyvlm.rollout.tokens import blocked_token_ids

    try:
        return tuple(blocked_token_ids(bundle.tokenizer, model.hf_config))
    except ValueError as err:  # far more rows than the student's tokenizer has tokens
        raise ConfigError([Problem(f"{key}.model_path", f"{model.model_path}: {err}")]) from err


# the image processor's settings that decide the pixel values and image tokens the teacher is given
IMAGE_PROCESSOR_KEYS = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "rescale_factor",
                        "do_rescale", "do_normalize")


# MoE and dense models of one generation that read the same rows: one processor, the same vision
# placeholders and one position-id layout (the same get_rope_index in transformers, one entry of
# models/position_ids.py), so a teacher of one scores the student's rows of the other as they are;
# their decoders differ only in the MLPs, which the teacher keeps to itself. Their tokenizers,
# image token ids and image processors are still compared below.
SAME_INPUT_MODEL_TYPES = (frozenset({"qwen3_vl", "qwen3_vl_moe"}), frozenset({"qwen3_5", "qwen3_5_moe"}))


def reads_same_inputs(teacher_type: str, student_type: str) -> bool:
    """Whether a ``teacher_type`` model reads the position ids of a ``student_type`` student's rows."""
    return teacher_type == student_type or frozenset({teacher_type, student_type}) in SAME_INPUT_MODEL_TYPES


def teacher_problem(bundle: ModelBundle, teacher_dir: str, teacher_config: Any, trust_remote_code: bool) -> Optional[str]:
    """Why a teacher cannot score the student's rows (None: it can): another family (position ids;
    see `SAME_INPUT_MODEL_TYPES`), tokenizer, image token ids or image processor, or fewer output
    rows than the tokenizer has tokens. More rows than the student's are fine (padding past the
    tokenizer: the full KL compares the rows they share)."""
    from transformers import AutoProcessor, AutoTokenizer

    student_config = bundle.policy.hf_config
    same = "must share the student's"
    if not reads_same_inputs(teacher_config.model_type, student_config.model_type):
        return (f"is a {teacher_config.model_type} model and the student a {student_config.model_type} one; the teacher "
                "reads the student's position ids (mRoPE) as they are, so it must be of the student's family (or its "
                "MoE / dense sibling of the same generation)")
    try:
        vocab = AutoTokenizer.from_pretrained(teacher_dir, trust_remote_code=trust_remote_code).get_vocab()
    except (OSError, ValueError) as err:
        return f"has no tokenizer that loads ({err}); the teacher {same} tokenizer"
    if vocab != bundle.tokenizer.get_vocab():
        return (f"has another tokenizer than the student ({bundle.tokenizer_path}): {len(vocab)} tokens against "
                f"{len(bundle.tokenizer.get_vocab())}, or the same number with other ids; it scores the student's token "
                f"ids as they are, so it {same} tokenizer")
    rows, tokens = teacher_config.get_text_config().vocab_size, len(bundle.tokenizer)
    if rows < tokens:
        return (f"has {rows} output rows (text_config.vocab_size in its config.json) for the {tokens} tokens of the "
                "student's tokenizer: the student's ids past its last row have no log-prob; a teacher's output layer "
                "must cover the tokenizer")
    for name in ("image_token_id", "video_token_id", "vision_start_token_id"):
        if getattr(teacher_config, name, None) != getattr(student_config, name, None):
            return f"has {name}={getattr(teacher_config, name, None)}, the student {getattr(student_config, name, None)}"
    if bundle.processor is not None:
        try:
            theirs = AutoProcessor.from_pretrained(teacher_dir, trust_remote_code=trust_remote_code).image_processor
        except (OSError, ValueError) as err:
            return f"has no image processor that loads ({err}); the teacher {same} image processor"
        ours = bundle.processor.image_processor
        differ = [f"{k}: {getattr(theirs, k, None)} vs {getattr(ours, k, None)}" for k in IMAGE_PROCESSOR_KEYS
                  if getattr(theirs, k, None) != getattr(ours, k, None)]
        if differ:
            return (f"has another image processor than the student ({'; '.join(differ)}); it reads the student's pixel "
                    "values as they are")
    return None


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
        experts_implementation=critic.model.experts_implementation,
        trust_remote_code=critic.model.trust_remote_code,
    )
    problems = moe_model_problems("worker.critic", critic.expert_parallel_size, critic.model.experts_implementation,
                                  model.hf_config)
    if problems:
        raise ConfigError(problems)
    return settings_of(
        CriticSpec, critic,
        model=model,
        forward=_forward(cfg, critic, bundle.tokens, False),
        update=_update(cfg, critic, derived.critic),
        seed=cfg.trainer.seed,
    )


def rollout_spec(cfg: PPOConfig, derived: Derived, bundle: ModelBundle, device: str) -> RolloutSpec:
    from easyvlm.data.videos import vllm_mm_processor_kwargs
    from easyvlm.rollout.base import sampling_with_overrides

    r, data = cfg.worker.rollout, cfg.data
    # n, temperature, top_p, top_k, ignore_eos: the rollout's keys
    sampling = settings_of(Sampling, r, max_tokens=data.max_response_length)
    # the engine's own keys (name, seed, gpu_memory_utilization, enforce_eager, ...) whole; the rest derived
    engine = EngineSpec(
        generation=r.generation,
        model_dir=bundle.policy.model_dir,
        hf_config=bundle.policy.hf_config,
        hf_config_overrides=dict(cfg.worker.actor.model.override_config),
        tokenizer_dir=bundle.tokenizer_dir,
        trust_remote_code=bundle.policy.trust_remote_code,
        device=device,
        dtype=canonical_dtype(r.dtype),
        max_model_len=derived.rollout_max_model_len,
        max_num_seqs=derived.rollout_max_num_seqs,
        mm_processor_kwargs=vllm_mm_processor_kwargs(bundle.processor),  # vLLM resizes as the data does
        sequence_tokens=data.max_prompt_length + data.max_response_length,
        model_path=bundle.policy.model_path,
        tokenizer_path=bundle.tokenizer_path,
        record_routing=cfg.worker.actor.router_replay == "R3",
        lora=adapter_spec(cfg, bundle),
    )
    return settings_of(
        RolloutSpec, r,
        engine=engine,
        sampling=sampling,
        val_sampling=sampling_with_overrides(sampling, r.val_override_config),
        response_length=data.max_response_length,
        tokens=bundle.tokens,
    )


MERGE_KEY = "worker.actor.model.lora.merge_for_rollout"


def adapter_spec(cfg: PPOConfig, bundle: ModelBundle) -> Optional[AdapterSpec]:
    """The adapters the engine serves unmerged, or None: merged weights (no LoRA, ``merge_for_rollout``
    true, asynchronous separate engines, or adapters the engine cannot serve, whose reason is logged here at start;
    with ``merge_for_rollout`` false that is a ConfigError). The transformers engine serves what PEFT
    trains; vLLM what `vllm_unmerged_problem` allows."""
    from easyvlm.rollout.lora import adapted_modules, is_tower_module, vllm_max_lora_rank, vllm_unmerged_problem

    lora, merge = bundle.policy.lora, cfg.worker.actor.model.lora.merge_for_rollout
    if lora is None or merge:
        return None
    placement = cfg.worker.rollout.placement_settings
    if placement.separate and placement.staleness > 0:  # merge_for_rollout=false is refused by the config check
        logger.warning("easyvlm: LoRA adapters merged for rollout: asynchronous separate engines take each version's "
                       "full weights (%s=true is implied)", MERGE_KEY)
        return None
    adapted = adapted_modules(bundle.policy)
    problem = None
    if cfg.worker.rollout.name == "vllm":
        problem = vllm_unmerged_problem(bundle.policy.hf_config.model_type, lora.rank, adapted)
    if problem is not None:
        if merge is False:
            raise ConfigError([Problem(MERGE_KEY, f"is false, but {problem}; set null (merge where needed) or true")])
        logger.warning("easyvlm: LoRA adapters merged for rollout (%s): %s", MERGE_KEY, problem)
        return None
    return AdapterSpec(lora=lora, max_rank=vllm_max_lora_rank(lora.rank) or lora.rank,
                       tower=any(is_tower_module(name) for name, _ in adapted))


def reward_model_spec(cfg: PPOConfig, bundle: ModelBundle) -> Optional[RewardModelSpec]:
    """The reward model's slice, its files checked here: a scalar sequence classifier that reads the
    policy's token ids (it scores the policy's prompt + response tokens as they are)."""
    from transformers import AutoTokenizer

    from easyvlm.models.reward_model import reward_model_problem

    rm = cfg.worker.reward_model
    if not rm.enable:
        return None
    key = "worker.reward_model.model"
    assert rm.model.model_path, "validate() requires the reward model's path"
    model = frozen_model_spec(rm.model, key)
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
    # one device per sequence pass, fixed micro-batches: no Ulysses, no expert parallelism
    keys = ForwardSettings(padding_free=rm.padding_free, share_prompts=True, dynamic_batching=False, ulysses_size=1,
                           expert_parallel_size=1)
    forward = ForwardSpec(
        settings=keys, temperature=1.0, blocked_token_ids=(), use_torch_compile=False,
        experience=MicroBatching(rm.micro_batch_size_per_device, dynamic=False, max_token_len=None),
    )
    return settings_of(RewardModelSpec, rm, model=model, forward=forward)


def judge_spec(cfg: PPOConfig, policy_rollout: RolloutSpec) -> Optional[JudgeSpec]:
    """The judge's slice: its files loaded here (model config, tokenizer, processor), its template
    compiled and its parser loaded, so that a broken one is a config error before anything starts."""
    from easyvlm.data.settings import DataConfig
    from easyvlm.data.videos import vllm_mm_processor_kwargs
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
    generation = dataclasses.replace(policy_rollout.engine.generation, name=j.engine, tensor_parallel_size=1)
    engine = dataclasses.replace(
        policy_rollout.engine, generation=generation, model_dir=bundle.policy.model_dir, hf_config=bundle.policy.hf_config,
        hf_config_overrides={}, tokenizer_dir=bundle.tokenizer_dir, trust_remote_code=j.trust_remote_code,
        model_path=bundle.policy.model_path, tokenizer_path=bundle.tokenizer_path,
        max_model_len=j.max_prompt_length + j.max_tokens, sequence_tokens=j.max_prompt_length + j.max_tokens,
        mm_processor_kwargs=vllm_mm_processor_kwargs(bundle.processor),
        lora=None,  # the judge's own model, no adapters
    )
    rollout = RolloutSpec(engine=engine, sampling=sampling, val_sampling=sampling, response_length=j.max_tokens,
                          tokens=bundle.tokens, per_request_seed=False)
    data = DataConfig(prompt_key="prompt", answer_key="answer", image_key="images", max_prompt_length=j.max_prompt_length,
                      min_pixels=j.min_pixels, max_pixels=j.max_pixels, prompt_truncation="error")
    # template, parser and calls (num_workers ... cache_size) are the judge's keys
    return settings_of(JudgeSpec, j, rollout=rollout, data=data, tokenizer=bundle.tokenizer, processor=bundle.processor)


def with_total_steps(spec: ActorSpec | CriticSpec, total_steps: int) -> Any:
    """``spec`` with its update's schedule length set (known once the training data is loaded)."""
    return dataclasses.replace(spec, update=dataclasses.replace(spec.update, total_steps=total_steps))
