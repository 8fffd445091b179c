"""Padding-free (packed) forward: equal to the padded SDPA forward, on the tiny Qwen2.5-VL with
images and ragged lengths and on a text-only model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from models_testing import build_tiny_text_model
from PIL import Image

from easyvlm.models.padding_free import (
    VARLEN_ATTENTION,
    cu_seqlens_from_position_ids,
    pack_inputs,
    register_varlen_attention,
)


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny models on a shared 2-core machine: one thread avoids oversubscription (10x faster here)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_cu_seqlens_from_position_ids():
    # sequences of 3, 2 and 1 tokens start where the position is 0
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0]])
    assert cu_seqlens_from_position_ids(position_ids).tolist() == [0, 3, 5, 6]


def test_pack_inputs_by_hand():
    # two rows, L = 4: row 0 = [pad 11 12 13], row 1 = [21 22 pad pad]
    input_ids = torch.tensor([[0, 11, 12, 13], [21, 22, 0, 0]])
    mask = torch.tensor([[False, True, True, True], [True, True, False, False]])
    # mRoPE layout (B, 4, L): rows 1..3 differ so that we can see which row went where
    pos = torch.zeros(2, 4, 4, dtype=torch.long)
    pos[0, 0] = torch.tensor([0, 0, 1, 2])
    pos[0, 1:] = torch.tensor([[0, 5, 6, 7], [0, 5, 9, 7], [0, 5, 6, 8]])
    pos[1, 0] = torch.tensor([0, 1, 0, 0])
    pos[1, 1:] = torch.tensor([[0, 1, 0, 0], [0, 1, 0, 0], [0, 4, 0, 0]])
    packed = pack_inputs(input_ids, mask, pos)
    assert packed.input_ids.tolist() == [[11, 12, 13, 21, 22]]
    assert packed.position_ids.shape == (4, 1, 5)
    assert packed.position_ids[:, 0].tolist() == [
        [0, 1, 2, 0, 1],  # text row rebuilt: restarts at each sequence
        [5, 6, 7, 0, 1],
        [5, 9, 7, 0, 1],
        [5, 6, 8, 0, 4],
    ]
    assert packed.padded_to_packed.tolist() == [[-1, 0, 1, 2], [3, 4, -1, -1]]
    # 1-D positions are kept as given (and must be 0, 1, ... per sequence)
    packed_1d = pack_inputs(input_ids, mask, torch.tensor([[0, 0, 1, 2], [0, 1, 0, 0]]))
    assert packed_1d.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    with pytest.raises(ValueError, match="0, 1, ... per sequence"):
        pack_inputs(input_ids, mask, torch.tensor([[0, 1, 2, 3], [0, 1, 0, 0]]))
    with pytest.raises(ValueError, match=r"sequences \[1\] have no attended token"):
        pack_inputs(input_ids, torch.tensor([[True] * 4, [False] * 4]), pos)


def _varlen_copy(model_dir: str, auto_cls, attn):
    register_varlen_attention()
    return auto_cls.from_pretrained(model_dir, attn_implementation=attn, dtype=torch.float32).eval()


def test_vl_packed_logits_equal_padded(tiny_model_path):
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    from easyvlm.models.position_ids import get_position_ids

    processor = AutoProcessor.from_pretrained(tiny_model_path)
    config = AutoConfig.from_pretrained(tiny_model_path)
    rng = np.random.default_rng(0)
    image = lambda w, h: Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))  # noqa: E731
    vision = "<|vision_start|><|image_pad|><|vision_end|>"
    # ragged: an image prompt, a short text-only one, a long one with a different image size
    texts = [
        f"<|im_start|>user\n{vision}what?<|im_end|>\n",
        "hi",
        f"{vision}count all the dots in this picture, please",
    ]
    enc = processor(text=texts, images=[image(56, 56), image(84, 56)], return_tensors="pt", padding=True)
    mask = enc["attention_mask"].bool()
    assert len(set(mask.sum(-1).tolist())) == 3  # really ragged
    pos = get_position_ids(enc["input_ids"], mask, enc["image_grid_thw"], model_config=config)  # (B, 4, L)
    vision_inputs = dict(pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"])

    reference = AutoModelForImageTextToText.from_pretrained(tiny_model_path, attn_implementation="sdpa").eval()
    with torch.no_grad():
        padded_inputs = dict(input_ids=enc["input_ids"], attention_mask=mask, position_ids=pos.transpose(0, 1))
        padded = reference(**padded_inputs, **vision_inputs).logits

    attn = {"": "sdpa", "text_config": VARLEN_ATTENTION, "vision_config": "sdpa"}
    model = _varlen_copy(tiny_model_path, AutoModelForImageTextToText, attn)
    assert model.config.text_config._attn_implementation == VARLEN_ATTENTION
    packed_in = pack_inputs(enc["input_ids"], mask, pos)
    with torch.no_grad():
        packed = model(input_ids=packed_in.input_ids, position_ids=packed_in.position_ids, **vision_inputs).logits
        # the same model also runs the padded layout (its attention falls back to SDPA with the mask)
        padded_again = model(**padded_inputs, **vision_inputs).logits
    torch.testing.assert_close(packed[0], padded[mask])
    torch.testing.assert_close(padded_again[mask], padded[mask], rtol=0, atol=0)
    # and the packing matters: without sequence boundaries (one causal run) the logits differ
    with torch.no_grad():
        one_run = model(input_ids=packed_in.input_ids, position_ids=packed_in.position_ids[1:], **vision_inputs).logits
    assert (one_run[0] - padded[mask]).abs().max() > 1e-2


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_text_only_packed_logits_equal_padded(tmp_path, model_type):
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_text_model(tmp_path, model_type)
    gen = torch.Generator().manual_seed(0)
    lengths = [7, 3, 5]
    L = max(lengths)
    input_ids = torch.randint(0, 256, (3, L), generator=gen)
    mask = torch.arange(L)[None, :] >= torch.tensor([L - n for n in lengths])[:, None]  # left padded
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)

    reference = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    model = _varlen_copy(model_dir, AutoModelForCausalLM, VARLEN_ATTENTION)
    packed_in = pack_inputs(input_ids, mask, pos)
    with torch.no_grad():
        padded = reference(input_ids=input_ids, attention_mask=mask, position_ids=pos).logits
        packed = model(input_ids=packed_in.input_ids, position_ids=packed_in.position_ids).logits
    torch.testing.assert_close(packed[0], padded[mask])
