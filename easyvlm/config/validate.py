"""`validate(cfg)`: check a `PPOConfig` once, before anything starts, and report every problem,
each naming the full dotted key, what is wrong and how to fix it: types (for configs built in
Python), ranges and the cross-field rules. ``check_files=True`` also checks that local files the
config names exist (relative to the working directory).
"""

from __future__ import annotations

from pathlib import Path

from easyvlm.config.errors import ConfigError, Problem
from easyvlm.algorithms.rollout_correction_settings import (
    RolloutCorrectionConfig, parse_is_threshold, parse_rejection, staleness_correction,
)
from easyvlm.config.introspect import is_finite_number
from easyvlm.config.names import ADV_ESTIMATORS, GROUP_ADV_ESTIMATORS
from easyvlm.config.schema import PPOConfig
from easyvlm.config.worker_schema import RolloutConfig
from easyvlm.config.checks import Checks, check_fsdp, divisors, looks_local, name_or_spec, type_problems
from easyvlm.utils.compose import settings_problems
from easyvlm.config.validate_distill import check_distillation
from easyvlm.config.validate_workers import (
    check_actor, check_critic, check_judge, check_reward, check_reward_model, check_rollout, differs,
)
from easyvlm.utils.loggers import missing_logger_packages
from easyvlm.utils.plugins import is_plugin_spec

__all__ = ["ConfigError", "Problem", "find_problems", "notices", "validate"]

_DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".arrow")


def validate(cfg: PPOConfig, check_files: bool = False) -> None:
    """Raise `ConfigError` listing every problem of ``cfg``; return None if there is none."""
    problems = find_problems(cfg, check_files=check_files)
    if problems:
        raise ConfigError(problems)


def find_problems(cfg: PPOConfig, check_files: bool = False) -> list[Problem]:
    """Every problem of ``cfg`` (empty list: the config is valid)."""
    problems = type_problems(cfg, "")
    if problems:  # the value rules below assume the types are right
        return problems
    c = Checks(cfg, cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node, cfg.worker.rollout.n)
    for key, message in settings_problems(cfg):  # each component's rules about its own keys
        c.add(key, message)
    _check_data(c)
    _check_algorithm(c)
    check_actor(c)
    if c.get("algorithm.adv_estimator") == "gae":  # the critic exists only for gae
        check_critic(c)
    check_reward(c)
    check_reward_model(c)
    check_judge(c)
    check_rollout(c)
    check_distillation(c)
    _check_trainer(c)
    check_fsdp(c, "worker.ref.fsdp")
    if cfg.worker.ref.offload.offload_optimizer:
        c.add("worker.ref.offload.offload_optimizer", "is true, but the reference model is never trained and has no "
              "optimizer; remove the key (worker.ref.offload.offload_params moves its weights)")
    if cfg.trainer.critic_warmup > 0 and cfg.algorithm.adv_estimator != "gae":
        c.add("trainer.critic_warmup", f"is {cfg.trainer.critic_warmup}, but there is no critic to warm up "
              f"(algorithm.adv_estimator={cfg.algorithm.adv_estimator}): the actor would just not learn for that many "
              "steps; set 0, or use gae")
    if not cfg.worker.hybrid_engine:
        c.add("worker.hybrid_engine", "is false, but the actor and the reference model always share each device "
              "(EasyR1's hybrid engine); to give the rollout engines devices of their own set "
              "worker.rollout.placement=separate, and remove this key (true is the default)")
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
    rc, k = a.rollout_correction, r.placement_settings.staleness
    if k > 0 and not (rc.active or rc.bypass_mode):
        key = "worker.rollout.one_step_off=true" if r.one_step_off else f"worker.rollout.max_staleness={r.max_staleness}"
        if r.correct_staleness:
            lines.append(f"{key}: samples up to {k} update(s) old are trained with token-level "
                         "importance weights pi_old / pi_rollout (algorithm.rollout_correction.rollout_is=token, "
                         "decoupled PPO); worker.rollout.correct_staleness=false trains them as if fresh")
        else:
            lines.append(f"{key} trains on samples from weights up to {k} step(s) old with no "
                         "rollout correction (worker.rollout.correct_staleness=false)")
    return lines


