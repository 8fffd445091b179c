"""End to end with videos, for each builtin family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5,
Qwen3.5-MoE, Qwen3-VL-MoE): rows mixing text, images, a video file and a frame list -> a prompt
Batch that the model's forward and vLLM both accept, with the same tokens, positions and pixels.

References (independent of easyvlm's code): transformers' ``get_rope_index`` for the positions of
rows without videos (and of the per-frame videos of the families on Qwen3-VL's processor, whose
``get_rope_index`` splits each video into one-frame grids); each sample run alone, unpadded, through
transformers; vLLM's expansion of ``raw_prompt_ids`` with the videos and its prompt log-probs,
which also checks the positions after a Qwen2/2.5-VL video, where transformers 5.19 departs from
Qwen's reference code (easyvlm.models.position_ids).
"""

from __future__ import annotations

import re

import pytest
import torch
from data_testing import assert_vllm_matches_the_forward, data_config, write_jsonl
from test_videos import video_rows

from easyvlm.data.collate import collate_prompts, concat_multi_modal_inputs
from easyvlm.models.position_ids import to_model_layout
from easyvlm.rollout.hf import mm_token_type_ids

FAMILIES = ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-qwen3-vl-moe"]
# Qwen3-VL's processor and video processor (patch 16, a text timestamp before each temporal patch):
# transformers' get_rope_index of these splits every video into one-frame grids, as easyvlm does.
PER_FRAME = {"tiny-qwen3-vl", "tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-qwen3-vl-moe"}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, easyvlm_cache_dir):
    """(name, model directory, processor, model config) of one builtin family."""
    from transformers import AutoConfig, AutoProcessor

    from easyvlm.builtin.models import materialize_model

    path = str(materialize_model(request.param, cache_dir=easyvlm_cache_dir))
    return request.param, path, AutoProcessor.from_pretrained(path), AutoConfig.from_pretrained(path)


@pytest.fixture(scope="module")
def video_batch(tmp_path_factory, family):
    from easyvlm.data.dataset import RLDataset

    _, _, processor, model_config = family
    root = tmp_path_factory.mktemp("video_pipeline")
    path = write_jsonl(root / "rows.jsonl", video_rows(root))
    dataset = RLDataset(str(path), data_config(), processor.tokenizer, processor, model_config)
    return collate_prompts([dataset[i] for i in range(len(dataset))], dataset.pad_token_id)


@pytest.fixture(scope="module")
def hf_model(family):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(family[1], dtype=torch.float32).eval()


def unpadded(batch, i):
    return batch["input_ids"][i][batch["attention_mask"][i]]


def has_video(batch, i):
    return bool(batch["videos"][i])


def test_video_tokens_and_timing(video_batch, family):
    name, _, _, model_config = family
    mm = concat_multi_modal_inputs(video_batch["multi_modal_inputs"])
    video_tokens = (video_batch["input_ids"] == model_config.video_token_id).sum(-1).tolist()
    if name in PER_FRAME:
        # patch 16, merge 2: 56x56 frames -> 64x64 -> 2x2 tokens per temporal patch; a text timestamp
        # before each temporal patch (Qwen3-VL's processor), so one grid row per video with t kept
        assert video_tokens == [0, 0, 16, 8, 16]
        assert mm["video_grid_thw"].tolist() == [[4, 4, 4], [2, 4, 4], [4, 4, 4]]
        assert "second_per_grid_ts" not in mm
        # the file: 16 frames at 4 fps sampled at 2 fps -> frames 0 2 4 6 9 11 13 15 at 0, 0.5, 1, 1.5,
        # 2.25, 2.75, 3.25, 3.75 s; a stamp per pair's mean, "%.1f": 0.25 -> 0.2, 1.25 -> 1.2, 2.5, 3.5.
        # The frame list (3 frames padded to 4 at data.video_fps 2): 0, 0.5, 1, 1.5 s -> 0.2, 1.2.
        file_stamps, list_stamps = ["0.2", "1.2", "2.5", "3.5"], ["0.2", "1.2"]
        tokenizer = family[2].tokenizer
        stamps = [re.findall(r"<([0-9.]+) seconds><\|vision_start\|>", tokenizer.decode(unpadded(video_batch, i)))
                  for i in range(len(video_batch))]
        assert stamps == [[], [], file_stamps, list_stamps, file_stamps]
    else:
        # patch 14, merge 2: 56x56 frames -> 2x2 tokens per temporal patch of 2 frames
        assert video_tokens == [0, 0, 16, 8, 16]
        assert mm["video_grid_thw"].tolist() == [[4, 4, 4], [2, 4, 4], [4, 4, 4]]
        if name == "tiny-qwen2.5-vl":  # sampled at 2 fps (file), frame list at data.video_fps 2
            assert mm["second_per_grid_ts"].tolist() == [1.0, 1.0, 1.0]


