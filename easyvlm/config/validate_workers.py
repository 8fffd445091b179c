"""The config check of the ``worker`` sections: actor and critic, rewards (functions, reward model,
judge) and the rollout (engine, placement, multi-turn, sampling). ``easyvlm.config.validate`` runs
them in order."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from easyvlm.config.introspect import all_keys, describe, field_types, is_finite_number, matches
from easyvlm.config.names import GROUP_ADV_ESTIMATORS, POLICY_LOSSES, SHIPPED_TOOLS
from easyvlm.config.worker_schema import RolloutConfig
from easyvlm.models.settings import LoraConfig
from easyvlm.utils.plugins import PluginError, is_plugin_spec, parse_plugin_spec
from easyvlm.config.validate_placement import check_placement
from easyvlm.config.checks import Checks, check_fsdp, check_model, check_optim, divisors, name_or_spec, round_up

# Sampling settings that may differ in validation (worker.rollout.val_override_config): the fields of
# vLLM's SamplingParams (vLLM 0.32; config/ must not import vllm, so they are listed here and a test
# checks the list against vllm.SamplingParams). The transformers engine supports the first six.
HF_SAMPLING_KEYS = ("n", "temperature", "top_p", "top_k", "max_tokens", "ignore_eos")
VLLM_SAMPLING_KEYS = HF_SAMPLING_KEYS + (
    "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "seed", "stop", "stop_token_ids",
    "include_stop_str_in_output", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "bad_words", "allowed_token_ids", "logit_bias", "thinking_token_budget",
)
# SamplingParams fields easyvlm sets itself: the rollout's contract (token ids out, the sampled token's
# log-prob, blocked ids) depends on them. Other fields (vLLM internals) are refused as unknown.
ENGINE_OWNED_SAMPLING_KEYS = (
    "logprobs", "prompt_logprobs", "detokenize", "output_kind", "extra_args", "structured_outputs", "flat_logprobs",
)


# ------------------------------------------------------------------------------------ actor, critic
def _check_role(c: Checks, role: str) -> None:
    """Rules shared by worker.actor and worker.critic."""
    p = f"worker.{role}"
    sizes_ok = (
        c.at_least(f"{p}.global_batch_size", 1)
        & c.at_least(f"{p}.micro_batch_size_per_device_for_update", 1)
        & c.at_least(f"{p}.micro_batch_size_per_device_for_experience", 1)
        & c.at_least(f"{p}.ulysses_size", 1)
        & c.at_least(f"{p}.expert_parallel_size", 1)
        # reported by their own sections' rules; here they only gate the divisibility rules
        & all(c.get(k) >= 1 for k in ("data.rollout_batch_size", "worker.rollout.n", "trainer.nnodes"))
        & (c.cfg.trainer.n_gpus_per_node >= 1)
    )
    c.positive(f"{p}.max_grad_norm")
    c.at_least(f"{p}.ppo_epochs", 1)
    check_optim(c, f"{p}.optim")
    check_model(c, f"{p}.model")
    check_fsdp(c, f"{p}.fsdp")
    if not sizes_ok:
        return

    rollout_bs = c.cfg.data.rollout_batch_size
    global_bs = c.get(f"{p}.global_batch_size")
    if global_bs > rollout_bs:
        c.add(
            f"{p}.global_batch_size",
            f"({global_bs}) is larger than data.rollout_batch_size ({rollout_bs}), the prompts of a whole step; "
            f"set it to data.rollout_batch_size or one of its divisors {divisors(rollout_bs)}",
        )
    elif rollout_bs % global_bs:
        c.add(
            "data.rollout_batch_size",
            f"({rollout_bs}) must be a multiple of {p}.global_batch_size ({global_bs}): each step's prompts are split "
            f"into PPO mini-batches of global_batch_size prompts; e.g. set data.rollout_batch_size="
            f"{round_up(rollout_bs, global_bs)} or {p}.global_batch_size to one of {divisors(rollout_bs)}",
        )

    ulysses = c.get(f"{p}.ulysses_size")
    if ulysses > 1 and not c.get(f"{p}.padding_free"):
        c.add(f"{p}.ulysses_size", f"({ulysses}) needs {p}.padding_free=true: sequence parallelism splits the packed row")
    world = c.world_size
    if world % ulysses:
        devices = f"{world} = trainer.nnodes x trainer.n_gpus_per_node"
        c.add(f"{p}.ulysses_size", f"({ulysses}) must divide the number of devices ({devices})")
        return
    _check_expert_parallel(c, p, world, ulysses)
    dp = world // ulysses
    micro = c.get(f"{p}.micro_batch_size_per_device_for_update")
    samples = global_bs * c.n
    dp_text = f"{dp} data-parallel ranks" + (f" ({world} devices / ulysses_size {ulysses})" if ulysses > 1 else "")
    mini_text = f"{p}.global_batch_size x worker.rollout.n = {global_bs} x {c.n} = {samples} samples"
    if samples % dp:
        c.add(
            f"{p}.global_batch_size",
            f"the PPO mini-batch of {mini_text} cannot be split evenly over {dp_text}; make "
            f"global_batch_size x n a multiple of {dp}",
        )
    elif samples % (micro * dp):
        c.add(
            f"{p}.micro_batch_size_per_device_for_update",
            f"({micro}) must divide the {samples // dp} samples each device gets per PPO mini-batch ({mini_text} over "
            f"{dp_text}), so that every device does whole micro-batches; e.g. set it to one of "
            f"{divisors(samples // dp)}",
        )

    max_tokens = c.get(f"{p}.max_token_len_per_device") if role == "actor" else None
    longest = c.cfg.data.max_prompt_length + c.cfg.data.max_response_length
    if max_tokens is not None and max_tokens < longest:
        c.add(
            f"{p}.max_token_len_per_device",
            f"({max_tokens}) must hold at least one whole sequence: data.max_prompt_length + "
            f"data.max_response_length = {longest}; raise it, or set null for micro-batch size x that length",
        )


def check_actor(c: Checks) -> None:
    _check_role(c, "actor")
    p = "worker.actor"
    # the policy loss's own ranges: PolicyLossSettings.problems (the config check walks every settings class)
    if not is_finite_number(c.cfg.worker.actor.entropy_coeff):
        c.add(f"{p}.entropy_coeff", f"must be a finite number, got {c.cfg.worker.actor.entropy_coeff}")
    _check_adaptive_entropy(c)
    name_or_spec(c, f"{p}.loss_type", POLICY_LOSSES, "policy loss")
    _check_loss_hyperparameters(c)
    _check_token_filters(c)
    _check_router(c)
    _check_vision_cache(c)
    _check_lora_merge(c)


def _check_expert_parallel(c: Checks, p: str, world: int, ulysses: int) -> None:
    """{p}.expert_parallel_size: groups of that many ranks split each MoE layer's experts (the model's
    rules, dense models and the expert count, are easyvlm.plan.checks')."""
    experts = c.get(f"{p}.expert_parallel_size")
    if experts == 1:
        return
    if world % experts:
        c.add(f"{p}.expert_parallel_size", f"({experts}) must divide the number of devices ({world} = trainer.nnodes x "
              f"trainer.n_gpus_per_node): the ranks form groups of expert_parallel_size; e.g. one of {divisors(world)}")
    if ulysses > 1:
        c.add(f"{p}.expert_parallel_size", f"({experts}) cannot be combined with {p}.ulysses_size={ulysses} (MoE models "
              "refuse Ulysses, whose ranks each route a slice of the same row); set ulysses_size=1")


