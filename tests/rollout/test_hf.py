"""The transformers generate engine on the built-in tiny Qwen2.5-VL, against transformers itself."""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import (
    default_prompts,
    eos_inside,
    recompute_logprobs,
    response_logits,
    rollout_plan,
    video_prompt_batch,
    with_sampling,
)
from transformers import AutoModelForImageTextToText, TopKLogitsWarper, TopPLogitsWarper

from easyvlm.data.collate import concat_multi_modal_inputs
from easyvlm.rollout.factory import build_rollout
from easyvlm.rollout.hf import mm_token_type_ids

T = 12  # response length


@pytest.fixture(scope="module")
def spec(tiny_model_path):
    """The plan's rollout slice: transformers' generate, n=2, temperature 1, seed 3, 8 rows per call."""
    return rollout_plan(tiny_model_path, T, "worker.rollout.name=hf", "worker.rollout.max_num_seqs=8").rollout


@pytest.fixture(scope="module")
def engine(spec):
    return build_rollout(spec)


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return AutoModelForImageTextToText.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def greedy_reference(model, prompts, blocked, steps):
    """Greedy decoding by hand: one full forward per token, positions from transformers' get_rope_index."""
    ids, mask = prompts["input_ids"], prompts["attention_mask"].long()
    mm = concat_multi_modal_inputs(prompts["multi_modal_inputs"])
    tokens, logprobs = [], []
    for _ in range(steps):
        types = mm_token_type_ids(ids, model.config)
        position_ids, _ = model.model.get_rope_index(ids, types, image_grid_thw=mm["image_grid_thw"], attention_mask=mask)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, **mm).logits[:, -1].float()
        logits[:, blocked] = float("-inf")
        token = logits.argmax(-1)
        tokens.append(token)
        logprobs.append(logits.log_softmax(-1).gather(-1, token[:, None])[:, 0])
        ids = torch.cat([ids, token[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return torch.stack(tokens, 1), torch.stack(logprobs, 1)


def test_greedy_matches_hand_decoding(engine, model, prompts):
    out = engine.generate(prompts, with_sampling(engine, n=1, temperature=0.0))
    tokens, logprobs = greedy_reference(model, prompts, engine.blocked_token_ids, T)
    # the random tiny model never samples EOS in 12 steps here, so every row is full length
    assert out["response_mask"].all()
    torch.testing.assert_close(out["responses"], tokens)
    torch.testing.assert_close(out["rollout_logprobs"], logprobs)


def test_sampled_logprobs_are_the_temperature_scaled_policy(engine, model, prompts):
    out = engine.generate(prompts, with_sampling(engine, temperature=0.7))
    expected = recompute_logprobs(model, out, 0.7, engine.blocked_token_ids)
    mask = out["response_mask"]
    torch.testing.assert_close(out["rollout_logprobs"][mask], expected[mask])


def test_top_k_top_p_logprobs_are_of_the_distribution_sampled_from(engine, model, prompts):
    """rollout_logprobs under temperature, top-k and top-p: transformers' own warpers, in generate()'s
    order, applied to a full forward's logits, then log_softmax (vLLM's processed_logprobs). The
    engine records them one step at a time; before, it stacked every step's scores (output_scores)."""
    out = engine.generate(prompts, with_sampling(engine, temperature=0.7, top_k=20, top_p=0.8))
    logits = response_logits(model, out)
    logits[..., list(engine.blocked_token_ids)] = float("-inf")
    rows, steps, vocab = logits.shape
    warped = TopPLogitsWarper(top_p=0.8)(None, TopKLogitsWarper(top_k=20)(None, logits.reshape(-1, vocab) / 0.7))
    expected = warped.log_softmax(-1).reshape(rows, steps, vocab).gather(-1, out["responses"][..., None])[..., 0]
    mask = out["response_mask"]
    assert torch.isfinite(expected[mask]).all()  # every sampled token was inside top-k and top-p
    torch.testing.assert_close(out["rollout_logprobs"][mask], expected[mask])
    # the warpers mattered: the random tiny model is near uniform over its 264 ids at temperature
    # 0.7, top-20 then top-p 0.8 keep ~10% of the mass, so the kept tokens' log-probs are higher than
    # temperature alone gives by about -log 0.1 = 2.3 (2.11-2.27 here)
    temperature_only = recompute_logprobs(model, out, 0.7, engine.blocked_token_ids)
    assert (out["rollout_logprobs"][mask] - temperature_only[mask]).min() > 1.0


def test_position_ids_equal_transformers_over_the_whole_sequence(engine, model, prompts):
    out = engine.generate(prompts, with_sampling(engine, n=1))
    mm = concat_multi_modal_inputs(out["multi_modal_inputs"])
    ids, mask = out["input_ids"], out["attention_mask"]
    types = mm_token_type_ids(ids, model.config)
    grids = mm["image_grid_thw"]
    reference, _ = model.model.get_rope_index(ids, types, image_grid_thw=grids, attention_mask=mask.long())  # (3, B, L)
    vision_rows = out["position_ids"][:, 1:].transpose(0, 1)  # (3, B, L)
    torch.testing.assert_close(vision_rows[:, mask], reference[:, mask])


def test_videos_sample_with_the_batchs_positions(engine, model, tiny_processor_and_config, tmp_path):
    """generate() takes the batch's position ids, which continue after a video from the largest position
    + 1 (transformers' own would not): the sampled log-probs equal the actor's recomputation with them."""
    prompts = video_prompt_batch(*tiny_processor_and_config, tmp_path)
    assert [len(v) for v in prompts["videos"]] == [1, 1, 0]
    out = engine.generate(prompts, with_sampling(engine, temperature=0.7))
    expected = recompute_logprobs(model, out, 0.7, engine.blocked_token_ids)
    mask = out["response_mask"]
    torch.testing.assert_close(out["rollout_logprobs"][mask], expected[mask])


@pytest.fixture(scope="module")
def hot(engine, tiny_processor_and_config):
    """At temperature 100 the tiny model is ~uniform over its 264 ids: 3 x 24 x 12 = 864 tokens would
    hold ~16 of the 5 blocked ids if they were not blocked (P(none) ~ e^-16), and ~6 rows an EOS
    (2 ids) before their last token. The engine's RNG stream is seeded, so the draw is fixed."""
    sampling = with_sampling(engine, n=24, temperature=100.0, ignore_eos=True)
    return engine.generate(default_prompts(*tiny_processor_and_config), sampling)


def test_blocked_tokens_never_sampled_at_high_temperature(engine, hot):
    assert not torch.isin(hot["responses"], torch.tensor(engine.blocked_token_ids)).any()


def test_ignore_eos_samples_past_eos(engine, hot):
    assert eos_inside(hot, engine.eos_token_ids) >= 1
    assert (~hot["response_mask"]).any()  # the mask still ends at the first EOS


def test_seeded_stream_is_private_and_reproducible(spec, prompts):
    twin = build_rollout(spec)
    short = with_sampling(twin, max_tokens=4)
    rng = torch.random.get_rng_state()
    first = twin.generate(prompts, short)["responses"]
    assert torch.equal(torch.random.get_rng_state(), rng)  # the caller's RNG is untouched
    second = twin.generate(prompts, short)["responses"]
    assert not torch.equal(first, second)  # the stream moves on
    twin.model = None  # free it before building the next one
    fresh = build_rollout(spec)
    torch.testing.assert_close(fresh.generate(prompts, short)["responses"], first)


def test_rollout_seed_seeds_the_engine_stream(spec, prompts, tiny_model_path):
    # worker.rollout.seed: the engine's own stream (the module's spec has seed 3); the same seed repeats
    # the same samples (test_seeded_stream_is_private_and_reproducible), another one changes them
    other = rollout_plan(tiny_model_path, T, "worker.rollout.name=hf", "worker.rollout.max_num_seqs=8", "worker.rollout.seed=4").rollout
    assert other.engine.generation.seed == 4 and spec.engine.generation.seed == 3
    outputs = []
    for s in (spec, other):
        engine = build_rollout(s)
        outputs.append(engine.generate(prompts, with_sampling(engine, max_tokens=4))["responses"])
        engine.model = None
    assert not torch.equal(outputs[0], outputs[1])


def test_seeded_calls_repeat_per_step(engine, prompts):
    from easyvlm.rollout.base import SEED_KEY, prompt_seeds

    def seeded(step):
        batch = prompts.copy()
        batch[SEED_KEY] = prompt_seeds(1, (0, step, 0), len(batch))
        return batch

    short = with_sampling(engine, max_tokens=4)
    rng = torch.random.get_rng_state()
    first = engine.generate(seeded(3), short)["responses"]
    assert torch.equal(torch.random.get_rng_state(), rng)  # the caller's RNG is untouched
    engine.generate(prompts, short)  # moves the engine's own stream
    torch.testing.assert_close(engine.generate(seeded(3), short)["responses"], first)
    assert not torch.equal(engine.generate(seeded(4), short)["responses"], first)


def test_update_weights(engine, model, prompts, tiny_model_path):
    perturbed = AutoModelForImageTextToText.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    with pytest.raises(KeyError, match="not parameters of the rollout model"):
        engine.update_weights([("model.language_model.bogus.weight", torch.zeros(1))])
    engine.update_weights(perturbed.state_dict().items())
    out = engine.generate(prompts)  # the plan's sampling: temperature 1
    mask = out["response_mask"]
    expected = recompute_logprobs(perturbed, out, 1.0, engine.blocked_token_ids)
    torch.testing.assert_close(out["rollout_logprobs"][mask], expected[mask])
    engine.update_weights(model.state_dict().items())  # restore for other tests


def test_update_weights_streams_and_refuses_what_does_not_fit(engine, model, prompts):
    # a generator (the hybrid worker's stream) of a subset: copied as it arrives; a name the model
    # lacks or a shape that differs is refused (a smaller shape would otherwise broadcast silently)
    name = "model.language_model.norm.weight"
    before = engine.model.state_dict()[name].clone()
    engine.update_weights((k, v) for k, v in [(name, torch.full_like(before, 2.0))])
    assert torch.equal(engine.model.state_dict()[name], torch.full_like(before, 2.0))
    with pytest.raises(ValueError, match=r"norm.weight: \(1,\), the model's \(128,\)"):
        engine.update_weights([(name, torch.zeros(1))])
    with pytest.raises(KeyError, match="not parameters of the rollout model"):  # the known one still copied
        engine.update_weights([(name, before), ("model.language_model.bogus.weight", torch.zeros(1))])
    assert torch.equal(engine.model.state_dict()[name], before)
    engine.update_weights(model.state_dict().items())  # restore for other tests


def test_parking_in_host_memory_keeps_the_weights_and_their_ties():
    # sleep()'s mechanics (run on a GPU engine; here CPU to CPU): the tensors keep their identity (the
    # modules point at them), their data moves into the host copies, and back into fresh storage
    # with the same values; tied weights are parked once; a second park reuses the copies
    from easyvlm.rollout.hf import park_in_host_memory, restore_from_host_memory, unique_weights

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5))
    model[1].weight = model[0].weight  # tied, as an LM's embeddings and head: (5, 3)
    weights = unique_weights(model)
    # embedding (= the head's weight), head bias, norm weight and bias; norm running mean, var, count
    assert len(weights) == 1 + 1 + 2 + 3
    before = [w.detach().clone() for w in weights]
    x = torch.tensor([1, 4])
    model.eval()
    expected = model(x)
    copies = []
    park_in_host_memory(weights, copies)
    assert [w.data_ptr() for w in weights] == [c.data_ptr() for c in copies]
    first = [c.data_ptr() for c in copies]
    restore_from_host_memory(weights, "cpu")
    assert all(w.data_ptr() != c.data_ptr() for w, c in zip(weights, copies))
    assert all(torch.equal(w, b) for w, b in zip(weights, before))
    assert model[1].weight is model[0].weight and isinstance(model[1].weight, torch.nn.Parameter)
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    with torch.no_grad():
        model[0].weight.add_(1.0)  # trained while awake: the next park carries the new values
    park_in_host_memory(weights, copies)
    assert [c.data_ptr() for c in copies] == first
    restore_from_host_memory(weights, "cpu")
    assert torch.equal(model[1].weight, before[0] + 1.0)


def test_chosen_token_logprobs_step_by_step():
    """generate()'s calls by hand, one row: the processor sees the previous step's drawn token with
    the next step's scores. Scores (0, ln 3) -> probabilities (1/4, 3/4); token 1 drawn; (ln 3, 0) ->
    (3/4, 1/4), token 0 drawn; a third step (0, 0) -> (1/2, 1/2) computed past a stop generate()
    then undoes, or a third token."""
    import math

    from easyvlm.rollout.hf import ChosenTokenLogprobs

    recorder = ChosenTokenLogprobs()
    ln3 = math.log(3.0)
    for ids, scores in (([5], [0.0, ln3]), ([5, 1], [ln3, 0.0]), ([5, 1, 0], [0.0, 0.0])):
        recorder(torch.tensor([ids]), torch.tensor([scores]))
    three_quarters, half = math.log(0.75), math.log(0.5)
    # two tokens returned: the third step's distribution is dropped
    torch.testing.assert_close(recorder.logprobs(torch.tensor([[1, 0]])), torch.tensor([[three_quarters] * 2]))
    # three returned (token 1 from the last step): its log-prob comes from the last scores
    torch.testing.assert_close(recorder.logprobs(torch.tensor([[1, 0, 1]])),
                               torch.tensor([[three_quarters, three_quarters, half]]))


def test_chosen_token_logprobs_drop_steps_generate_undid():
    """Four calls (three drawn tokens' log-probs taken) but two tokens returned: generate() undid two
    steps past a stop it found late, and their log-probs must not shift into the result. Scores
    (0, ln 3), (ln 3, 0), (0, 0), (0, 0): tokens 1, 0 drawn -> log 3/4 each."""
    import math

    from easyvlm.rollout.hf import ChosenTokenLogprobs

    recorder = ChosenTokenLogprobs()
    ln3 = math.log(3.0)
    for ids, scores in (([5], [0.0, ln3]), ([5, 1], [ln3, 0.0]), ([5, 1, 0], [0.0, 0.0]), ([5, 1, 0, 0], [0.0, 0.0])):
        recorder(torch.tensor([ids]), torch.tensor([scores]))
    torch.testing.assert_close(recorder.logprobs(torch.tensor([[1, 0]])), torch.tensor([[math.log(0.75)] * 2]))
