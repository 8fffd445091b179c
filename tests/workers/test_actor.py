"""ActorWorker on one process (gloo, world size 1): log-probs against an independent transformers
computation, an update against a hand-written PPO step, frozen vision tower, non-finite skipping,
checkpoints, HF export and the weights handed to vLLM."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from workers_testing import PROMPTS, RESPONSE_LENGTHS, actor_spec, assert_logprobs_match_reference, make_rl_batch, reference_logprobs

from easyvlm.algorithms.policy_losses import POLICY_LOSSES, PolicyLossInputs, get_policy_loss
from easyvlm.algorithms.settings import PolicyLossSettings
from easyvlm.workers.actor import ActorWorker

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def batch(tiny_model_path):
    # samples 0, 1 have images, 2, 3 are text-only: with micro-batches of 2 the second micro-batch
    # has no image and exercises the vision-tower dummy
    return make_rl_batch(tiny_model_path, PROMPTS[:4], RESPONSE_LENGTHS[:4])


@pytest.fixture(scope="module")
def reference_model(tiny_model_path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(tiny_model_path, attn_implementation="sdpa").eval()


def make_actor(model_path: str, loss: str | None = None, **overrides) -> ActorWorker:
    """An actor of the test run (``overrides``: see workers_testing.role_overrides); ``loss``: a
    registered policy loss to bind instead of the configured one (a test-only registration)."""
    spec = actor_spec(model_path, temperature=TEMPERATURE, **overrides)
    if loss is not None:
        settings = dataclasses.replace(spec.policy_loss.settings, loss_type=loss)
        spec = dataclasses.replace(spec, policy_loss=dataclasses.replace(spec.policy_loss, settings=settings))
    return ActorWorker(spec, rank=0, world_size=1)


def with_training_keys(batch, old_logprobs: torch.Tensor, seed: int = 0):
    """Add old_logprobs (perturbed, so that ratios differ from 1 and clipping happens) and advantages."""
    gen = torch.Generator().manual_seed(seed)
    out = batch.copy()
    mask = batch["response_mask"]
    out["old_logprobs"] = torch.where(mask, old_logprobs + 0.3 * torch.randn(old_logprobs.shape, generator=gen), 0.0)
    out["advantages"] = torch.where(mask, torch.randn(old_logprobs.shape, generator=gen), 0.0)
    return out


def weights(worker: ActorWorker) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in worker.state_dict_for_sync().items()}


@pytest.mark.parametrize("padding_free", [False, True])
def test_compute_logprobs_match_transformers(process_group, tiny_model_path, batch, reference_model, padding_free):
    actor = make_actor(tiny_model_path, padding_free=padding_free)
    out = actor.compute_logprobs(batch, with_entropy=True)
    assert_logprobs_match_reference(out, reference_model, batch, TEMPERATURE)


def every_linear_on_onednn(monkeypatch) -> None:
    """The tiny model's products are below easyvlm.models.cpu_linear.MIN_ONEDNN_MACS, so they take
    F.linear; this sends every one of them through oneDNN (as the bench model's are), unmeasured
    (EASYVLM_CPU_LINEAR=onednn: the measured choice would keep F.linear for such small products)."""
    from easyvlm.models.cpu_linear import ENV_SWITCH, onednn_linear_available

    if not onednn_linear_available():
        pytest.skip("oneDNN linears are for x86-64 CPUs with mkldnn")
    monkeypatch.setattr("easyvlm.models.cpu_linear.MIN_ONEDNN_MACS", 1)
    monkeypatch.setenv(ENV_SWITCH, "onednn")


def onednn_calls(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "mkldnn::_linear_pointwise")


def test_logprobs_with_every_linear_on_onednn_match_transformers(process_group, tiny_model_path, batch, reference_model,
                                                                 monkeypatch):
    every_linear_on_onednn(monkeypatch)
    actor = make_actor(tiny_model_path, padding_free=True)
    outs = []
    assert onednn_calls(lambda: outs.append(actor.compute_logprobs(batch, with_entropy=True))) > 0
    assert_logprobs_match_reference(outs[0], reference_model, batch, TEMPERATURE)


def test_cpu_actor_runs_its_linears_through_onednn_unless_told_not_to(process_group, tiny_model_path, monkeypatch):
    from torch import nn

    from easyvlm.models.cpu_linear import ENV_SWITCH, OneDNNLinear, onednn_linear_available

    if not onednn_linear_available():
        pytest.skip("oneDNN linears are for x86-64 CPUs with mkldnn")
    linear_types = lambda actor: {type(m) for m in actor.model.modules() if isinstance(m, nn.Linear)}  # noqa: E731
    assert linear_types(make_actor(tiny_model_path)) == {OneDNNLinear}
    monkeypatch.setenv(ENV_SWITCH, "aten")
    assert linear_types(make_actor(tiny_model_path)) == {nn.Linear}


def test_dynamic_batching_gives_the_same_logprobs(process_group, tiny_model_path, batch):
    fixed = make_actor(tiny_model_path).compute_logprobs(batch)["old_logprobs"]
    # a budget of 40 tokens cuts the 4 samples into several uneven micro-batches
    # (the config check wants the budget to hold max_prompt_length + max_response_length: 24 + 16)
    lengths = ("data.max_prompt_length=24", "data.max_response_length=16")
    dynamic = make_actor(tiny_model_path, dynamic_batching=True, max_token_len_per_device=40, extra=lengths)
    torch.testing.assert_close(dynamic.compute_logprobs(batch)["old_logprobs"], fixed)


def _reference_update(model_dir, batch, mini_batch_size, lr, max_grad_norm, loss_avg_mode):
    """What update_policy must do, written out: per mini-batch one forward over all its samples,
    the loss normalised over the mini-batch, clip, AdamW (the defaults of OptimConfig otherwise)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=1e-2)
    loss_fn = get_policy_loss("default")
    grad_norms = []
    for start in range(0, len(batch), mini_batch_size):
        mini = batch.index(slice(start, start + mini_batch_size))
        logprobs = _differentiable_logprobs(model, mini)
        loss, _ = loss_fn(PolicyLossInputs(
            logprobs=logprobs, old_logprobs=mini["old_logprobs"], advantages=mini["advantages"],
            response_mask=mini["response_mask"], settings=PolicyLossSettings(loss_avg_mode=loss_avg_mode),
        ))
        loss.backward()
        grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm).item())
        optimizer.step()
        # zeros, not None: the worker runs the vision tower on a dummy image when a micro-batch has
        # none (FSDP needs every rank in every block), so AdamW sees zero gradients there, not none
        optimizer.zero_grad(set_to_none=False)
    return {k: v.detach() for k, v in model.state_dict().items()}, grad_norms


