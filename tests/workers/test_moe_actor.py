"""The actor on the builtin MoE models (tiny Qwen3.5-MoE, tiny Qwen3-VL-MoE): router replay
(``worker.actor.router_replay``), the load-balancing loss (``worker.actor.router_aux_loss_coef``) and
the expert-load metrics.

References: transformers' unmodified model (its routers' top-k of ``output_router_logits``, its
``aux_loss``), never easyvlm's own routing code.
"""

from __future__ import annotations

import pytest
import torch
from test_actor import weights, with_training_keys
from workers_testing import PROMPTS, RESPONSE_LENGTHS, actor_spec, make_rl_batch

from easyvlm.data.batch import ROUTED_EXPERTS_KEY
from easyvlm.models.moe_routing import FREE, ReplayRouter
from easyvlm.workers.actor import ActorWorker

MODELS = ["tiny-qwen3.5-moe", "tiny-qwen3-vl-moe"]


@pytest.fixture(scope="module", params=MODELS)
def model_dir(request, easyvlm_cache_dir) -> str:
    from easyvlm.builtin.models import materialize_model

    return str(materialize_model(request.param, cache_dir=easyvlm_cache_dir))


@pytest.fixture(scope="module")
def batch(model_dir):
    # two image prompts (no vision dummy row: every token is a sample's) and two text-only ones
    return make_rl_batch(model_dir, [PROMPTS[0], PROMPTS[1], PROMPTS[4], PROMPTS[6]], RESPONSE_LENGTHS[:4])


def make_actor(model_dir: str, **overrides) -> ActorWorker:
    return ActorWorker(actor_spec(model_dir, **overrides), rank=0, world_size=1)


