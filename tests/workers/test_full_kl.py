"""``algorithm.kl_penalty=full``: KL(pi || pi_ref) summed over the vocabulary at each response token,
as a loss term (the reference's distribution computed per micro-batch in the actor's process) and in
the reward (``HybridWorker.compute_ref_logprobs(full_kl=True)``), against an independent computation
with two transformers models."""

from __future__ import annotations

import pytest
import torch
from plan_testing import plan_for
from workers_testing import PROMPTS, RESPONSE_LENGTHS, make_rl_batch

from easyvlm.workers.actor import ActorWorker
from easyvlm.workers.ref import RefWorker

TEMPERATURE = 0.8
NOISE = 0.05  # on the reference's LM head: the two policies differ, so the KL is not 0


@pytest.fixture(scope="module")
def batch(tiny_model_path):
    data = make_rl_batch(tiny_model_path, PROMPTS[:4], RESPONSE_LENGTHS[:4], seed=2)
    gen = torch.Generator().manual_seed(1)
    data["advantages"] = torch.where(data["response_mask"], torch.randn(data["responses"].shape, generator=gen), 0.0)
    return data


def noise_like(t: torch.Tensor) -> torch.Tensor:
    return NOISE * torch.randn(t.shape, generator=torch.Generator().manual_seed(3))


def expected_full_kl(model_dir: str, batch) -> torch.Tensor:
    """(B, T) per-token KL between the initial policy and the reference (initial + noise on lm_head),
    each over softmax(logits / T) without the blocked ids, one unpadded sample at a time."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from easyvlm.data.collate import concat_multi_modal_inputs
    from easyvlm.rollout.tokens import blocked_token_ids

    policy = AutoModelForImageTextToText.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    ref = AutoModelForImageTextToText.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    with torch.no_grad():
        ref.lm_head.weight.add_(noise_like(ref.lm_head.weight))
    blocked = blocked_token_ids(AutoTokenizer.from_pretrained(model_dir), policy.config)
    B, T = batch["responses"].shape
    P = batch["input_ids"].shape[1] - T
    out = torch.zeros(B, T)
    for b in range(B):
        keep = batch["attention_mask"][b].bool()
        ids = batch["input_ids"][b][keep].unsqueeze(0)
        pos = batch["position_ids"][b][..., keep][1:].unsqueeze(1)
        mm = concat_multi_modal_inputs([batch["multi_modal_inputs"][b]])
        logp = []
        for model in (policy, ref):
            with torch.no_grad():
                logits = model(input_ids=ids, position_ids=pos, **mm).logits[0].double() / TEMPERATURE
            logits[:, blocked] = float("-inf")
            logp.append(torch.log_softmax(logits, -1))
        p_b = int(batch["attention_mask"][b, :P].sum())
        for t in range(T):
            if batch["response_mask"][b, t]:
                lp, lq = logp[0][p_b - 1 + t], logp[1][p_b - 1 + t]
                allowed = torch.isfinite(lp)
                out[b, t] = (lp[allowed].exp() * (lp[allowed] - lq[allowed])).sum()
    return out


@pytest.fixture(scope="module")
def workers(process_group, tiny_model_path):
    plan = plan_for(
        tiny_model_path, "algorithm.disable_kl=false", "algorithm.use_kl_loss=true", "algorithm.kl_penalty=full",
        "algorithm.kl_coef=0.5", f"worker.rollout.temperature={TEMPERATURE}",
    )
    assert plan.actor.kl_loss is not None and plan.actor.kl_loss.kl_penalty == "full"
    actor = ActorWorker(plan.actor, rank=0, world_size=1)
    ref = RefWorker(plan.ref, rank=0, world_size=1)
    with torch.no_grad():
        weight = dict(ref.model.named_parameters())["lm_head.weight"]
        weight.to_local().add_(noise_like(weight))  # one rank: the local shard is the whole weight
    actor.reference_distribution = ref.log_distribution
    return actor, ref


def test_full_kl_in_the_reward_equals_an_independent_computation(workers, batch, tiny_model_path):
    actor, ref = workers
    kl = actor.full_kl(batch, ref.log_distribution)
    expected = expected_full_kl(tiny_model_path, batch)
    mask = batch["response_mask"]
    assert expected[mask].min() > 1e-4  # the noise makes the policies differ at every token
    torch.testing.assert_close(kl[mask], expected[mask].float(), rtol=1e-4, atol=1e-6)
    assert torch.all(kl[~mask] == 0)


def test_full_kl_loss_term(workers, batch, tiny_model_path):
    actor, _ = workers
    data = batch.copy()
    data["old_logprobs"] = actor.compute_logprobs(batch)["old_logprobs"]
    metrics = actor.update_policy(data)  # no ref_logprobs needed: the update asks the reference itself
    # loss_avg_mode token, one mini-batch: the token mean of the per-token KL at the initial weights
    expected = expected_full_kl(tiny_model_path, batch)[batch["response_mask"]].mean().item()
    assert metrics["actor/kl_loss"] == pytest.approx(expected, rel=1e-4)