# --------------------------------------------------------------------------------------------- data
def _check_data(c: Checks) -> None:
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
                f"{divisors(d.rollout_batch_size)} or null",
            )
        if mini is not None and mini > d.rollout_batch_size and not c.cfg.algorithm.online_filtering:
            c.add(
                "data.mini_rollout_batch_size",
                f"({mini}) is larger than data.rollout_batch_size ({d.rollout_batch_size}) without online filtering, "
                "so the extra prompts would be generated and thrown away; set it to null or a divisor of "
                "data.rollout_batch_size (or turn on algorithm.online_filtering)",
            )


# ---------------------------------------------------------------------------------------- algorithm
def _check_algorithm(c: Checks) -> None:
    a = c.cfg.algorithm
    name_or_spec(c, "algorithm.adv_estimator", ADV_ESTIMATORS, "advantage estimator")
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

    if a.use_bias_correction_kl and (a.disable_kl or not a.use_kl_loss):
        c.add("algorithm.use_bias_correction_kl", "weighs the KL *loss* by pi_theta / pi_old, but "
              f"{'algorithm.disable_kl=true' if a.disable_kl else 'algorithm.use_kl_loss=false'} leaves no KL loss; "
              "set use_kl_loss=true (and disable_kl=false), or remove use_bias_correction_kl")
    elif a.use_bias_correction_kl and a.kl_penalty == "full":
        c.add("algorithm.use_bias_correction_kl", "corrects a sampled KL estimate, but algorithm.kl_penalty=full is "
              "exact (a sum over the vocabulary); use kl_penalty=low_var_kl, or remove use_bias_correction_kl")

    std_divided = ("grpo", "grpo_passk", "gigpo")
    if not a.norm_adv_by_std_in_grpo and a.adv_estimator in ADV_ESTIMATORS and a.adv_estimator not in std_divided:
        c.add("algorithm.norm_adv_by_std_in_grpo", f"is false, but algorithm.adv_estimator={a.adv_estimator} does not "
              "divide by a group std (only grpo, grpo_passk and gigpo do); remove it, or use adv_estimator=grpo for "
              "Dr. GRPO")
    if a.adv_estimator == "gigpo" and c.cfg.worker.rollout.environment is None:
        c.add("algorithm.adv_estimator", "is gigpo, whose step-level advantages compare the steps of an environment's "
              "episodes, but worker.rollout.environment is unset; set it (e.g. "
              "examples/environments/gui.py:GuiEnvironment), or use adv_estimator=grpo")

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
    _check_multi_objective(c)
    if a.online_filtering:
        if not a.filter_key:
            c.add("algorithm.filter_key", "must name a reward key (e.g. overall) when online filtering is on")
        if not (is_finite_number(a.filter_low) and is_finite_number(a.filter_high)) or a.filter_low >= a.filter_high:
            c.add(
                "algorithm.filter_low",
                f"({a.filter_low}) must be below algorithm.filter_high ({a.filter_high}): online filtering keeps "
                "prompts whose mean reward lies between them",
            )