def _differentiable_logprobs(model, batch):
    from transformers import AutoTokenizer

    from easyvlm.data.collate import concat_multi_modal_inputs
    from easyvlm.rollout.tokens import blocked_token_ids

    B, T = batch["responses"].shape
    mm = concat_multi_modal_inputs(batch["multi_modal_inputs"])
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"].transpose(0, 1), **mm).logits
    # the ids the rollout never samples are not part of the policy's distribution
    blocked = blocked_token_ids(AutoTokenizer.from_pretrained(model.name_or_path), model.config)
    logits = logits.index_fill(-1, torch.tensor(blocked), float("-inf"))
    logp = torch.log_softmax(logits[:, -T - 1 : -1] / TEMPERATURE, -1)  # positions P-1 .. P+T-2
    return logp.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1) * batch["response_mask"]


@pytest.mark.parametrize("loss_avg_mode,onednn", [("token", False), ("seq", False), ("token", True)])
def test_update_equals_a_hand_written_ppo_step(process_group, tiny_model_path, batch, loss_avg_mode, onednn, monkeypatch):
    # 2 mini-batches of 2 samples, micro-batches of 1: gradient accumulation must reproduce the
    # mini-batch loss normalised over the whole mini-batch; max_grad_norm 0.5 makes clipping active.
    # onednn: the actor's every linear through oneDNN, the reference's through F.linear (MKL)
    if onednn:
        every_linear_on_onednn(monkeypatch)
    actor = make_actor(tiny_model_path, global_batch_size=2, micro_batch_size_per_device_for_update=1,
                       max_grad_norm=0.5, loss_avg_mode=loss_avg_mode)
    data = with_training_keys(batch, actor.compute_logprobs(batch)["old_logprobs"])
    before = weights(actor)
    metrics = {}
    assert (onednn_calls(lambda: metrics.update(actor.update_policy(data))) > 0) == onednn
    after = weights(actor)
    monkeypatch.undo()  # the reference update below runs plain transformers (F.linear) either way
    expected, grad_norms = _reference_update(tiny_model_path, data, 2, 1e-3, 0.5, loss_avg_mode)
    # AdamW's step is scale-free, so the weights alone cannot see a wrongly scaled loss: the
    # pre-clip gradient norm can (e.g. a missing world-size factor or a per-micro-batch normaliser)
    assert metrics["actor/grad_norm"] == pytest.approx(sum(grad_norms) / 2, rel=1e-5)
    assert min(grad_norms) > 0.5  # so clipping was active
    assert after.keys() == expected.keys()
    for name in expected:
        # atol lr/20: AdamW divides by sqrt(v) + 1e-8, so for gradient entries near 1e-8 the float32
        # summation order (micro-batches vs one batch) moves a weight by a fraction of lr
        torch.testing.assert_close(after[name], expected[name], rtol=1.3e-6, atol=5e-5, msg=name)
        assert not torch.equal(after[name], before[name]) or "embed_tokens" in name, name
    assert metrics["actor/skipped_steps"] == 0 and metrics["actor/lr"] == 1e-3
    assert 0 < metrics["actor/pg_clipfrac_higher"] + metrics["actor/pg_clipfrac_lower"] < 1