def _check_vision_cache(c: Checks) -> None:
    """worker.actor.vision_cache_mb: a budget in MiB, and only for a tower whose outputs never change."""
    p, actor = "worker.actor", c.cfg.worker.actor
    budget = actor.vision_cache_mb
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        c.add(f"{p}.vision_cache_mb", f"must be a whole number of MiB >= 0 (0 = off, null = 1024 with a frozen tower), got {budget!r}")
    elif budget > 0 and not actor.model.freeze_vision_tower:
        c.add(f"{p}.vision_cache_mb", f"({budget}) keeps the vision tower's outputs, which change at every update of a "
              f"tower that trains; set {p}.model.freeze_vision_tower=true, or vision_cache_mb=0")


def _check_router(c: Checks) -> None:
    """MoE routing keys that need no model (plan/checks.py refuses them for dense models)."""
    p, actor = "worker.actor", c.cfg.worker.actor
    coef = actor.router_aux_loss_coef
    if coef is not None and (not is_finite_number(coef) or coef < 0):
        c.add(f"{p}.router_aux_loss_coef", f"must be a finite number >= 0 (0 = off, null = the model's own), got {coef}")
    if actor.router_replay == "disabled":
        return
    if actor.router_replay == "R2" and c.cfg.algorithm.rollout_correction.bypass_mode:
        c.add(f"{p}.router_replay", "R2 records each token's experts in the old-log-prob pass, which "
              "algorithm.rollout_correction.bypass_mode=true skips (the sampler's log-probs are the old ones), so "
              "nothing would be replayed; use router_replay=R3 (the sampler's experts) or bypass_mode=false")
    rollout = c.cfg.worker.rollout
    if actor.router_replay == "R3" and (rollout.tools or rollout.environment):
        c.add(f"{p}.router_replay", "R3 records the experts of single-turn samples; multi-turn rollouts "
              "(worker.rollout.tools / environment) do not keep them yet: use router_replay=R2")
    if actor.router_replay == "R3" and rollout.partial_rollout:
        c.add(f"{p}.router_replay", "R3 replays the experts the sampler chose, but worker.rollout.partial_rollout=true "
              "streams samples whose KV (and routing) is recomputed with every new version's weights, and the "
              "generation stream does not keep routing; set partial_rollout=false (max_staleness alone keeps whole "
              "batches), or router_replay=R2")
    if actor.ulysses_size > 1:
        c.add(f"{p}.router_replay", f"({actor.router_replay}) cannot run with {p}.ulysses_size > 1 (each rank's "
              "decoder sees a slice of the row); set ulysses_size=1 or router_replay=disabled")