def test_position_ids_equal_the_models_rope_index_where_they_agree(video_batch, hf_model, family):
    """transformers 5.19 continues the text after a Qwen2/2.5-VL video from start + max(h, w), Qwen's
    reference code and vLLM from the largest position + 1: those rows are checked against vLLM below
    and in tests/models/test_position_ids.py. Text and image rows, and every row of the families with
    per-frame videos (Qwen3-VL, Qwen3.5, Qwen3.5-MoE, Qwen3-VL-MoE), equal transformers'."""
    name, _, _, model_config = family
    ids, mask = video_batch["input_ids"], video_batch["attention_mask"]
    mm = concat_multi_modal_inputs(video_batch["multi_modal_inputs"])
    kwargs = {k: mm[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if k in mm}
    rope, _ = hf_model.model.get_rope_index(
        ids, mm_token_type_ids=mm_token_type_ids(ids, model_config).long(), attention_mask=mask.long(), **kwargs
    )
    hf_model.model.rope_deltas = None
    ours = to_model_layout(video_batch["position_ids"])[1:]
    rows = list(range(len(video_batch))) if name in PER_FRAME else [0, 1]
    assert torch.equal(ours[:, rows], rope[:, rows])
    if name in PER_FRAME:  # and all 4 rows (text row first) as generate() builds them
        types = mm_token_type_ids(ids, model_config)
        inputs = dict(kwargs, input_ids=ids, attention_mask=mask.long(), mm_token_type_ids=types)
        generate = hf_model._prepare_position_ids_for_generation(ids, inputs)
        hf_model.model.rope_deltas = None
        assert torch.equal(to_model_layout(video_batch["position_ids"]), generate)
    else:  # the video's own positions agree; the text after it starts later
        i = 2
        video = (ids[i] == model_config.video_token_id).nonzero()[:, 0]
        assert torch.equal(ours[:, i, : int(video[-1]) + 1], rope[:, i, : int(video[-1]) + 1])
        assert (ours[:, i, -1] > rope[:, i, -1]).all()


@torch.no_grad()
# one thread: Qwen3.5's DeltaNet runs transformers' reference kernels (many small ops), 0.1 s a
# forward on one thread, 1-5 s on two threads of a busy 2-core machine
@pytest.mark.usefixtures("one_torch_thread")
def test_forward_on_the_batch_equals_each_sample_alone(video_batch, hf_model, family):
    name, _, _, model_config = family
    logits = hf_model(
        input_ids=video_batch["input_ids"],
        attention_mask=video_batch["attention_mask"],
        position_ids=to_model_layout(video_batch["position_ids"]),
        **concat_multi_modal_inputs(video_batch["multi_modal_inputs"]),
    ).logits
    for i in range(len(video_batch)):
        ids = unpadded(video_batch, i)[None]
        if has_video(video_batch, i) and name not in PER_FRAME:  # easyvlm's positions (see above), unpadded
            position_kwargs = {"position_ids": to_model_layout(video_batch["position_ids"][i : i + 1, :, -ids.shape[1] :])}
        else:  # the model computes its own positions
            position_kwargs = {"mm_token_type_ids": mm_token_type_ids(ids, model_config)}
        alone = hf_model(input_ids=ids, **position_kwargs, **video_batch["multi_modal_inputs"][i]).logits[0]
        # float32; padded vs unpadded attention sums in a different order
        torch.testing.assert_close(logits[i][video_batch["attention_mask"][i]], alone, rtol=1e-4, atol=1e-5)


# Not the Qwen3.5 families: vLLM 0.32's CPU backend runs their gated-DeltaNet layers in bfloat16 only
# ("CPU GDN attention requires BF16"), and these log-prob checks need float32 on both sides.
VLLM_FAMILIES = ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-qwen3-vl-moe"]


@pytest.mark.slow
@pytest.mark.parametrize("family", VLLM_FAMILIES, indirect=True)
def test_vllm_expands_the_videos_to_the_same_tokens_and_log_probs(video_batch, hf_model, family):
    """Each image and video placeholder (and Qwen3-VL's timestamps) expanded into exactly the tokens
    the training forward sees, and its log-probs within 1e-4; a wrong frame, frame order or temporal
    position changes the log-probs after the video by far more (measured 8e-3). Qwen3-VL-MoE: vLLM
    also reads the experts of the builtin model's file (checkpoint layout, transposed) as transformers does."""
    _, path, processor, _ = family
    assert_vllm_matches_the_forward(video_batch, hf_model, path, processor, {"image": 1, "video": 1})
