"""collate_prompts (left padding, masks, position ids) and concat_multi_modal_inputs."""

from __future__ import annotations

import torch

from easyvlm.data.collate import collate_prompts, concat_multi_modal_inputs, left_pad


def sample(ids, rows=None, **objects):
    ids = torch.tensor(ids)
    positions = torch.arange(len(ids)) if rows is None else torch.stack([torch.arange(len(ids)) + r for r in rows])
    base = dict(raw_prompt_ids=ids.tolist(), images=[], original_image_sizes=[], videos=[], multi_modal_inputs={}, ground_truth="g", uid="u", prompt_text="t", extra={})
    return dict(base, input_ids=ids, position_ids=positions, **objects)


def test_left_pad_values():
    out = left_pad([torch.tensor([1, 2, 3]), torch.tensor([4])], pad_value=9)
    assert out.tolist() == [[1, 2, 3], [9, 9, 4]]
    out = left_pad([torch.tensor([[1, 2], [3, 4]]), torch.tensor([[5], [6]])], pad_value=0)  # (R, L) rows
    assert out.tolist() == [[[1, 2], [3, 4]], [[0, 5], [0, 6]]]


def test_collate_prompts_left_pads_with_the_pad_id():
    batch = collate_prompts([sample([5, 6, 7], rows=[0, 0, 1, 2]), sample([8], rows=[0, 0, 0, 0], uid="v")], pad_token_id=99)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [99, 99, 8]]
    assert batch["attention_mask"].dtype == torch.bool
    assert batch["attention_mask"].tolist() == [[True, True, True], [False, False, True]]
    # (B, 4, P); padding positions hold 0
    assert batch["position_ids"].shape == (2, 4, 3)
    assert batch["position_ids"][0, 3].tolist() == [2, 3, 4]
    assert batch["position_ids"][1].tolist() == [[0, 0, 0]] * 4
    assert batch["raw_prompt_ids"] == [[5, 6, 7], [8]]
    assert batch["uid"] == ["u", "v"]


def test_concat_multi_modal_inputs_in_sample_order():
    a = {"pixel_values": torch.full((4, 3), 1.0), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    b = {"pixel_values": torch.full((6, 3), 2.0), "image_grid_thw": torch.tensor([[1, 2, 1], [1, 2, 2]])}
    out = concat_multi_modal_inputs([a, {}, b])
    assert out["pixel_values"][:, 0].tolist() == [1.0] * 4 + [2.0] * 6
    assert out["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 1], [1, 2, 2]]
    assert concat_multi_modal_inputs([{}, {}]) == {}
