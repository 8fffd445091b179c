"""RolloutEngine.generate: overrides, repeat order and output composition (with the fake engine)."""

from __future__ import annotations

import pytest
import torch

from easyvlm.config.schema import RolloutConfig
from easyvlm.data.batch import Batch
from easyvlm.rollout.base import Sampling, SamplingOverrides
from easyvlm.rollout.factory import sampling_from_config
from easyvlm.rollout.fake import FakeRolloutEngine

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


def test_overrides_apply_per_call_only():
    engine = echo_engine()
    out = engine.generate(prompt_batch(), n=1, temperature=0, ignore_eos=True)
    # n=1; ignore_eos keeps the token after EOS; the mask still stops at EOS
    torch.testing.assert_close(out["responses"], torch.tensor([[3, 10, EOS, 5], [2, 10, EOS, 5]]))
    torch.testing.assert_close(out["response_mask"], torch.tensor([[True, True, True, False]] * 2))
    out = engine.generate(prompt_batch(), max_tokens=2)
    expected = torch.tensor([[3, 10, PAD, PAD], [3, 11, PAD, PAD], [2, 10, PAD, PAD], [2, 11, PAD, PAD]])
    torch.testing.assert_close(out["responses"], expected)
    assert len(engine.generate(prompt_batch())) == 4  # the configured n=2 is back


def test_unknown_override_is_an_error():
    with pytest.raises(ValueError, match=r"unknown sampling override\(s\) \['temprature'\]"):
        echo_engine().generate(prompt_batch(), temprature=0)


@pytest.mark.parametrize(
    "override, message",
    [
        (dict(n=0), "n=0 must be >= 1"),
        (dict(temperature=-1.0), "temperature=-1.0 must be >= 0"),
        (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
        (dict(top_k=0), "top_k=0 must be -1"),
        (dict(max_tokens=5), r"max_tokens=5 must be in \[1, data.max_response_length=4\]"),
    ],
)
def test_invalid_sampling_names_the_field(override, message):
    with pytest.raises(ValueError, match=message):
        echo_engine().generate(prompt_batch(), **override)


def test_sampling_from_config_and_val_overrides():
    config = RolloutConfig(n=5, temperature=0.8, top_p=0.9, top_k=20, val_override_config={"n": 1, "temperature": 0})
    sampling = sampling_from_config(config, response_length=64)
    assert sampling == Sampling(n=5, temperature=0.8, top_p=0.9, top_k=20, max_tokens=64, ignore_eos=False)
    val = sampling.override(SamplingOverrides.from_mapping(config.val_override_config), response_length=64)
    assert val == Sampling(n=1, temperature=0, top_p=0.9, top_k=20, max_tokens=64, ignore_eos=False) and val.greedy


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
