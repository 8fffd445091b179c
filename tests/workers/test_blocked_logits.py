"""Blocked token ids in the actor's / reference model's log-probs (easyvlm.workers.forward).

The ids come from the run plan (``TokenIds.blocked``, read once from the tokenizer and the model
config: tests/rollout/test_tokens.py); tests/rollout/test_vllm.py checks that the actor's log-probs
with them equal vLLM's.
"""

from __future__ import annotations

import torch

from easyvlm.workers.forward import logprobs_from_logits, sampling_logits


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
