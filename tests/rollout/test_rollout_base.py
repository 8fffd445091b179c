"""RolloutEngine.generate: per-call sampling, repeat order and output composition (with the fake
engine); the plan's training and validation `Sampling`."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from easyvlm.data.batch import Batch
from easyvlm.rollout.base import is_greedy, sampling_with_overrides
from easyvlm.rollout.specs import Sampling
from rollout_testing import FakeRolloutEngine

PAD, EOS = 0, 9


def prompt_batch() -> Batch:
    return Batch(
        {
            "input_ids": torch.tensor([[0, 3, 4], [2, 3, 4]]),
            "attention_mask": torch.tensor([[False, True, True], [True, True, True]]),
            "position_ids": torch.tensor([[0, 0, 1], [0, 1, 2]]),
        },
        {"raw_prompt_ids": [[3, 4], [2, 3, 4]], "uid": ["a", "b"], "images": [[], []]},
    )


def echo_engine(response_length: int = 4, **sampling) -> FakeRolloutEngine:
    """Sample j of a prompt = [first prompt token, 10 + j, EOS]."""
    base = dict(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=response_length, ignore_eos=False)
    return FakeRolloutEngine(
        lambda prompt, j: [prompt[0], 10 + j, EOS, 5],
        Sampling(**{**base, **sampling}),
        response_length=response_length,
        pad_token_id=PAD,
        eos_token_ids=[EOS],
    )


def test_generate_repeats_each_prompt_n_times_interleaved():
    out = echo_engine().generate(prompt_batch())
    assert out["uid"] == ["a", "a", "b", "b"]
    # row i*n+j = sample j of prompt i; responses stop at EOS and are padded to T=4
    torch.testing.assert_close(
        out["responses"], torch.tensor([[3, 10, EOS, PAD], [3, 11, EOS, PAD], [2, 10, EOS, PAD], [2, 11, EOS, PAD]])
    )
    torch.testing.assert_close(out["prompts"], torch.tensor([[0, 3, 4], [0, 3, 4], [2, 3, 4], [2, 3, 4]]))
    torch.testing.assert_close(out["response_mask"], torch.tensor([[True, True, True, False]] * 4))
    torch.testing.assert_close(out["rollout_logprobs"], torch.tensor([[-1.0, -1.0, -1.0, 0.0]] * 4))
    # prompt positions (row 0: 0 0 1) continue over the response: 2 3 4 5
    torch.testing.assert_close(out["position_ids"][0], torch.tensor([0, 0, 1, 2, 3, 4, 5]))


def test_call_sampling_applies_to_that_call_only():
    engine = echo_engine()
    out = engine.generate(prompt_batch(), dataclasses.replace(engine.sampling, n=1, temperature=0.0, ignore_eos=True))
    # n=1; ignore_eos keeps the token after EOS; the mask still stops at EOS
    torch.testing.assert_close(out["responses"], torch.tensor([[3, 10, EOS, 5], [2, 10, EOS, 5]]))
    torch.testing.assert_close(out["response_mask"], torch.tensor([[True, True, True, False]] * 2))
    out = engine.generate(prompt_batch(), dataclasses.replace(engine.sampling, max_tokens=2))
    expected = torch.tensor([[3, 10, PAD, PAD], [3, 11, PAD, PAD], [2, 10, PAD, PAD], [2, 11, PAD, PAD]])
    torch.testing.assert_close(out["responses"], expected)
    assert len(engine.generate(prompt_batch())) == 4  # the configured n=2 is back


# Users' values are judged by the config check (tests/config/test_validate.py: worker.rollout.n,
# temperature, top_p, top_k and val_override_config.{n, temperature, top_p, max_tokens, <unknown key>});
# generate() only asserts the invariants the engines rely on, whoever built the Sampling.
@pytest.mark.parametrize(
    "change",
    [dict(n=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(max_tokens=0),
     dict(max_tokens=5)],  # 5 > the engine's response length 4
)
def test_generate_refuses_an_invalid_sampling(change):
    engine = echo_engine()
    with pytest.raises(AssertionError):
        engine.generate(prompt_batch(), dataclasses.replace(engine.sampling, **change))


def test_sampling_with_overrides_by_hand():
    base = Sampling(n=8, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=16, ignore_eos=False, extra=(("min_p", 0.1),))
    val = sampling_with_overrides(base, {"n": 1, "temperature": 0, "stop_token_ids": [7], "min_p": 0.2, "max_tokens": 4})
    # Sampling fields replace theirs; other keys join extra, sorted by name, min_p's new value wins
    assert val == Sampling(n=1, temperature=0, top_p=1.0, top_k=-1, max_tokens=4, ignore_eos=False,
                           extra=(("min_p", 0.2), ("stop_token_ids", [7])))
    assert is_greedy(val) and not is_greedy(base)
    assert sampling_with_overrides(base, {}) == base


def test_the_plan_has_training_and_validation_sampling(tiny_model_path):
    """The driver makes both from worker.rollout.* (max tokens = data.max_response_length) and
    worker.rollout.val_override_config; vLLM SamplingParams fields go to ``extra``."""
    from plan_testing import plan_for

    plan = plan_for(
        tiny_model_path,
        "worker.rollout.name=vllm",  # the hf engine refuses vLLM-only validation keys such as min_p
        "worker.rollout.n=5",
        "worker.rollout.temperature=0.8",
        "worker.rollout.top_p=0.9",
        "worker.rollout.top_k=20",
        "data.max_response_length=64",
        "worker.rollout.val_override_config={n: 1, temperature: 0, min_p: 0.05, stop_token_ids: [3]}",
    )
    sampling = Sampling(n=5, temperature=0.8, top_p=0.9, top_k=20, max_tokens=64, ignore_eos=False)
    assert plan.rollout.sampling == sampling and plan.rollout.response_length == 64
    val = plan.rollout.val_sampling
    assert val == dataclasses.replace(sampling, n=1, temperature=0, extra=(("min_p", 0.05), ("stop_token_ids", [3])))
    assert is_greedy(val)


def test_generate_requires_prompt_keys():
    batch = prompt_batch()
    batch.objects.pop("raw_prompt_ids")
    with pytest.raises(KeyError, match="raw_prompt_ids"):
        echo_engine().generate(batch)


def test_fake_engine_tracks_weight_updates_and_sleep():
    engine = echo_engine()
    engine.update_weights(iter([("w", torch.zeros(1))]))
    assert engine.weight_updates == 1
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(prompt_batch())
    engine.wake_up()
    assert len(engine.generate(prompt_batch())) == 4