ADAPTIVE_ENTROPY_KEYS = ("entropy_target", "entropy_coeff_delta", "entropy_coeff_min", "entropy_coeff_max")


def _check_adaptive_entropy(c: Checks) -> None:
    """worker.actor.use_adaptive_entropy and its four keys (easyvlm.algorithms.entropy.AdaptiveEntropyController)."""
    p, actor = "worker.actor", c.cfg.worker.actor
    if not actor.use_adaptive_entropy:
        for key in ADAPTIVE_ENTROPY_KEYS:
            if differs(actor, type(actor)(), key):
                c.add(f"{p}.{key}", f"is set, but the key means nothing unless {p}.use_adaptive_entropy=true; set that, "
                      "or remove it")
        return
    target, delta = actor.entropy_target, actor.entropy_coeff_delta
    low, high, init = actor.entropy_coeff_min, actor.entropy_coeff_max, actor.entropy_coeff
    if not is_finite_number(target) or target < 0:
        c.add(f"{p}.entropy_target", f"must be a finite number >= 0 (a token-mean entropy, in nats), got {target}")
    if not is_finite_number(delta) or delta <= 0:
        c.add(f"{p}.entropy_coeff_delta", f"must be a finite number > 0 (the coefficient's step per trainer step), got {delta}")
    for key, value in (("entropy_coeff_min", low), ("entropy_coeff_max", high)):
        if not is_finite_number(value):
            c.add(f"{p}.{key}", f"must be a finite number (a bound of the adaptive entropy coefficient), got {value}")
    if not (is_finite_number(low) and is_finite_number(high)):
        return
    if low > high:
        c.add(f"{p}.entropy_coeff_min", f"({low}) is above {p}.entropy_coeff_max ({high}); swap them")
    elif is_finite_number(init) and not low <= init <= high:
        c.add(f"{p}.entropy_coeff", f"({init}) is the adaptive controller's initial coefficient and must lie in "
              f"[{p}.entropy_coeff_min, {p}.entropy_coeff_max] = [{low}, {high}]")