def _check_multi_objective(c: Checks) -> None:
    """normalize_then_sum (GDPO) needs several reward functions and an estimator that takes one
    score per sample (docs/algorithms.md, "Several reward functions")."""
    a, key = c.cfg.algorithm, "algorithm.multi_objective_aggregation"
    if a.multi_objective_aggregation != "normalize_then_sum":
        return
    fix = f"; or set {key}=sum_then_normalize (the default)"
    r = c.cfg.worker.reward
    n = len(r.reward_functions) or int(bool(r.reward_function))
    if n < 2:
        source = "worker.reward.reward_functions" if r.reward_functions else "worker.reward.reward_function"
        c.add(key, f"is normalize_then_sum, but the reward has {n} function(s) ({source}), and normalising each "
              f"function's score before the weighted sum needs two or more; list them (with their weights) in "
              f"worker.reward.reward_functions{fix}")
    if a.adv_estimator in ("gae", "remax"):
        why = ("gae's critic learns the values of the token rewards, and a score normalised against the other samples "
               "of its group and batch is no reward of the sample itself" if a.adv_estimator == "gae" else
               "remax's baseline is the greedy response's weighted-sum score, which has no group to be normalised in")
        c.add(key, f"is normalize_then_sum, but algorithm.adv_estimator={a.adv_estimator}: {why}; use an outcome "
              f"estimator such as grpo, rloo or reinforce_plus_plus_baseline{fix}")
    if a.adv_estimator == "grpo" and not a.disable_kl and not a.use_kl_loss:
        c.add(key, "is normalize_then_sum with algorithm.adv_estimator=grpo, whose advantage is then GDPO's score "
              "itself, so the KL penalty in the token rewards (algorithm.use_kl_loss=false) would be lost; set "
              f"algorithm.use_kl_loss=true (the KL as a loss term, as TRL and GDPO) or algorithm.disable_kl=true{fix}")
    if a.adv_estimator == "grpo" and not a.norm_adv_by_std_in_grpo:
        c.add(key, "is normalize_then_sum, which divides by the std within each group and over the batch, so "
              "algorithm.norm_adv_by_std_in_grpo=false (Dr. GRPO) would do nothing; set norm_adv_by_std_in_grpo=true"
              f"{fix}")


def _check_rollout_correction(c: Checks) -> None:
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
    # the weights the run trains with: rollout_is, or the staleness correction's (the plan's rule);
    # without them the threshold still caps the one-sample distillation loss's off-policy weight
    d, r = c.cfg.algorithm.distill, c.cfg.worker.rollout
    weights = staleness_correction(rc, r.placement_settings.staleness, r.correct_staleness).rollout_is
    acting = ("rollout_is_threshold",) if d.distill_coef > 0 and not (d.distill_as_reward or d.distill_full_kl) else ()
    if weights is None:
        for key in ("rollout_is_threshold", "rollout_is_batch_normalize"):
            if differs(rc, RolloutCorrectionConfig(), key) and key not in acting:
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


# ------------------------------------------------------------------------------------------ trainer
def _check_trainer(c: Checks) -> None:
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


# ----------------------------------------------------------------------------------------- packages
def _check_packages(c: Checks) -> None:
    """Optional packages the config asks for must be installed (checked without importing them)."""
    for logger, requirement in missing_logger_packages(c.cfg.trainer.logger).items():
        c.add("trainer.logger", f"lists {logger!r}, but its package is not installed: pip install '{requirement}' "
              f"(or remove {logger!r} from trainer.logger)")


# -------------------------------------------------------------------------------------------- files
def _check_files(c: Checks) -> None:
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
            if looks_local(path) or path.endswith(_DATA_SUFFIXES):
                must_exist(key, path, "data file or directory")
    must_exist("data.format_prompt", cfg.data.format_prompt, "format prompt file")
    must_exist("data.image_dir", cfg.data.image_dir, "image directory", is_dir=True)
    judge = cfg.worker.judge
    if judge.enable:
        must_exist("worker.judge.template", judge.template, "judge template file")
        if judge.model_path and not judge.model_path.startswith("builtin:") and looks_local(judge.model_path):
            must_exist("worker.judge.model_path", judge.model_path, "model directory", is_dir=True)
        if judge.parser and is_plugin_spec(judge.parser):
            must_exist("worker.judge.parser", judge.parser.partition(":")[0], "file")
    rm_path = cfg.worker.reward_model.model.model_path
    if cfg.worker.reward_model.enable and rm_path and not rm_path.startswith("builtin:") and looks_local(rm_path):
        must_exist("worker.reward_model.model.model_path", rm_path, "model directory", is_dir=True)
    teacher_path = cfg.worker.teacher.model.model_path
    if cfg.worker.teacher.enable and teacher_path and not teacher_path.startswith("builtin:") and looks_local(teacher_path):
        must_exist("worker.teacher.model.model_path", teacher_path, "model directory", is_dir=True)
    roles = ["actor"] + (["critic"] if cfg.algorithm.adv_estimator == "gae" else [])
    for role in roles:
        model = c.get(f"worker.{role}.model")
        for name in ("model_path", "tokenizer_path"):
            value = getattr(model, name)
            if value and not value.startswith("builtin:") and looks_local(value):
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

