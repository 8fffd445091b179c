"""End to end with videos, for each builtin family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): rows mixing
text, images, a video file and a frame list -> a prompt Batch that the model's forward and vLLM
both accept, with the same tokens, positions and pixels.

References (independent of easyvlm's code): transformers' ``get_rope_index`` for the positions of
rows without videos (and of Qwen3-VL's videos); each sample run alone, unpadded, through
transformers; vLLM's expansion of ``raw_prompt_ids`` with the videos and its prompt log-probs,
which also checks the positions after a Qwen2/2.5-VL video, where transformers 5.19 departs from
Qwen's reference code (easyvlm.models.position_ids).
"""

from __future__ import annotations

import pytest
import torch
from data_testing import assert_vllm_matches_the_forward, data_config, write_jsonl
from test_videos import video_rows

from easyvlm.data.collate import collate_prompts, concat_multi_modal_inputs
from easyvlm.models.position_ids import to_model_layout
from easyvlm.rollout.hf import mm_token_type_ids

FAMILIES = ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl"]


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
    if name == "tiny-qwen3-vl":
        # patch 16, merge 2: 56x56 frames -> 64x64 -> 2x2 tokens per temporal patch; a text timestamp
        # before each temporal patch (Qwen3-VL), so one grid row per video with t kept
        assert video_tokens == [0, 0, 16, 8, 16]
        assert "second_per_grid_ts" not in mm
    else:
        # patch 14, merge 2: 56x56 frames -> 2x2 tokens per temporal patch of 2 frames
        assert video_tokens == [0, 0, 16, 8, 16]
        assert mm["video_grid_thw"].tolist() == [[4, 4, 4], [2, 4, 4], [4, 4, 4]]
        if name == "tiny-qwen2.5-vl":  # sampled at 2 fps (file), frame list at data.video_fps 2
            assert mm["second_per_grid_ts"].tolist() == [1.0, 1.0, 1.0]


def test_position_ids_equal_the_models_rope_index_where_they_agree(video_batch, hf_model, family):
    """transformers 5.19 continues the text after a Qwen2/2.5-VL video from start + max(h, w), Qwen's
    reference code and vLLM from the largest position + 1: those rows are checked against vLLM below
    and in tests/models/test_position_ids.py. Text, image and Qwen3-VL rows equal transformers'."""
    name, _, _, model_config = family
    ids, mask = video_batch["input_ids"], video_batch["attention_mask"]
    mm = concat_multi_modal_inputs(video_batch["multi_modal_inputs"])
    kwargs = {k: mm[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if k in mm}
    rope, _ = hf_model.model.get_rope_index(
        ids, mm_token_type_ids=mm_token_type_ids(ids, model_config).long(), attention_mask=mask.long(), **kwargs
    )
    hf_model.model.rope_deltas = None
    ours = to_model_layout(video_batch["position_ids"])[1:]
    rows = list(range(len(video_batch))) if name == "tiny-qwen3-vl" else [0, 1]
    assert torch.equal(ours[:, rows], rope[:, rows])
    if name != "tiny-qwen3-vl":  # the video's own positions agree; the text after it starts later
        i = 2
        video = (ids[i] == model_config.video_token_id).nonzero()[:, 0]
        assert torch.equal(ours[:, i, : int(video[-1]) + 1], rope[:, i, : int(video[-1]) + 1])
        assert (ours[:, i, -1] > rope[:, i, -1]).all()


@torch.no_grad()
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
        if has_video(video_batch, i) and name != "tiny-qwen3-vl":  # easyvlm's positions (see above), unpadded
            position_kwargs = {"position_ids": to_model_layout(video_batch["position_ids"][i : i + 1, :, -ids.shape[1] :])}
        else:  # the model computes its own positions
            position_kwargs = {"mm_token_type_ids": mm_token_type_ids(ids, model_config)}
        alone = hf_model(input_ids=ids, **position_kwargs, **video_batch["multi_modal_inputs"][i]).logits[0]
        # float32; padded vs unpadded attention sums in a different order
        torch.testing.assert_close(logits[i][video_batch["attention_mask"][i]], alone, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_vllm_expands_the_videos_to_the_same_tokens_and_log_probs(video_batch, hf_model, family):
    """Each image and video placeholder (and Qwen3-VL's timestamps) expanded into exactly the tokens
    the training forward sees, and its log-probs within 1e-4; a wrong frame, frame order or temporal
    position changes the log-probs after the video by far more (measured 8e-3)."""
    _, path, processor, _ = family
    assert_vllm_matches_the_forward(video_batch, hf_model, path, processor, {"image": 1, "video": 1})