# the built-in losses that read each loss-specific key (a plug-in gets them all in PolicyLossInputs)
_LOSS_KEYS: dict[str, str] = {
    "tau_positive": "sapo", "tau_negative": "sapo", "clip_cov_ratio": "clip_cov", "clip_cov_lb": "clip_cov",
    "clip_cov_ub": "clip_cov", "kl_cov_ratio": "kl_cov", "ppo_kl_coef": "kl_cov",
}


def _check_loss_hyperparameters(c: Checks) -> None:
    p, actor = "worker.actor", c.cfg.worker.actor
    if is_plugin_spec(actor.loss_type):
        return
    for key, loss in _LOSS_KEYS.items():
        if actor.loss_type != loss and differs(actor, type(actor)(), key):
            c.add(f"{p}.{key}", f"is set, but only loss_type={loss} reads it and {p}.loss_type is {actor.loss_type}; "
                  f"remove it, or set loss_type={loss}")


def _check_token_filters(c: Checks) -> None:
    p, actor = "worker.actor", c.cfg.worker.actor
    quantile, threshold = actor.top_entropy_quantile, actor.off_policy_mask_threshold
    for key, on in (("top_entropy_quantile", quantile != 1), ("off_policy_mask_threshold", threshold is not None)):
        if on and is_plugin_spec(actor.loss_type):
            c.add(f"{p}.{key}", f"is set, but {p}.loss_type={actor.loss_type} is a plug-in, which may not apply "
                  "PolicyLossInputs.token_gate; use a built-in loss, or apply the gate in your loss and register it "
                  "by name (easyvlm.algorithms.register_policy_loss)")


def _check_lora_merge(c: Checks) -> None:
    """merge_for_rollout needs adapters; unmerged (false) needs synchronous engines (asynchronous separate
    ones take each version's full weights) and a rank vLLM takes. The model's own limits: easyvlm.plan.roles."""
    from easyvlm.rollout.lora import VLLM_LORA_RANKS

    p, lora, r = "worker.actor.model.lora", c.cfg.worker.actor.model.lora, c.cfg.worker.rollout
    if lora.merge_for_rollout is not None and lora.rank == 0:
        c.add(f"{p}.merge_for_rollout", f"is {str(lora.merge_for_rollout).lower()}, but {p}.rank is 0 (no adapters: the "
              "engine gets the full weights); remove it or set a rank")
    if lora.merge_for_rollout is False and lora.rank > 0:
        if r.placement_settings.separate and r.placement_settings.staleness > 0:
            c.add(f"{p}.merge_for_rollout", "is false, but asynchronous separate engines (worker.rollout.max_staleness "
                  ">= 1 or one_step_off) take each version's full weights (docs/rollout.md, \"Weight sync\"); set null "
                  "or true, or max_staleness=0")
        if r.name == "vllm" and lora.rank > VLLM_LORA_RANKS[-1]:
            c.add(f"{p}.merge_for_rollout", f"is false, but {p}.rank={lora.rank} is above vLLM's largest max_lora_rank "
                  f"({VLLM_LORA_RANKS[-1]}); set null or true, or a rank of at most {VLLM_LORA_RANKS[-1]}")


def check_critic(c: Checks) -> None:
    _check_role(c, "critic")
    c.positive("worker.critic.cliprange_value")
    model = c.cfg.worker.critic.model
    if model.lora.rank > 0:
        c.add("worker.critic.model.lora.rank", f"is {model.lora.rank}, but LoRA adapters are for the actor only (the "
              "critic trains its value head and backbone in full); set 0")
    for name in ("alpha", "target_modules", "exclude_modules", "merge_for_rollout"):
        if getattr(model.lora, name) != getattr(LoraConfig(), name):
            c.add(f"worker.critic.model.lora.{name}", "is set, but LoRA adapters are for the actor only (the critic trains "
                  "its value head and backbone in full, worker.critic.model.lora.rank is 0); remove it")
    if model.tokenizer_path is not None:
        c.add("worker.critic.model.tokenizer_path", "is set, but the critic reads the token ids the actor's tokenizer "
              "made (worker.actor.model.tokenizer_path); remove it")


