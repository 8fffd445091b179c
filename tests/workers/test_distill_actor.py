"""On-policy distillation in the workers: the teacher's pass (``worker.teacher``, a RefWorker on its
own model returning ``teacher_logprobs``) and the actor's distillation term (one-sample and full
reverse KL, ``algorithm.distill_*``), against an independent computation with two transformers
models: the student (the tiny model) and a teacher (the same model with noise on its LM head, so the
two distributions differ at every token)."""

from __future__ import annotations

import math

import pytest
import torch
from plan_testing import plan_for
from teacher_testing import padded_teacher
from workers_testing import PROMPTS, RESPONSE_LENGTHS, make_rl_batch

from easyvlm.workers.actor import ActorWorker
from easyvlm.workers.ref import RefWorker

TEMPERATURE = 0.8
NOISE = 0.05  # on the teacher's LM head
COEF = 0.5


def teacher_args(model_dir: str, *extra: str) -> tuple[str, ...]:
    return ("algorithm.disable_kl=true", f"algorithm.distill_coef={COEF}", "worker.teacher.enable=true",
            f"worker.teacher.model.model_path={model_dir}", f"worker.rollout.temperature={TEMPERATURE}", *extra)


@pytest.fixture(scope="module")
def batch(tiny_model_path):
    # two groups of two samples: the samples of a prompt share its pass (share_prompts), as in training
    data = make_rl_batch(tiny_model_path, PROMPTS[:2], RESPONSE_LENGTHS[:4], seed=2, n=2)
    gen = torch.Generator().manual_seed(1)
    data["advantages"] = torch.where(data["response_mask"], torch.randn(data["responses"].shape, generator=gen), 0.0)
    return data


def noisy(weight: torch.Tensor) -> None:
    weight.add_(NOISE * torch.randn(weight.shape, generator=torch.Generator().manual_seed(3)))


def log_distributions(model_dir: str, batch) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per sample: (R_b, V) float64 log-distributions softmax(logits / T) without the blocked ids of
    the student and the teacher at the sample's R_b valid response positions, and the sampled ids."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from easyvlm.data.collate import concat_multi_modal_inputs
    from easyvlm.rollout.tokens import blocked_token_ids

    student = AutoModelForImageTextToText.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    teacher = AutoModelForImageTextToText.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    with torch.no_grad():
        noisy(teacher.lm_head.weight)
    blocked = blocked_token_ids(AutoTokenizer.from_pretrained(model_dir), student.config)
    T = batch["responses"].shape[1]
    P = batch["input_ids"].shape[1] - T
    out: tuple[list, list, list] = ([], [], [])
    for b in range(len(batch)):
        keep = batch["attention_mask"][b].bool()
        ids = batch["input_ids"][b][keep].unsqueeze(0)
        pos = batch["position_ids"][b][..., keep][1:].unsqueeze(1)
        mm = concat_multi_modal_inputs([batch["multi_modal_inputs"][b]])
        p_b = int(batch["attention_mask"][b, :P].sum())
        rows = [p_b - 1 + t for t in range(T) if batch["response_mask"][b, t]]
        for i, model in enumerate((student, teacher)):
            with torch.no_grad():
                logits = model(input_ids=ids, position_ids=pos, **mm).logits[0].double() / TEMPERATURE
            logits[:, blocked] = float("-inf")
            out[i].append(torch.log_softmax(logits, -1)[rows])
        out[2].append(batch["responses"][b][batch["response_mask"][b]])
    return out


@pytest.fixture(scope="module")
def expected(tiny_model_path, batch):
    """Token means over the batch's valid tokens: the one-sample reverse KL, the full reverse KL and
    the teacher's log-prob of the sampled tokens; and the teacher's (B, T) log-probs."""
    students, teachers, sampled = log_distributions(tiny_model_path, batch)
    one_sample, full, teacher_lp = [], [], []
    for s, t, y in zip(students, teachers, sampled):
        s_y, t_y = s.gather(1, y[:, None])[:, 0], t.gather(1, y[:, None])[:, 0]
        one_sample.append(s_y - t_y)
        teacher_lp.append(t_y)
        allowed = torch.isfinite(s)
        full.append(torch.where(allowed, s.exp() * (s - t), torch.zeros_like(s)).sum(-1))
    per_token = torch.zeros(batch["responses"].shape, dtype=torch.float64)
    per_token[batch["response_mask"]] = torch.cat(teacher_lp)
    return {"one_sample": torch.cat(one_sample).mean().item(), "full": torch.cat(full).mean().item(),
            "teacher_logprob": torch.cat(teacher_lp).mean().item(), "teacher_logprobs": per_token}


def make_teacher(plan) -> RefWorker:
    teacher = RefWorker(plan.teacher, rank=0, world_size=1, output="teacher_logprobs", section="worker.teacher")
    with torch.no_grad():
        noisy(dict(teacher.model.named_parameters())["lm_head.weight"].to_local())  # one rank: the whole weight
    return teacher


