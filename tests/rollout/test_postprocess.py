"""Pure post-processing: padding, response mask up to EOS, prompt + response concatenation."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig

from easyvlm.data.batch import Batch
from easyvlm.rollout.postprocess import (
    build_response_mask,
    build_rollout_batch,
    concat_prompt_response,
    pad_logprobs,
    pad_responses,
)
from easyvlm.rollout.tokens import eos_token_ids, pad_token_id

PAD, EOS, EOS2 = 0, 9, 8  # hand-made ids for the pure-function tests


def test_pad_responses_right_pads_with_pad_id():
    out = pad_responses([[5, 6, 9], [7], []], response_length=4, pad_token_id=PAD)
    torch.testing.assert_close(out, torch.tensor([[5, 6, 9, 0], [7, 0, 0, 0], [0, 0, 0, 0]]))


def test_pad_responses_rejects_too_long():
    with pytest.raises(ValueError, match="response 1 has 3 tokens"):
        pad_responses([[1], [1, 2, 3]], response_length=2, pad_token_id=PAD)


def test_pad_logprobs_zero_after_end():
    out = pad_logprobs([[-0.5, -1.0], [-2.0]], response_length=3)
    torch.testing.assert_close(out, torch.tensor([[-0.5, -1.0, 0.0], [-2.0, 0.0, 0.0]]))


def test_response_mask_up_to_and_including_first_eos():
    responses = torch.tensor(
        [
            [5, 9, 6, 9],  # EOS mid-sequence, sampled on (ignore_eos): True up to the first EOS
            [5, 6, 7, 4],  # no EOS, full length
            [9, 0, 0, 0],  # EOS as the first token
            [5, 6, 0, 0],  # stopped by max_tokens=2 without EOS
            [5, 8, 9, 9],  # the second EOS id counts too
        ]
    )
    lengths = torch.tensor([4, 4, 1, 2, 4])
    expected = torch.tensor(
        [
            [True, True, False, False],
            [True, True, True, True],
            [True, False, False, False],
            [True, True, False, False],
            [True, True, False, False],
        ]
    )
    torch.testing.assert_close(build_response_mask(responses, lengths, [EOS, EOS2]), expected)


def test_response_mask_uses_lengths_when_pad_is_an_eos_id():
    # Qwen: pad <|endoftext|> is also an EOS id; padding after a 2-token response must not count.
    responses = torch.tensor([[5, 6, PAD, PAD]])
    mask = build_response_mask(responses, torch.tensor([2]), eos_token_ids=[EOS, PAD])
    torch.testing.assert_close(mask, torch.tensor([[True, True, False, False]]))


def test_concat_prompt_response_text_positions():
    prompts = torch.tensor([[0, 3, 4], [2, 3, 4]])  # row 0 left padded
    prompt_mask = torch.tensor([[False, True, True], [True, True, True]])
    prompt_pos = torch.tensor([[0, 0, 1], [0, 1, 2]])
    responses = torch.tensor([[5, 9], [6, 7]])
    response_mask = torch.tensor([[True, True], [True, False]])
    input_ids, attention_mask, position_ids = concat_prompt_response(
        prompts, prompt_mask, prompt_pos, responses, response_mask
    )
    torch.testing.assert_close(input_ids, torch.tensor([[0, 3, 4, 5, 9], [2, 3, 4, 6, 7]]))
    expected_mask = torch.tensor([[False, True, True, True, True], [True, True, True, True, False]])
    torch.testing.assert_close(attention_mask, expected_mask)
    # the response continues from the last prompt position: 1 -> 2, 3; 2 -> 3, 4
    torch.testing.assert_close(position_ids, torch.tensor([[0, 0, 1, 2, 3], [0, 1, 2, 3, 4]]))


def test_concat_prompt_response_mrope_positions_continue_each_row():
    # (B=1, R=4, P=3): text row 0..2, vision rows end at 1 (an image compressed the positions)
    prompt_pos = torch.tensor([[[0, 1, 2], [0, 1, 1], [0, 1, 1], [0, 1, 1]]])
    _, _, position_ids = concat_prompt_response(
        torch.tensor([[3, 4, 5]]),
        torch.ones(1, 3, dtype=torch.bool),
        prompt_pos,
        torch.tensor([[6, 7]]),
        torch.ones(1, 2, dtype=torch.bool),
    )
    expected = torch.tensor([[[0, 1, 2, 3, 4], [0, 1, 1, 2, 3], [0, 1, 1, 2, 3], [0, 1, 1, 2, 3]]])
    torch.testing.assert_close(position_ids, expected)


def test_build_rollout_batch_keys_values_and_objects():
    prompts = Batch(
        {
            "input_ids": torch.tensor([[0, 3], [0, 3], [2, 3], [2, 3]]),
            "attention_mask": torch.tensor([[False, True], [False, True], [True, True], [True, True]]),
            "position_ids": torch.tensor([[0, 0], [0, 0], [0, 1], [0, 1]]),
        },
        {"uid": ["a", "a", "b", "b"], "raw_prompt_ids": [[3], [3], [2, 3], [2, 3]]},
    )
    out = build_rollout_batch(
        prompts,
        responses=[[5, EOS], [6], [EOS], [7, 7, 7]],
        logprobs=[[-0.1, -0.2], [-0.3], [-0.4], [-0.5, -0.6, -0.7]],
        response_length=3,
        pad_token_id=PAD,
        eos_token_ids=[EOS],
    )
    torch.testing.assert_close(out["prompts"], prompts["input_ids"])
    torch.testing.assert_close(out["responses"], torch.tensor([[5, EOS, PAD], [6, PAD, PAD], [EOS, PAD, PAD], [7, 7, 7]]))
    expected_mask = torch.tensor([[True, True, False], [True, False, False], [True, False, False], [True, True, True]])
    torch.testing.assert_close(out["response_mask"], expected_mask)
    torch.testing.assert_close(
        out["rollout_logprobs"], torch.tensor([[-0.1, -0.2, 0.0], [-0.3, 0.0, 0.0], [-0.4, 0.0, 0.0], [-0.5, -0.6, -0.7]])
    )
    torch.testing.assert_close(out["input_ids"], torch.cat([prompts["input_ids"], out["responses"]], dim=1))
    torch.testing.assert_close(out["attention_mask"], torch.cat([prompts["attention_mask"], expected_mask], dim=1))
    expected_positions = torch.tensor([[0, 0, 1, 2, 3], [0, 0, 1, 2, 3], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]])
    torch.testing.assert_close(out["position_ids"], expected_positions)
    assert out["uid"] == ["a", "a", "b", "b"] and out["raw_prompt_ids"] == prompts["raw_prompt_ids"]


def test_ids_from_the_tiny_model(tiny_model_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    generation_config = GenerationConfig.from_pretrained(tiny_model_path)
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    # Qwen's convention, which the built-in model copies: pad = <|endoftext|>, EOS = <|im_end|> and
    # generation_config adds <|endoftext|>.
    assert pad_token_id(tokenizer) == endoftext
    assert eos_token_ids(tokenizer, generation_config) == sorted([im_end, endoftext])
    assert eos_token_ids(tokenizer, None) == [im_end]