# ------------------------------------------------------------------------------------------- reward
def check_reward(c: Checks) -> None:
    r = c.cfg.worker.reward
    key = "worker.reward.reward_function"
    if r.reward_function and r.reward_functions:
        message = "is set together with worker.reward.reward_functions; use one: reward_function for one file, "
        c.add(key, message + "reward_functions for a weighted combination")
    elif not r.reward_function and not r.reward_functions:
        pure = ("; for pure distillation from a teacher keep a reward function (it scores the samples for the metrics and "
                "validation) and set algorithm.distill_only=true") if c.cfg.algorithm.distill.distill_coef > 0 else ""
        c.add(key, f"is unset: give the scoring function as path/to/file.py:func (e.g. ./my_reward.py:score){pure}")
    if r.reward_function:
        _check_spec(c, key, r.reward_function)
    _check_kwargs(c, "worker.reward.reward_function_kwargs", r.reward_function_kwargs)
    for i, item in enumerate(r.reward_functions):
        p = f"worker.reward.reward_functions[{i}]"
        if not item.reward_function:
            c.add(f"{p}.reward_function", "is empty: give path/to/file.py:func")
        else:
            _check_spec(c, f"{p}.reward_function", item.reward_function)
        _check_kwargs(c, f"{p}.reward_function_kwargs", item.reward_function_kwargs)
        if not is_finite_number(item.weight):
            c.add(f"{p}.weight", f"must be a finite number, got {item.weight}")
    c.at_least("worker.reward.num_cpus", 1)


def check_reward_model(c: Checks) -> None:
    p = "worker.reward_model"
    rm = c.cfg.worker.reward_model
    if not _check_optional_source(c, p, "reward_model.py", "reward model", "the reward model's score",
                                  f"{p}.model.model_path"):
        return
    if not rm.model.model_path:
        c.add(f"{p}.model.model_path", "is unset: give the huggingface/ directory that `python -m easyvlm.rm` exports "
              "(or another scalar sequence-classification model)")
    c.positive(f"{p}.micro_batch_size_per_device")
    check_fsdp(c, f"{p}.fsdp")


def check_judge(c: Checks) -> None:
    p = "worker.judge"
    j = c.cfg.worker.judge
    if not _check_optional_source(c, p, "judge.py", "judge", "the judge's score", f"{p}.model_path, template and parser"):
        return
    for key, example in (("model_path", "builtin:tiny-qwen2.5-vl or a model directory"),
                         ("template", "format_prompts/judge.jinja"), ("parser", "reward_functions/judge.py:parse_yes_no")):
        if not getattr(j, key):
            c.add(f"{p}.{key}", f"is unset: give {example}")
    if j.parser:
        _check_spec(c, f"{p}.parser", j.parser)
    for key in ("max_tokens", "max_prompt_length", "min_pixels", "max_pixels"):
        c.positive(f"{p}.{key}")
    if j.min_pixels and j.max_pixels and j.min_pixels > j.max_pixels:
        c.add(f"{p}.min_pixels", f"must be <= {p}.max_pixels ({j.max_pixels}), got {j.min_pixels}")


def _check_optional_source(c: Checks, p: str, reward_file: str, what: str, score: str, needs: str) -> bool:
    """Section ``p`` (``enable`` plus settings) of a score source that the shipped ``reward_file``
    returns. Off: every other key of the section and that reward file are refused (they would act
    nowhere). Returns whether the source is on (then its own checks run)."""
    section = c.get(p)
    if section.enable:
        return True
    keys = all_keys(type(section))
    leaves = [k for k in keys if k != "enable" and not any(o.startswith(k + ".") for o in keys)]
    changed = [k for k in leaves if differs(section, type(section)(), k)]
    if changed:
        c.add(f"{p}.{changed[0]}", f"is set but {p}.enable is false, so no {what} runs; "
              f"set {p}.enable=true (or remove the {p} keys)")
    specs = [c.cfg.worker.reward.reward_function] + [f.reward_function for f in c.cfg.worker.reward.reward_functions]
    users = [s for s in specs if s and Path(s.partition(":")[0]).name == reward_file]
    if users:
        c.add(f"{p}.enable", f"is false, but the reward function {users[0]} returns {score}; set {p}.enable=true "
              f"and {needs}")
    return False