def test_the_teachers_log_probs_are_its_models_forward(process_group, tiny_model_path, batch, expected):
    teacher = make_teacher(plan_for(tiny_model_path, *teacher_args(tiny_model_path)))
    out = teacher.compute_ref_logprobs(batch)
    assert list(out.keys()) == ["teacher_logprobs"]
    mask = batch["response_mask"]
    torch.testing.assert_close(out["teacher_logprobs"][mask], expected["teacher_logprobs"][mask].float(),
                               rtol=1e-5, atol=1e-5)
    assert torch.all(out["teacher_logprobs"][~mask] == 0)


@pytest.mark.parametrize("full_kl", [False, True])
def test_the_distillation_term_is_the_reverse_kl_to_the_teacher(process_group, tiny_model_path, batch, expected, full_kl):
    plan = plan_for(tiny_model_path, *teacher_args(tiny_model_path, f"algorithm.distill_full_kl={full_kl}"))
    assert plan.actor.distill is not None and plan.actor.distill.distill_full_kl is full_kl
    actor, teacher = ActorWorker(plan.actor, rank=0, world_size=1), make_teacher(plan)
    actor.teacher_distribution = teacher.log_distribution
    data = batch.union(teacher.compute_ref_logprobs(batch))
    metrics = actor.update_policy(data)  # on-policy: one mini-batch, the update's pass at the sampling weights
    # loss_avg_mode token, one mini-batch, weights before the step: the token means of the hand values
    kl = expected["full" if full_kl else "one_sample"]
    assert abs(kl) > 1e-3  # the teacher differs from the student
    assert metrics["distill/reverse_kl"] == pytest.approx(kl, rel=1e-4, abs=1e-6)
    assert metrics["actor/distill_loss"] == pytest.approx(kl, rel=1e-4, abs=1e-6)
    assert metrics["distill/teacher_logprob"] == pytest.approx(expected["teacher_logprob"], rel=1e-5)
    assert "actor/pg_loss" in metrics  # RL plus distillation: the policy term is there


@pytest.mark.parametrize(("shift", "threshold", "weight"), [(math.log(1.5), "2.0", 1.5), (math.log(3.0), "2.5", 2.5)])
def test_off_policy_tokens_weight_the_one_sample_loss(process_group, tiny_model_path, batch, expected, shift, threshold,
                                                      weight):
    """Old log-probs ``shift`` below the student's on every token (a behaviour policy that liked the
    samples less): each token's weight pi_s / pi_b = e^shift, truncated at the upper bound of
    algorithm.rollout_correction.rollout_is_threshold (1.5 under 2.0; 3 capped at 2.5), so the loss
    is that times the on-policy one; the one-sample estimate logged as distill/reverse_kl is not weighted."""
    plan = plan_for(tiny_model_path, *teacher_args(tiny_model_path,
                                                   f"algorithm.rollout_correction.rollout_is_threshold={threshold}"))
    actor, teacher = ActorWorker(plan.actor, rank=0, world_size=1), make_teacher(plan)
    data = batch.union(teacher.compute_ref_logprobs(batch))
    data["old_logprobs"] = actor.compute_logprobs(data)["old_logprobs"] - shift
    metrics = actor.update_policy(data)  # one mini-batch: the update's pass is at the weights of compute_logprobs
    assert metrics["actor/distill_loss"] == pytest.approx(weight * expected["one_sample"], rel=1e-4, abs=1e-6)
    assert metrics["distill/reverse_kl"] == pytest.approx(expected["one_sample"], rel=1e-4, abs=1e-6)


def test_a_teacher_padded_past_the_tokenizer_is_the_student_on_the_shared_rows(process_group, tiny_model_path, batch,
                                                                              tmp_path):
    """The student's own model with 8 output rows past the tokenizer (resize_token_embeddings puts
    them near the mean of the others: unblocked they would take ~8/272 of the mass, shifting every
    log-prob by ~0.03). The teacher blocks them, so its log-probs of the sampled tokens are the
    student's, and the full KL over the 264 shared rows (the student's 264 against its 272) is 0."""
    teacher_dir = padded_teacher(tiny_model_path, 8, tmp_path / "padded")
    plan = plan_for(tiny_model_path, *teacher_args(str(teacher_dir), "algorithm.distill_full_kl=true"))
    actor = ActorWorker(plan.actor, rank=0, world_size=1)
    teacher = RefWorker(plan.teacher, rank=0, world_size=1, output="teacher_logprobs", section="worker.teacher")
    actor.teacher_distribution = teacher.log_distribution
    assert teacher.log_distribution(batch).shape[-1] == 272
    data = batch.union(teacher.compute_ref_logprobs(batch))
    mask = batch["response_mask"]
    student = actor.compute_logprobs(batch)["old_logprobs"]
    torch.testing.assert_close(data["teacher_logprobs"][mask], student[mask], rtol=0, atol=1e-5)
    metrics = actor.update_policy(data)
    assert abs(metrics["distill/reverse_kl"]) < 1e-6 and abs(metrics["actor/distill_loss"]) < 1e-6


