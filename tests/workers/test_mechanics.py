"""Pieces of the workers checked by hand: micro-batching by token budget, the response index,
LoRA merging, the vision-tower dummy, block selection for FSDP."""

from __future__ import annotations

import torch

from easyvlm.data.batch import Batch
from easyvlm.workers.forward import (
    DummyImage,
    response_valid_mask,
    scatter_response,
    split_by_token_budget,
    with_dummy_image,
)
from easyvlm.workers.fsdp import merge_lora_state_dict


def test_split_by_token_budget():
    assert split_by_token_budget([3, 4, 2, 5], 7) == [[0, 1], [2, 3]]
    assert split_by_token_budget([3, 4, 2, 5], 100) == [[0, 1, 2, 3]]
    # a sample longer than the budget gets a micro-batch of its own
    assert split_by_token_budget([9, 1, 1], 5) == [[0], [1, 2]]


def test_response_valid_mask():
    # P = 3, T = 3. row 0: prompt [pad a b], response [x y pad]; row 1: prompt [a b c], response [pad pad pad]
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    assert response_valid_mask(mask, 3).tolist() == [[True, True, False], [False, False, False]]


def test_scatter_response_keeps_grad():
    values = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    valid = torch.tensor([[True, False], [True, True]])
    out = scatter_response(values, valid)
    assert out.tolist() == [[1.0, 0.0], [2.0, 3.0]]
    out.sum().backward()
    assert values.grad.tolist() == [1.0, 1.0, 1.0]


def test_merge_lora_state_dict_by_hand():
    prefix = "base_model.model.layer."
    state = {
        prefix + "base_layer.weight": torch.eye(2),  # (out 2, in 2)
        prefix + "base_layer.bias": torch.tensor([1.0, 2.0]),
        prefix + "lora_A.default.weight": torch.tensor([[1.0, 2.0]]),  # (r 1, in 2)
        prefix + "lora_B.default.weight": torch.tensor([[3.0], [4.0]]),  # (out 2, r 1)
        "base_model.model.norm.weight": torch.ones(2),
    }
    merged = merge_lora_state_dict(state, scaling=0.5)
    # W + 0.5 * B @ A = I + 0.5 * [[3, 6], [4, 8]] = [[2.5, 3], [2, 5]]
    assert merged.keys() == {"layer.weight", "layer.bias", "norm.weight"}
    assert merged["layer.weight"].tolist() == [[2.5, 3.0], [2.0, 5.0]]
    assert merged["layer.bias"].tolist() == [1.0, 2.0]


def test_with_dummy_image_adds_a_row_without_response_positions():
    batch = Batch(
        {
            "input_ids": torch.tensor([[5, 6, 7, 8]]),
            "attention_mask": torch.ones(1, 4, dtype=torch.bool),
            "position_ids": torch.arange(4).expand(1, 4, 4).clone(),
            "responses": torch.tensor([[7, 8]]),
        },
        {"multi_modal_inputs": [{}]},
    )
    dummy = DummyImage(image_token_id=99, pixel_values=torch.zeros(4, 6), image_grid_thw=torch.tensor([[1, 2, 2]]))
    out = with_dummy_image(batch, dummy)
    assert out["input_ids"].tolist() == [[5, 6, 7, 8], [0, 0, 0, 99]]
    assert out["attention_mask"][1].tolist() == [False, False, False, True]
    assert response_valid_mask(out["attention_mask"], 2)[1].tolist() == [False, False]
    assert out["multi_modal_inputs"][1]["image_grid_thw"].tolist() == [[1, 2, 2]]


def test_micro_batches_follow_the_micro_batching_spec():
    """micro_batch_size_per_device_*, dynamic_batching and max_token_len_per_device (a role's
    MicroBatching) decide how a rank's samples are cut into forward passes."""
    from easyvlm.plan.specs import MicroBatching
    from easyvlm.workers.forward import micro_batches
    from easyvlm.workers.training import token_budget

    # 5 samples padded to 6 positions, attending 3, 4, 2, 5, 1 tokens
    lengths = [3, 4, 2, 5, 1]
    batch = Batch({"input_ids": torch.zeros(5, 6, dtype=torch.long),
                   "attention_mask": torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]})

    def cut(micro: MicroBatching) -> list[int]:
        return [len(m) for m in micro_batches(batch, micro.micro_batch_size, token_budget(micro, batch))]

    assert cut(MicroBatching(2, dynamic=False, max_token_len=None)) == [2, 2, 1]
    assert cut(MicroBatching(3, dynamic=False, max_token_len=None)) == [3, 2]
    # dynamic, no max_token_len: a budget of micro_batch_size x 6 padded positions = 12 tokens: 3+4+2 | 5+1
    assert cut(MicroBatching(2, dynamic=True, max_token_len=None)) == [3, 2]
    # max_token_len 7: 3+4 | 2+5 | 1
    assert cut(MicroBatching(2, dynamic=True, max_token_len=7)) == [2, 2, 1]