def differs(obj: Any, default: Any, dotted: str) -> bool:
    for part in dotted.split("."):
        obj, default = getattr(obj, part), getattr(default, part)
    return obj != default


def _check_spec(c: Checks, key: str, spec: str) -> None:
    if not is_plugin_spec(spec):
        c.add(key, f"{spec!r} is not path/to/file.py:func (the file must end in .py)")
        return
    try:
        parse_plugin_spec(spec)
    except PluginError as exc:
        c.add(key, str(exc))


def _check_kwargs(c: Checks, key: str, kwargs: dict) -> None:
    bad = [k for k in kwargs if not (isinstance(k, str) and k.isidentifier())]
    if bad:
        c.add(key, f"keys are passed as keyword arguments, so they must be Python identifiers; not: {bad}")


# ------------------------------------------------------------------------------------------ rollout
def check_rollout(c: Checks) -> None:
    r = c.cfg.worker.rollout
    d = c.cfg.data
    p = "worker.rollout"
    c.at_least(f"{p}.n", 1)
    _check_sampling(c, p, {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k})
    if r.temperature == 0 and r.n > 1 and c.cfg.algorithm.adv_estimator in GROUP_ADV_ESTIMATORS:
        c.add(
            f"{p}.temperature",
            f"is 0 (greedy), so the {r.n} samples of a prompt are identical and "
            f"{c.cfg.algorithm.adv_estimator}'s advantages are all 0; use a temperature > 0 (e.g. 1.0)",
        )
    c.at_least(f"{p}.seed", 0)
    c.at_least(f"{p}.limit_images", 0, why=" (0 = no limit)")
    c.between(f"{p}.gpu_memory_utilization", 0.0, 1.0, low_open=True)
    c.at_least(f"{p}.max_num_seqs", 1)
    longest = d.max_prompt_length + d.max_response_length
    if c.at_least(f"{p}.tensor_parallel_size", 1):
        tp = r.tensor_parallel_size
        if c.cfg.trainer.n_gpus_per_node >= 1 and c.cfg.trainer.n_gpus_per_node % tp:
            c.add(
                f"{p}.tensor_parallel_size",
                f"({tp}) must divide trainer.n_gpus_per_node ({c.cfg.trainer.n_gpus_per_node}): a vLLM engine "
                "spans devices of one node",
            )
        if r.name == "hf" and tp != 1:
            message = f"must be 1 with worker.rollout.name=hf (transformers' generate is not tensor-parallel), got {tp}"
            c.add(f"{p}.tensor_parallel_size", message)
    if r.max_model_len is not None and r.max_model_len < longest:
        c.add(
            f"{p}.max_model_len",
            f"({r.max_model_len}) must be >= data.max_prompt_length + data.max_response_length = "
            f"{d.max_prompt_length} + {d.max_response_length} = {longest}; raise it or set null",
        )
    if not r.enable_chunked_prefill and r.max_num_batched_tokens < longest:
        c.add(
            f"{p}.max_num_batched_tokens",
            f"({r.max_num_batched_tokens}) must be >= data.max_prompt_length + data.max_response_length = {longest} "
            "(without chunked prefill a whole sequence is processed in one step); raise it or set "
            "worker.rollout.enable_chunked_prefill=true",
        )
    _check_val_override(c, r)
    _check_multi_turn(c, r)
    check_placement(c, r)