def test_metrics_are_mini_batch_losses(process_group, tiny_model_path, batch):
    # lr 0: the weights do not move, so each mini-batch loss can be recomputed from the initial model
    actor = make_actor(tiny_model_path, global_batch_size=2, micro_batch_size_per_device_for_update=1, lr=0.0)
    data = with_training_keys(batch, actor.compute_logprobs(batch)["old_logprobs"])
    fresh = actor.compute_logprobs(data, with_entropy=True)
    metrics = actor.update_policy(data)
    losses, entropies = [], []
    for start in (0, 2):
        rows = slice(start, start + 2)
        mask = data["response_mask"][rows]
        loss, _ = get_policy_loss("default")(PolicyLossInputs(
            logprobs=fresh["old_logprobs"][rows], old_logprobs=data["old_logprobs"][rows],
            advantages=data["advantages"][rows], response_mask=mask))
        losses.append(loss.item())
        entropies.append((fresh["entropies"][rows][mask]).mean().item())
    assert metrics["actor/pg_loss"] == pytest.approx(sum(losses) / 2, rel=1e-5)
    assert metrics["actor/entropy_loss"] == pytest.approx(sum(entropies) / 2, rel=1e-5)


def test_frozen_vision_tower_is_bit_identical_after_update(process_group, tiny_model_path, batch):
    actor = make_actor(tiny_model_path, freeze_vision_tower=True, lr=1e-2)
    data = with_training_keys(batch, actor.compute_logprobs(batch)["old_logprobs"])
    before = weights(actor)
    actor.update_policy(data)
    after = weights(actor)
    visual = [k for k in before if k.startswith("model.visual.")]
    assert visual
    for name in visual:
        assert torch.equal(before[name], after[name]), name
    changed = [k for k in before if not k.startswith("model.visual.") and not torch.equal(before[k], after[k])]
    assert "lm_head.weight" in changed and any("language_model.layers" in k for k in changed)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_loss_skips_the_step(process_group, tiny_model_path, batch, bad, monkeypatch):
    real_loss = get_policy_loss("default")
    calls = []
    name = f"test_non_finite_{bad}"

    def loss_fn(inputs):
        loss, metrics = real_loss(inputs)
        calls.append(1)
        # the first mini-batch's first micro-batch goes bad; the second mini-batch is fine
        return (loss * bad if len(calls) == 1 else loss), metrics

    # registered for this test only: the registry's own tests list the real names
    monkeypatch.setitem(POLICY_LOSSES._fns, name, loss_fn)
    actor = make_actor(tiny_model_path, global_batch_size=2, loss=name)
    data = with_training_keys(batch, actor.compute_logprobs(batch)["old_logprobs"])
    before = weights(actor)
    metrics = actor.update_policy(data.index(slice(0, 2)))  # one mini-batch: the bad one
    assert metrics["actor/skipped_steps"] == 1
    assert math.isnan(metrics["actor/grad_norm"])  # no step was taken
    after = weights(actor)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not actor.optimizer.state  # AdamW never stepped
    metrics = actor.update_policy(data.index(slice(2, 4)))
    assert metrics["actor/skipped_steps"] == 0
    assert not torch.equal(weights(actor)["lm_head.weight"], before["lm_head.weight"])


