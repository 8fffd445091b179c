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
    varlen_attention_forward,
)
from easyvlm.models.segments import Segment, packed_segments

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


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


def test_packed_segments_by_hand():
    # trunk of 4 (positions 0-3), two branches on its first 2 tokens (positions restart at 2), then
    # a new trunk of 2 and a branch of 1 on its first token
    positions = [0, 1, 2, 3, 2, 3, 4, 2, 0, 1, 1]
    assert packed_segments(positions) == [
        Segment(0, 4),
        Segment(4, 3, prefix=2, trunk_start=0),
        Segment(7, 1, prefix=2, trunk_start=0),
        Segment(8, 2),
        Segment(10, 1, prefix=1, trunk_start=8),
    ]
    # plain packing: every sequence is a trunk
    assert packed_segments([0, 1, 2, 0, 1, 0]) == [Segment(0, 3), Segment(3, 2), Segment(5, 1)]
    with pytest.raises(ValueError, match="start at position 3 but the preceding sequence has 2 tokens"):
        packed_segments([0, 1, 3, 4])
    with pytest.raises(ValueError, match="start at position 2 but the preceding sequence has 0 tokens"):
        packed_segments([2, 3])


def test_pack_inputs_with_a_shared_prompt_by_hand():
    # P = 3, T = 2. Rows 0 and 1 share the prompt [pad 11 12]; row 2 has its own, [31 32 33].
    input_ids = torch.tensor([[0, 11, 12, 13, 14], [0, 11, 12, 23, 0], [31, 32, 33, 34, 35]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 0], [1, 1, 1, 1, 1]]).bool()
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    packed = pack_inputs(input_ids, mask, pos, prompt_length=3, prompt_source=torch.tensor([0, 0, 2]))
    # row 1 keeps only its response token 23, at text position 2 (right after its 2 prompt tokens)
    assert packed.input_ids.tolist() == [[11, 12, 13, 14, 23, 31, 32, 33, 34, 35]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1, 2, 3, 4]]
    # row 1's prompt columns point at row 0's packed prompt tokens
    assert packed.padded_to_packed.tolist() == [[-1, 0, 1, 2, 3], [-1, 0, 1, 4, -1], [5, 6, 7, 8, 9]]
    assert packed_segments(packed.position_ids[0].tolist())[1] == Segment(4, 1, prefix=2, trunk_start=0)
    # a follower must come right after its source's group
    with pytest.raises(ValueError, match=r"rows \[2\] reuse a prompt that is not their predecessor's"):
        pack_inputs(input_ids, mask, pos, prompt_length=3, prompt_source=torch.tensor([0, 1, 0]))


@pytest.mark.parametrize("heads_kv", [4, 2])
def test_shared_prefix_attention_equals_a_dense_mask(heads_kv):
    # positions [0 1 2 3 4 | 3 4 5 | 3 4 5 | 3 | 0 1 | 1 2]: trunk 5, three branches on its first
    # 3 tokens (two of equal length: one batched call), trunk 2, one branch on its first token.
    positions = [0, 1, 2, 3, 4, 3, 4, 5, 3, 4, 5, 3, 0, 1, 1, 2]
    N, H, D = len(positions), 4, 8
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, N, D, generator=gen)
    k, v = torch.randn(2, 1, heads_kv, N, D, generator=gen)
    # the dense reference: token i sees token j iff j is in its own segment at or before it, or in
    # its trunk's first `prefix` tokens
    allowed = torch.zeros(N, N, dtype=torch.bool)
    for seg in packed_segments(positions):
        for i in range(seg.start, seg.start + seg.length):
            allowed[i, seg.start : i + 1] = True
            allowed[i, seg.trunk_start : seg.trunk_start + seg.prefix] = True
    assert allowed[5].tolist() == [1, 1, 1, 0, 0, 1] + [0] * 10  # first branch token: 3 prompt tokens + itself
    kr, vr = (t.repeat_interleave(H // heads_kv, dim=1) for t in (k, v))
    expected = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=allowed).transpose(1, 2)
    module = torch.nn.Module()
    out, _ = varlen_attention_forward(module, q, k, v, None, position_ids=torch.tensor([positions]))
    torch.testing.assert_close(out, expected)


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
