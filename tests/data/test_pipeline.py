"""End to end: rows with 0, 1 and 3 images of mixed sizes -> a prompt Batch that the tiny model's
forward and vLLM both accept, and that gives them the same tokens, positions and pixels.

References: each sample run alone, unpadded, through transformers with the model computing its
own position ids (``mm_token_type_ids`` given, ``position_ids`` not); and vLLM's expansion of
``raw_prompt_ids`` plus its prompt log-probs.
"""

from __future__ import annotations

import pytest
import torch
from data_testing import assert_vllm_matches_the_forward, make_image, write_jsonl

from easyvlm.data.collate import collate_prompts, concat_multi_modal_inputs
from easyvlm.models.position_ids import to_model_layout


@pytest.fixture(scope="module")
def prompt_batch(tmp_path_factory, processor, model_config):
    from data_testing import data_config

    from easyvlm.data.dataset import RLDataset

    root = tmp_path_factory.mktemp("pipeline")
    for name, (w, h) in {"a.png": (97, 55), "b.png": (30, 200), "c.png": (250, 57), "d.png": (61, 61)}.items():
        make_image(root / "img" / name, w, h, colour=(len(name) * 40 % 255, 90, 10 * w % 255))
    rows = [
        {"problem": "How many?", "answer": "0"},
        {"problem": "<image>Which shape?", "answer": "1", "images": ["img/d.png"]},
        {"problem": "Compare <image>, <image> and <image>.", "answer": "3", "images": ["img/a.png", "img/b.png", "img/c.png"]},
    ]
    dataset = RLDataset(str(write_jsonl(root / "rows.jsonl", rows)), data_config(), processor.tokenizer, processor, model_config)
    return collate_prompts([dataset[i] for i in range(len(dataset))], dataset.pad_token_id)


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def unpadded(batch, i):
    return batch["input_ids"][i][batch["attention_mask"][i]]


def test_batch_layout(prompt_batch, model_config):
    assert prompt_batch["input_ids"].shape[0] == 3
    assert [len(images) for images in prompt_batch["images"]] == [0, 1, 3]
    n_image_tokens = (prompt_batch["input_ids"] == model_config.image_token_id).sum(-1).tolist()
    # d 61x61 -> 56x56: 2*2 = 4 ; a 84x56: 6, b 28x196: 7, c 252x56: 18
    assert n_image_tokens == [0, 4, 31]
    grids = concat_multi_modal_inputs(prompt_batch["multi_modal_inputs"])["image_grid_thw"]
    assert grids.tolist() == [[1, 4, 4], [1, 4, 6], [1, 14, 2], [1, 4, 18]]
    assert int((grids.prod(-1) // 4).sum()) == sum(n_image_tokens)


def test_position_ids_equal_the_tiny_models_rope_index(prompt_batch, hf_model, model_config):
    ids, mask = prompt_batch["input_ids"], prompt_batch["attention_mask"]
    grids = concat_multi_modal_inputs(prompt_batch["multi_modal_inputs"])["image_grid_thw"]
    rope, _ = hf_model.model.get_rope_index(
        ids, mm_token_type_ids=(ids == model_config.image_token_id).long(), image_grid_thw=grids, attention_mask=mask.long()
    )
    hf_model.model.rope_deltas = None
    assert torch.equal(to_model_layout(prompt_batch["position_ids"])[1:], rope)


@torch.no_grad()
def test_forward_on_the_batch_equals_each_sample_alone(prompt_batch, hf_model, model_config):
    mm = concat_multi_modal_inputs(prompt_batch["multi_modal_inputs"])
    logits = hf_model(
        input_ids=prompt_batch["input_ids"],
        attention_mask=prompt_batch["attention_mask"],
        position_ids=to_model_layout(prompt_batch["position_ids"]),
        **mm,
    ).logits
    for i in range(len(prompt_batch)):
        ids = unpadded(prompt_batch, i)[None]
        sample_mm = prompt_batch["multi_modal_inputs"][i]
        alone = hf_model(
            input_ids=ids,
            mm_token_type_ids=(ids == model_config.image_token_id).long(),  # the model computes its own positions
            **sample_mm,
        ).logits[0]
        # float32; padded vs unpadded attention sums in a different order
        torch.testing.assert_close(logits[i][prompt_batch["attention_mask"][i]], alone, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_vllm_accepts_the_same_ids_and_images(prompt_batch, hf_model, tiny_model_path, processor):
    assert_vllm_matches_the_forward(prompt_batch, hf_model, tiny_model_path, processor, {"image": 3})