def test_kl_loss_and_entropy_bonus_enter_the_loss(process_group, tiny_model_path, batch):
    algorithm = dict(use_kl_loss=True, kl_penalty="low_var_kl", kl_coef=0.5)
    actor = make_actor(tiny_model_path, algorithm=algorithm, entropy_coeff=0.1, lr=0.0)
    data = with_training_keys(batch, actor.compute_logprobs(batch)["old_logprobs"])
    with pytest.raises(KeyError, match="ref_logprobs"):
        actor.update_policy(data)
    # reference 0.2 nats above the policy everywhere: k3 = exp(0.2) - 0.2 - 1 per token
    data["ref_logprobs"] = actor.compute_logprobs(data)["old_logprobs"] + 0.2
    metrics = actor.update_policy(data)
    assert metrics["actor/kl_loss"] == pytest.approx(math.exp(0.2) - 1.2, rel=1e-4)


def test_lr_schedule_reaches_the_optimizer(process_group, tiny_model_path, batch):
    # warm-up of 2 steps: 1/2, 2/2 of the peak; then cosine from step 2 (factor 1) towards 0.1 at
    # step 4: step 3 is half way, 0.1 + 0.9 * (1 + cos(pi / 2)) / 2 = 0.55
    optim = dict(lr_warmup_steps=2, lr_scheduler_type="cosine", min_lr_ratio=0.1)
    actor = make_actor(tiny_model_path, optim=optim, total_steps=4, lr=1e-3)
    data = with_training_keys(batch, actor.compute_logprobs(batch)["old_logprobs"]).index(slice(0, 1))
    lrs = [actor.update_policy(data)["actor/lr"] for _ in range(4)]
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3, 5.5e-4])


def test_checkpoint_round_trip(process_group, tiny_model_path, batch, tmp_path):
    actor = make_actor(tiny_model_path)
    data = with_training_keys(batch, actor.compute_logprobs(batch)["old_logprobs"])
    actor.update_policy(data)
    actor.save_checkpoint(tmp_path / "ckpt")
    saved = weights(actor)
    optim_state = actor.optimizer.state_dict()["state"][0]
    saved_optim = {k: v.full_tensor().clone() for k, v in optim_state.items() if k != "step"}
    after_save = actor.update_policy(data)  # moves weights, optimizer and scheduler on
    expected_next = weights(actor)

    restored = make_actor(tiny_model_path)
    restored.load_checkpoint(tmp_path / "ckpt")
    assert all(torch.equal(saved[k], v) for k, v in weights(restored).items())
    for key, value in restored.optimizer.state_dict()["state"][0].items():
        if key != "step":
            assert torch.equal(value.full_tensor(), saved_optim[key]), key
    assert restored.trained.scheduler.last_epoch == 1
    # the restored worker continues exactly as the original did
    assert restored.update_policy(data) == after_save
    assert all(torch.equal(expected_next[k], v) for k, v in weights(restored).items())