def _check_multi_turn(c: Checks, r: RolloutConfig) -> None:
    """worker.rollout.tools / environment and the keys that act only with them."""
    p = "worker.rollout"
    multi_turn = bool(r.tools) or r.environment is not None
    if r.tools and r.environment is not None:
        c.add(f"{p}.environment", "is set together with worker.rollout.tools; a run has tools or an environment, not both")
    for k, spec in enumerate(r.tools):
        if not isinstance(spec, str) or not spec:
            c.add(f"{p}.tools[{k}]", f"must be a shipped tool name or 'path/file.py:func', got {spec!r}")
        elif is_plugin_spec(spec):
            _check_spec(c, f"{p}.tools[{k}]", spec)
        elif spec not in SHIPPED_TOOLS:
            close = difflib.get_close_matches(spec, SHIPPED_TOOLS, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            c.add(f"{p}.tools[{k}]", f"unknown tool {spec!r}; {hint}shipped: {', '.join(SHIPPED_TOOLS)}, or your own "
                                    f"as 'path/to/file.py:func'")
    if r.environment is not None:
        _check_spec(c, f"{p}.environment", r.environment)
    defaults = RolloutConfig()
    if not multi_turn:
        for key in ("max_turns", "max_tokens_per_turn", "tool_timeout"):
            if getattr(r, key) != getattr(defaults, key):
                c.add(f"{p}.{key}", "acts only with worker.rollout.tools or worker.rollout.environment (multi-turn "
                                    "rollouts); set one of them, or leave this key at its default")
        return
    c.at_least(f"{p}.max_turns", 1)
    c.positive(f"{p}.tool_timeout")
    if r.max_tokens_per_turn is not None:
        c.between(f"{p}.max_tokens_per_turn", 1, c.cfg.data.max_response_length,
                  why=" (data.max_response_length bounds the whole trajectory)")
    if r.ignore_eos:
        c.add(f"{p}.ignore_eos", "must be false with tools or an environment: a model turn ends at its EOS")


def _check_sampling(c: Checks, p: str, values: dict[str, Any]) -> None:
    """Sampling values (those of ``values`` present: n, temperature, top_p, top_k) under prefix ``p``."""
    if "n" in values and values["n"] < 1:
        c.add(f"{p}.n", f"must be >= 1, got {values['n']}")
    temperature = values.get("temperature", 1.0)
    if not is_finite_number(temperature) or temperature < 0:
        c.add(f"{p}.temperature", f"must be a finite number >= 0 (0 = greedy), got {temperature}")
    top_p = values.get("top_p", 1.0)
    if not is_finite_number(top_p) or not 0 < top_p <= 1:
        c.add(f"{p}.top_p", f"must be in (0, 1] (1 = off), got {top_p}")
    if values.get("top_k", -1) < -1 or values.get("top_k") == 0:
        c.add(f"{p}.top_k", f"must be -1 (off) or a positive integer, got {values['top_k']}")


def _check_val_override(c: Checks, r: RolloutConfig) -> None:
    p = "worker.rollout.val_override_config"
    types = field_types(RolloutConfig)
    known = HF_SAMPLING_KEYS if r.name == "hf" else VLLM_SAMPLING_KEYS
    for key, value in r.val_override_config.items():
        if key in ENGINE_OWNED_SAMPLING_KEYS:
            c.add(f"{p}.{key}", "is set by easyvlm itself (the rollout returns token ids and the sampled token's "
                  "log-prob); remove it")
        elif key not in known:
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            if r.name == "hf" and key in VLLM_SAMPLING_KEYS:
                why = " with worker.rollout.name=hf (transformers' generate engine)"
            elif key in types:
                why = " (it configures the engine, which validation shares with training)"
            else:
                why = " (not a field of vLLM's SamplingParams)"
            c.add(f"{p}.{key}", f"cannot be overridden for validation{why}; {hint}valid keys: {', '.join(known)}")
        elif key in types and not matches(types[key], value):
            c.add(f"{p}.{key}", f"expected {describe(types[key])}, got {value!r}")
        elif key == "max_tokens" and not (isinstance(value, int) and 1 <= value <= c.cfg.data.max_response_length):
            c.add(f"{p}.max_tokens", f"must be an integer in [1, data.max_response_length={c.cfg.data.max_response_length}], "
                  f"got {value!r}")
    valid = {k: v for k, v in r.val_override_config.items() if k in types and k in known and matches(types[k], v)}
    _check_sampling(c, p, valid)
