"""Pieces of the workers checked by hand: micro-batching by token budget, the response index,
LoRA merging, the vision-tower dummy, block selection for FSDP."""

from __future__ import annotations

import torch

from easyvlm.data.batch import Batch
from easyvlm.workers.forward import response_valid_mask, scatter_response, split_by_token_budget
from easyvlm.workers.vision_dummy import DummyImage, with_dummy_image
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


def _batch(input_ids, responses, items):
    ids = torch.tensor(input_ids)
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids, dtype=torch.bool),
            "position_ids": torch.arange(ids.shape[1]).expand(ids.shape[0], 4, -1).clone(),
            "responses": torch.tensor(responses),
        },
        {"multi_modal_inputs": items},
    )


def test_with_dummy_image_adds_a_row_without_response_positions():
    pixels, grid = torch.zeros(4, 6), torch.tensor([[1, 2, 2]])
    dummy = DummyImage(image_token_id=99, pixel_values=pixels, image_grid_thw=grid, video_token_id=98)
    image = {"pixel_values": pixels, "image_grid_thw": grid}
    video = {"pixel_values_videos": pixels, "video_grid_thw": grid}
    # text only: a dummy video (first column) and a dummy image (last column), padding between
    out = with_dummy_image(_batch([[5, 6, 7, 8]], [[7, 8]], [{}]), dummy)
    assert out["input_ids"].tolist() == [[5, 6, 7, 8], [98, 0, 0, 99]]
    assert out["attention_mask"][1].tolist() == [True, False, False, True]
    assert response_valid_mask(out["attention_mask"], 2)[1].tolist() == [False, False]
    assert out["multi_modal_inputs"][1].keys() == {"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"}
    # images but no video: only the dummy video; videos but no image: only the dummy image
    out = with_dummy_image(_batch([[5, 6, 7, 8]], [[7, 8]], [image]), dummy)
    assert out["input_ids"][1].tolist() == [98, 0, 0, 0] and out["multi_modal_inputs"][1].keys() == video.keys()
    out = with_dummy_image(_batch([[5, 6, 7, 8]], [[7, 8]], [video]), dummy)
    assert out["input_ids"][1].tolist() == [0, 0, 0, 99] and out["multi_modal_inputs"][1].keys() == image.keys()
    # both already there: the batch as is; a model without videos needs only an image
    both = _batch([[5, 6, 7, 8], [1, 2, 3, 4]], [[7, 8], [3, 4]], [image, video])
    assert with_dummy_image(both, dummy) is both
    image_only_model = DummyImage(image_token_id=99, pixel_values=pixels, image_grid_thw=grid)
    assert with_dummy_image(_batch([[5, 6, 7, 8]], [[7, 8]], [image]), image_only_model)["input_ids"].shape == (1, 4)
    # length 2 (prompt 1, response 1): one column of left padding first, so the two dummies are not adjacent
    out = with_dummy_image(_batch([[5, 6]], [[6]], [{}]), dummy)
    assert out["input_ids"].tolist() == [[0, 5, 6], [98, 0, 99]]
    assert out["attention_mask"].tolist() == [[False, True, True], [True, False, True]]
    assert response_valid_mask(out["attention_mask"], 1).tolist() == [[True], [False]]
    assert out["position_ids"][0, 0].tolist() == [0, 0, 1]


def test_micro_batches_follow_the_micro_batching_spec():
    """micro_batch_size_per_device_*, dynamic_batching and max_token_len_per_device (a role's
    MicroBatching) decide how a rank's samples are cut into forward passes."""
    from easyvlm.workers.specs import MicroBatching
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


def test_a_checkpoint_directory_that_ranks_do_not_share_is_named(tmp_path):
    """Two machines without shared storage: each rank wrote into its own disk. Found at the save."""
    import pytest

    from easyvlm.workers.training import check_shared_checkpoint_dir

    torch.save({}, tmp_path / "extra_state_rank0.pt")
    torch.save({}, tmp_path / "extra_state_rank1.pt")
    check_shared_checkpoint_dir(tmp_path, rank=0, world=2, timeout=0.0)  # both visible: fine
    with pytest.raises(RuntimeError, match=r"rank 0 \(host .*\) does not see the files of rank\(s\) \[2\].*"
                                           r"trainer.save_checkpoint_path.*every node \(and the driver\) mounts"):
        check_shared_checkpoint_dir(tmp_path, rank=0, world=3, timeout=0.0)