def transformers_routing(model_dir: str, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """((B, L, layers, 2) top-2 experts of transformers' own routers on the padded batch, the
    model's aux_loss over the attended tokens), from ``output_router_logits``."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    items = batch["multi_modal_inputs"]
    extra = {"pixel_values": torch.cat([i["pixel_values"] for i in items]),
             "image_grid_thw": torch.cat([i["image_grid_thw"] for i in items])}
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long(),
                    position_ids=batch["position_ids"].transpose(0, 1), output_router_logits=True, **extra)
    B, L = batch["input_ids"].shape
    top = torch.stack([logits.topk(2, dim=-1).indices for logits in out.router_logits], dim=1)  # (B*L, layers, 2)
    return top.reshape(B, L, *top.shape[1:]), out.aux_loss


@pytest.mark.parametrize("padding_free", [False, True])
def test_r2_records_the_routers_choices(process_group, model_dir, batch, padding_free):
    """The old-log-prob pass (R2) returns each attended token's experts: those transformers' own
    routers pick (as sets: the order of two experts is the top-k's), FREE at padding."""
    actor = make_actor(model_dir, padding_free=padding_free, router_replay="R2")
    routed = actor.compute_logprobs(batch)[ROUTED_EXPERTS_KEY]
    expected, _ = transformers_routing(model_dir, batch)
    mask = batch["attention_mask"].bool()
    assert routed.dtype == torch.int16 and routed.shape == expected.shape
    assert torch.equal(routed[mask].long().sort(-1).values, expected[mask].sort(-1).values)
    assert bool((routed[~mask] == FREE).all())


def test_no_record_without_r2(process_group, model_dir, batch):
    assert ROUTED_EXPERTS_KEY not in make_actor(model_dir).compute_logprobs(batch)


def _drift_routers(actor: ActorWorker, scale: float = 2.0) -> None:
    """Move every router's weights as a large update would."""
    torch.manual_seed(0)
    with torch.no_grad():
        for module in actor.model.modules():
            if isinstance(module, ReplayRouter):
                module.weight.add_(torch.randn_like(module.weight) * module.weight.std() * scale)


@pytest.mark.parametrize("mode", ["R2", "disabled"])
def test_the_update_replays_the_recorded_experts(process_group, model_dir, batch, mode):
    """Record (R2), drift the routers, update: with R2 the update's forward routes every attended
    token to its recorded experts; with replay disabled the drifted routers pick others."""
    actor = make_actor(model_dir, router_replay=mode, global_batch_size=4, micro_batch_size_per_device_for_update=4)
    recorder = make_actor(model_dir, router_replay="R2")
    out = recorder.compute_logprobs(batch)
    data = with_training_keys(batch, out["old_logprobs"])
    data[ROUTED_EXPERTS_KEY] = out[ROUTED_EXPERTS_KEY]
    _drift_routers(actor)
    actor.update_policy(data)
    used = actor.routing.batch_routing[: len(batch)]  # the update's only micro-batch (then the vision dummy's row)
    mask = batch["attention_mask"].bool()
    same = torch.equal(used[mask], out[ROUTED_EXPERTS_KEY][mask])
    assert same if mode == "R2" else not same


def test_routing_mismatch_is_the_share_routed_unlike_the_record(process_group, model_dir, batch):
    """actor/moe/routing_mismatch: the share of the samples' tokens whose experts the (drifted)
    routers would choose differ from the batch's record, as sets of 2, in any layer. The reference
    is the update of an actor that routes freely (disabled), whose choices are its batch_routing;
    every attended token (no vision dummy row here) counts. With R2 the update replays the record
    and the metric compares each router's own choice, which from the second layer on sees the
    replayed history: no free forward gives it, so only its range is checked there."""
    recorder = make_actor(model_dir, router_replay="R2")
    out = recorder.compute_logprobs(batch)
    data = with_training_keys(batch, out["old_logprobs"])
    data[ROUTED_EXPERTS_KEY] = out[ROUTED_EXPERTS_KEY]
    mask = batch["attention_mask"].bool()
    shares = {}
    for mode in ("disabled", "R2"):
        actor = make_actor(model_dir, router_replay=mode, global_batch_size=4, micro_batch_size_per_device_for_update=4)
        _drift_routers(actor, scale=0.3)  # seeded: both actors' routers drift alike; some tokens move
        shares[mode] = actor.update_policy(data)["actor/moe/routing_mismatch"]
        if mode == "disabled":
            free = actor.routing.batch_routing[: len(batch)][mask].long().sort(-1).values
            differs = (free != out[ROUTED_EXPERTS_KEY][mask].long().sort(-1).values).any(-1).any(-1)
            expected = float(differs.sum()) / int(mask.sum())
    # measured: 0.65 (Qwen3.5-MoE) and 0.51 (Qwen3-VL-MoE) of 171 tokens; R2 0.65 and 0.51 (one token fewer)
    assert 0 < expected < 1  # the drift moves some tokens' experts, not all
    assert shares["disabled"] == pytest.approx(expected, abs=1e-12)
    assert 0 < shares["R2"] < 1
    # without a record in the batch nothing is compared
    plain = make_actor(model_dir, router_replay="disabled", global_batch_size=4, micro_batch_size_per_device_for_update=4)
    assert "actor/moe/routing_mismatch" not in plain.update_policy(with_training_keys(batch, out["old_logprobs"]))


def test_aux_loss_is_the_models_and_trains_the_router(process_group, model_dir, batch):
    """actor/moe/aux_loss is transformers' aux_loss over the batch's tokens (one micro-batch, no
    shared prompts: the same tokens); with coefficient 0 the router weights take another step than
    with 1.0, and the expert-load metrics are in [0, E / k] with the busiest expert above 1."""
    _, expected = transformers_routing(model_dir, batch)
    data = with_training_keys(batch, make_actor(model_dir).compute_logprobs(batch)["old_logprobs"])
    common = dict(global_batch_size=4, micro_batch_size_per_device_for_update=4, share_prompts=False, lr=1e-2)
    on = make_actor(model_dir, router_aux_loss_coef=1.0, **common)
    off = make_actor(model_dir, router_aux_loss_coef=0.0, **common)
    metrics = on.update_policy(data)
    off_metrics = off.update_policy(data)
    assert metrics["actor/moe/aux_loss"] == pytest.approx(float(expected), rel=1e-5)
    assert "actor/moe/aux_loss" not in off_metrics
    assert 1.0 < metrics["actor/moe/expert_load_max"] <= 2.0 and 0.0 <= metrics["actor/moe/expert_load_min"] < 1.0
    after_on, after_off = weights(on), weights(off)
    gate = [k for k in after_on if k.endswith("mlp.gate.weight")]
    assert gate and all(not torch.equal(after_on[k], after_off[k]) for k in gate)


def test_default_coefficient_is_the_models(model_dir):
    from transformers import AutoConfig

    spec = actor_spec(model_dir)
    assert spec.router_aux_loss_coef == AutoConfig.from_pretrained(model_dir).get_text_config().router_aux_loss_coef


def test_router_replay_reaches_the_policy_passes(model_dir):
    """R2: the actor records and replays, the reference routes freely (it runs on the batch before the
    old pass recorded anything, and R2 replays in the update only); R3: both replay the sampler's."""
    from plan_testing import plan_for

    for mode, ref_mode in (("disabled", "disabled"), ("R2", "disabled"), ("R3", "R3")):
        plan = plan_for(model_dir, f"worker.actor.router_replay={mode}", "worker.rollout.name=hf")
        assert (plan.actor.forward.router_replay, plan.ref.forward.router_replay) == (mode, ref_mode)


def test_r3_closes_the_gap_of_a_drifted_sampler_router(process_group, model_dir):
    """The sampler's routers differ from the trainer's (as when an engine routes near-ties its own
    way): the trainer's log-probs of the samples are further from the sampler's when it routes by
    itself (disabled) than when it replays the sampler's experts (R3), where only the routing
    weights (the trainer's router probabilities of those experts) still differ."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
    from rollout_helpers import default_prompts, rollout_plan
    from transformers import AutoConfig, AutoProcessor

    from easyvlm.algorithms.rollout_mismatch import rollout_mismatch
    from easyvlm.rollout.factory import build_rollout

    engine = build_rollout(rollout_plan(model_dir, 8, "worker.rollout.name=hf", "worker.actor.router_replay=R3").rollout)
    torch.manual_seed(1)
    drifted = {name: tensor + torch.randn_like(tensor) * tensor.std() * 0.5
               for name, tensor in engine.model.state_dict().items() if name.endswith("mlp.gate.weight")}
    engine.update_weights(drifted.items())
    prompts = default_prompts(AutoProcessor.from_pretrained(model_dir), AutoConfig.from_pretrained(model_dir))
    samples = engine.generate(prompts.repeat(4, interleave=True))
    k3 = {}
    for mode in ("disabled", "R3"):
        actor = make_actor(model_dir, router_replay=mode, temperature=1.0)
        logprobs = actor.compute_logprobs(samples)["old_logprobs"]
        k3[mode] = rollout_mismatch(logprobs, samples["rollout_logprobs"], samples["response_mask"])["k3"]
    # measured (Xeon, 2026-11-28): disabled 5.3e-4 / 1.1e-4, R3 1.1e-5 / 2.1e-6 (Qwen3.5-MoE /
    # Qwen3-VL-MoE): replaying the sampler's experts leaves a fiftieth of the gap
    assert k3["disabled"] > 5e-5, k3  # the drift moves the routing enough to matter
    assert k3["R3"] < k3["disabled"] / 10, k3