def test_export_hf_loads_with_auto_class(process_group, tiny_model_path, batch, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    actor = make_actor(tiny_model_path, lr=1e-2)
    data = with_training_keys(batch, actor.compute_logprobs(batch)["old_logprobs"])
    actor.update_policy(data)
    actor.export_hf(tmp_path / "hf")
    exported = AutoModelForImageTextToText.from_pretrained(tmp_path / "hf").eval()
    assert AutoProcessor.from_pretrained(tmp_path / "hf").tokenizer.eos_token == "<|im_end|>"
    expected, _ = reference_logprobs(exported, batch, TEMPERATURE)
    mask = batch["response_mask"]
    torch.testing.assert_close(actor.compute_logprobs(batch)["old_logprobs"][mask], expected[mask])


def test_sync_state_dict_has_in_memory_names(process_group, tiny_model_path, reference_model):
    state = make_actor(tiny_model_path).state_dict_for_sync()
    expected = reference_model.state_dict()
    assert state.keys() == expected.keys()
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in state
    assert "model.visual.merger.mlp.0.weight" in state
    assert all(torch.equal(state[k], expected[k]) for k in expected)


def test_lora_actor_syncs_merged_weights(process_group, tiny_model_path, batch, reference_model):
    actor = make_actor(tiny_model_path, lora=dict(rank=4, alpha=8), lr=1e-2)
    expected = reference_model.state_dict()
    state = actor.state_dict_for_sync()
    assert state.keys() == expected.keys()
    # LoRA's B starts at 0, so the merged weights are the base weights
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    data = with_training_keys(batch, actor.compute_logprobs(batch)["old_logprobs"])
    actor.update_policy(data)
    state = actor.state_dict_for_sync()
    name = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(state[name], expected[name])
    assert torch.equal(state["model.language_model.norm.weight"], expected["model.language_model.norm.weight"])
    # the hybrid worker's stream (a tensor at a time) is the same merged state, in the same order
    streamed = list(actor.iter_weights_for_sync("cpu"))
    assert [k for k, _ in streamed] == list(state)
    assert all(torch.equal(value, state[k]) for k, value in streamed)


def test_streamed_sync_is_the_gathered_state_dict(process_group, tiny_model_path, batch):
    # after an update (weights no longer the checkpoint's): names, order and values of the stream
    # equal state_dict_for_sync's, and the stream yields tensors on the device asked for
    actor = make_actor(tiny_model_path, lr=1e-2)
    actor.update_policy(with_training_keys(batch, actor.compute_logprobs(batch)["old_logprobs"]))
    state = actor.state_dict_for_sync()
    streamed = list(actor.iter_weights_for_sync("cpu"))
    assert [k for k, _ in streamed] == list(state)
    assert all(torch.equal(value, state[k]) and value.device.type == "cpu" for k, value in streamed)


@pytest.mark.slow
def test_torch_compile_gives_the_eager_logprobs_and_update(process_group, tiny_model_path, batch):
    # worker.actor.use_torch_compile (EasyR1's default: on): the per-token kernel through inductor,
    # on the CPU too. Same log-probs and entropies, and the same update (its gradient norm)
    from torch._dynamo.utils import counters

    eager, compiled = make_actor(tiny_model_path), make_actor(tiny_model_path, use_torch_compile=True)
    frames = counters["frames"]["ok"]
    assert (eager.spec.forward.use_torch_compile, compiled.spec.forward.use_torch_compile) == (False, True)
    out_eager, out_compiled = eager.compute_logprobs(batch, with_entropy=True), compiled.compute_logprobs(batch, with_entropy=True)
    mask = batch["response_mask"]
    for key in ("old_logprobs", "entropies"):
        torch.testing.assert_close(out_compiled[key][mask], out_eager[key][mask], msg=key)
    data = with_training_keys(batch, out_eager["old_logprobs"])
    metrics_eager, metrics_compiled = eager.update_policy(data), compiled.update_policy(data)
    assert metrics_compiled["actor/grad_norm"] == pytest.approx(metrics_eager["actor/grad_norm"], rel=1e-5)
    assert metrics_compiled["actor/pg_loss"] == pytest.approx(metrics_eager["actor/pg_loss"], rel=1e-5)
    assert counters["frames"]["ok"] > frames  # dynamo really compiled the kernel (eager compiles nothing)


def test_trainer_seed_sets_the_new_lora_weights(process_group, tiny_model_path):
    # trainer.seed seeds torch before the model is built: LoRA's A matrices (random; B starts at 0)
    # repeat with the seed and change with it
    def lora_a(seed: int) -> dict[str, torch.Tensor]:
        actor = make_actor(tiny_model_path, lora=dict(rank=4, alpha=8), extra=(f"trainer.seed={seed}",))
        assert actor.spec.seed == seed
        return {n: p.detach().clone() for n, p in actor.model.named_parameters() if ".lora_A." in n}

    first, again, other = lora_a(1), lora_a(1), lora_a(2)
    assert first and first.keys() == other.keys()
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert not any(torch.equal(first[n], other[n]) for n in first)


def _one_micro_batch_actor(tiny_model_path, **overrides) -> ActorWorker:
    """lr 0 and one micro-batch of the whole (4-sample) batch: the gate sees what a test recomputes."""
    return make_actor(tiny_model_path, global_batch_size=4, micro_batch_size_per_device_for_update=4,
                      dynamic_batching=False, lr=0.0, **overrides)


def _expected_pg_loss(fresh, data, gate) -> float:
    loss, _ = get_policy_loss("default")(PolicyLossInputs(
        logprobs=fresh["old_logprobs"], old_logprobs=data["old_logprobs"], advantages=data["advantages"],
        response_mask=data["response_mask"], token_gate=gate))
    return loss.item()


def test_top_entropy_quantile_gates_the_update_by_the_micro_batch_entropies(process_group, tiny_model_path, batch):
    from easyvlm.algorithms.token_filters import high_entropy_gate

    actor = _one_micro_batch_actor(tiny_model_path, top_entropy_quantile=0.5)
    data = with_training_keys(batch, actor.compute_logprobs(batch)["old_logprobs"])
    fresh = actor.compute_logprobs(data, with_entropy=True)
    mask = data["response_mask"]
    gate = high_entropy_gate(fresh["entropies"], mask, 0.5)
    metrics = actor.update_policy(data)
    assert metrics["actor/pg_token_frac"] == pytest.approx(gate.sum().item() / mask.sum().item())
    assert 0.4 < metrics["actor/pg_token_frac"] < 0.6  # about half the tokens (ties aside)
    assert metrics["actor/pg_loss"] == pytest.approx(_expected_pg_loss(fresh, data, gate), rel=1e-5)
    assert metrics["actor/pg_loss"] != pytest.approx(_expected_pg_loss(fresh, data, None), rel=1e-3)


def test_off_policy_mask_threshold_drops_stale_negative_sequences(process_group, tiny_model_path, batch):
    actor = _one_micro_batch_actor(tiny_model_path, off_policy_mask_threshold=0.5)
    data = with_training_keys(batch, actor.compute_logprobs(batch)["old_logprobs"])
    mask = data["response_mask"]
    # samples 0 and 1 negative, 2 and 3 positive; the sampler's log-probs 1 nat above the policy's for
    # samples 0 and 2: only sample 0 is dropped (negative and mean log(pi_sampler / pi) = 1 > 0.5)
    sign = torch.tensor([-1.0, -1.0, 1.0, 1.0]).unsqueeze(-1)
    data["advantages"] = torch.where(mask, data["advantages"].abs() + 0.1, 0.0) * sign
    fresh = actor.compute_logprobs(data, with_entropy=True)
    offset = torch.tensor([1.0, 0.0, 1.0, 0.0]).unsqueeze(-1)
    data["rollout_logprobs"] = torch.where(mask, fresh["old_logprobs"] + offset, 0.0)
    metrics = actor.update_policy(data)
    gate = mask.clone()
    gate[0] = False
    assert metrics["actor/pg_token_frac"] == pytest.approx(gate.sum().item() / mask.sum().item())
    assert metrics["actor/pg_loss"] == pytest.approx(_expected_pg_loss(fresh, data, gate), rel=1e-5)


def test_use_bias_correction_kl_weighs_the_kl_loss_by_the_ratio(process_group, tiny_model_path, batch):
    algorithm = dict(use_kl_loss=True, kl_penalty="low_var_kl", kl_coef=0.5, use_bias_correction_kl=True)
    actor = _one_micro_batch_actor(tiny_model_path, algorithm=algorithm)
    data = with_training_keys(batch, actor.compute_logprobs(batch)["old_logprobs"])
    fresh = actor.compute_logprobs(data)["old_logprobs"]
    data["ref_logprobs"] = fresh + 0.2  # k3 = e^0.2 - 1.2 at every token, times r = pi / pi_old
    mask = data["response_mask"]
    ratio = torch.exp(fresh - data["old_logprobs"])[mask]
    metrics = actor.update_policy(data)
    assert metrics["actor/kl_loss"] == pytest.approx((math.exp(0.2) - 1.2) * ratio.mean().item(), rel=1e-4)
