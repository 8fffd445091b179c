"""Blocked token ids in the actor's / reference model's log-probs (easyvlm.workers.forward)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from easyvlm.rollout.tokens import blocked_token_ids
from easyvlm.workers.forward import logprobs_from_logits, model_blocked_token_ids, sampling_logits


def test_sampling_logits_by_hand():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]], requires_grad=True)
    out = sampling_logits(logits, 0.5, [3])
    # logits / 0.5 = [0, 2, 4, 6]; id 3 blocked: log-softmax over [0, 2, 4]
    torch.testing.assert_close(out, torch.tensor([[0.0, 2.0, 4.0, float("-inf")]]))
    lse = torch.logsumexp(torch.tensor([0.0, 2.0, 4.0]), 0)
    torch.testing.assert_close(logprobs_from_logits(out, torch.tensor([2])), (4.0 - lse).reshape(1))
    logprobs_from_logits(out, torch.tensor([2])).sum().backward()
    # d/dz_i of log p_2 = (1[i=2] - p_i) / 0.5; the blocked logit gets no gradient
    p = torch.softmax(torch.tensor([0.0, 2.0, 4.0]), 0)
    expected = torch.cat([(torch.tensor([0.0, 0.0, 1.0]) - p) / 0.5, torch.zeros(1)]).reshape(1, 4)
    torch.testing.assert_close(logits.grad, expected)
    assert sampling_logits(logits, 1.0, []) is not logits  # never the caller's tensor


def test_model_blocked_ids_are_the_rollouts(tiny_model_path, tmp_path, caplog):
    config = AutoConfig.from_pretrained(tiny_model_path)
    model = SimpleNamespace(config=config, name_or_path=tiny_model_path)
    expected = blocked_token_ids(AutoTokenizer.from_pretrained(tiny_model_path), config)
    assert model_blocked_token_ids(model) == tuple(expected)
    # no tokenizer beside the weights: the config's vision ids only, and a warning says so
    config.save_pretrained(tmp_path)
    bare = SimpleNamespace(config=AutoConfig.from_pretrained(tmp_path), name_or_path=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="easyvlm.workers.forward"):
        ids = model_blocked_token_ids(bare)
    vision = sorted({config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id})
    assert ids == tuple(vision) and set(ids) < set(expected)
    assert "no tokenizer beside the model" in caplog.text


def test_a_tokenizer_that_does_not_fit_the_model_is_an_error(tiny_model_path, tmp_path):
    config = AutoConfig.from_pretrained(tiny_model_path)
    config.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tmp_path).save_pretrained(tmp_path)  # transformers 5: an empty tokenizer
    model = SimpleNamespace(config=AutoConfig.from_pretrained(tmp_path), name_or_path=str(tmp_path))
    with pytest.raises(ValueError, match="it is not this model's tokenizer"):
        model_blocked_token_ids(model)