def test_pure_distillation_takes_no_gradient_from_the_advantages(process_group, tiny_model_path, batch):
    """distill_only as a loss: the update is the same whatever the advantages."""
    plan = plan_for(tiny_model_path, *teacher_args(tiny_model_path, "algorithm.distill_only=true"))
    assert plan.actor.policy_gradient is False
    teacher = make_teacher(plan)
    data = batch.union(teacher.compute_ref_logprobs(batch))
    weights = []
    for advantages in (data["advantages"], torch.zeros_like(data["advantages"])):
        actor = ActorWorker(plan.actor, rank=0, world_size=1)
        step_data = data.copy()
        step_data["advantages"] = advantages
        metrics = actor.update_policy(step_data)
        assert "actor/pg_loss" not in metrics and metrics["actor/distill_loss"] > 0
        weights.append({k: v.full_tensor().clone() for k, v in actor.model.state_dict().items()})
    changed = [k for k in weights[0] if not torch.equal(weights[0][k], weights[1][k])]
    assert changed == []
    # and the step moved the weights (the distillation term has a gradient)
    start = ActorWorker(plan.actor, rank=0, world_size=1).model.state_dict()
    assert any(not torch.equal(start[k].full_tensor(), weights[0][k]) for k in weights[0])


def test_teacher_keys_reach_the_teacher_spec(tiny_model_path):
    spec = plan_for(
        tiny_model_path, *teacher_args(tiny_model_path),
        "worker.teacher.model.attn_implementation=eager", "worker.teacher.model.trust_remote_code=true",
        "worker.teacher.model.override_config={text_config: {rms_norm_eps: 0.001}}",
        "worker.teacher.fsdp.enable_full_shard=false", "worker.teacher.fsdp.enable_cpu_offload=true",
        "worker.teacher.fsdp.enable_rank0_init=false", "worker.teacher.fsdp.use_orig_params=true",
        "worker.teacher.fsdp.torch_dtype=bf16", "worker.teacher.fsdp.fsdp_size=1",
        "worker.teacher.fsdp.mp_param_dtype=fp32", "worker.teacher.fsdp.mp_reduce_dtype=bf16",
        "worker.teacher.fsdp.mp_buffer_dtype=bf16", "worker.teacher.offload.offload_params=true",
    ).teacher
    assert spec.model.model_dir == tiny_model_path
    assert spec.model.attn_implementation == "eager" and spec.model.trust_remote_code
    assert spec.model.hf_config.get_text_config().rms_norm_eps == 0.001
    assert spec.model.lora is None and not spec.model.gradient_checkpointing  # frozen: no adapters, no recompute
    assert (spec.fsdp.enable_full_shard, spec.fsdp.enable_cpu_offload, spec.fsdp.enable_rank0_init, spec.fsdp.use_orig_params,
            spec.fsdp.torch_dtype, spec.fsdp.fsdp_size) == (False, True, False, True, "bf16", 1)
    assert (spec.fsdp.mp_param_dtype, spec.fsdp.mp_reduce_dtype, spec.fsdp.mp_buffer_dtype) == ("fp32", "bf16", "bf16")
    assert spec.offload.offload_params
    # the actor's forward settings, the teacher's own experts (no router replay of the student's)
    default = plan_for(tiny_model_path, *teacher_args(tiny_model_path))
    assert default.teacher.forward.experience == default.actor.forward.experience
    assert default.teacher.forward.router_replay == "disabled"
    assert not default.teacher.offload.offload_params and default.teacher.model.attn_implementation == "sdpa"
    assert plan_for(tiny_model_path).teacher is None  # off by default


def test_distillation_steps_bring_the_student_closer_to_the_teacher(process_group, tiny_model_path, batch):
    """Pure distillation with the exact KL, three optimizer steps on a batch: the reverse KL on that
    batch falls (0.245 -> 0.152 here). Not asserted for the one-sample form: its gradient is the KL's
    only in expectation over the samples (tests/algorithms/test_distill_loss.py enumerates it), and
    on a batch of ~20 tokens under Adam its noise can move the KL either way."""
    full_kl = True
    from easyvlm.algorithms.kl import kl_full

    plan = plan_for(tiny_model_path, *teacher_args(tiny_model_path, "algorithm.distill_only=true",
                                                   f"algorithm.distill_full_kl={full_kl}"))
    actor, teacher = ActorWorker(plan.actor, rank=0, world_size=1), make_teacher(plan)
    actor.teacher_distribution = teacher.log_distribution
    data = batch.union(teacher.compute_ref_logprobs(batch))

    def reverse_kl() -> float:
        from easyvlm.workers.forward import policy_log_distribution

        with torch.no_grad():
            student = policy_log_distribution(actor.model, batch, actor.setup)
            return float(kl_full(student[None], teacher.log_distribution(batch)[None]).mean())

    before = reverse_kl()
    for _ in range(3):
        actor.update_policy(data)
    after = reverse_kl()
    print(f"reverse KL {before:.4f} -> {after:.4f}")
    assert after < 0.9 * before
