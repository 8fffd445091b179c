"""Position ids against transformers' own computation, exact equality.

References (independent of easyvlm): ``model.model.get_rope_index`` (rows 1..3) and the model's own
``_prepare_position_ids_for_generation`` (all 4 rows, the layout ``generate`` feeds the forward), on
throwaway tiny Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5 / Qwen3.5-MoE / Qwen3-VL-MoE models built from
configs (each family's own ``get_rope_index``; the Qwen3 ones split videos into one-frame grids).
"""

from __future__ import annotations

import random
import types

import pytest
import torch

from easyvlm.models.position_ids import (
    extend_position_ids,
    get_position_ids,
    text_position_ids,
    to_model_layout,
    uses_mrope,
)

IMAGE, VIDEO, VSTART, VEND, PAD = 290, 291, 292, 293, 294
MERGE = 2
TEXT = dict(
    vocab_size=300,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    eos_token_id=0,
    pad_token_id=PAD,
)
ROPE = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
VISION = dict(depth=1, num_heads=2, spatial_merge_size=MERGE)
TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND)


def _build(family: str):
    import transformers as tf

    if family == "qwen2_vl":
        config = tf.Qwen2VLConfig(
            text_config=dict(TEXT, rope_parameters=ROPE),
            vision_config=dict(VISION, embed_dim=16, hidden_size=32),
            **TOKENS,
        )
        return tf.Qwen2VLForConditionalGeneration(config).eval()
    if family == "qwen2_5_vl":
        config = tf.Qwen2_5_VLConfig(
            text_config=dict(TEXT, rope_parameters=ROPE),
            vision_config=dict(VISION, hidden_size=16, intermediate_size=32, out_hidden_size=32, tokens_per_second=2),
            **TOKENS,
        )
        return tf.Qwen2_5_VLForConditionalGeneration(config).eval()
    if family == "qwen3_vl":
        if not hasattr(tf, "Qwen3VLConfig"):
            pytest.skip("this transformers has no Qwen3-VL")
        config = tf.Qwen3VLConfig(
            text_config=dict(TEXT, head_dim=16, rope_parameters=dict(ROPE, mrope_interleaved=True)),
            vision_config=dict(VISION, hidden_size=16, intermediate_size=32, out_hidden_size=32, deepstack_visual_indexes=[0]),
            **TOKENS,
        )
        return tf.Qwen3VLForConditionalGeneration(config).eval()
    if family == "qwen3_vl_moe":
        config = tf.Qwen3VLMoeConfig(
            text_config=dict(TEXT, head_dim=16, rope_parameters=dict(ROPE, mrope_interleaved=True), **EXPERTS),
            vision_config=dict(VISION, hidden_size=16, intermediate_size=32, out_hidden_size=32, deepstack_visual_indexes=[0]),
            **TOKENS,
        )
        return tf.Qwen3VLMoeForConditionalGeneration(config).eval()
    if family in ("qwen3_5", "qwen3_5_moe"):
        # one gated-DeltaNet layer; a quarter of head_dim 64 rotates: 8 pairs = mrope_section 2 + 3 + 3
        text = dict(
            TEXT, head_dim=64, layer_types=["linear_attention"], linear_num_key_heads=1, linear_num_value_heads=2,
            linear_key_head_dim=8, linear_value_head_dim=8,
            rope_parameters=dict(ROPE, mrope_interleaved=True, partial_rotary_factor=0.25),
        )
        vision = dict(VISION, hidden_size=16, intermediate_size=32, out_hidden_size=32)
        if family == "qwen3_5":
            config = tf.Qwen3_5Config(text_config=text, vision_config=vision, **TOKENS)
            return tf.Qwen3_5ForConditionalGeneration(config).eval()
        text = dict(text, shared_expert_intermediate_size=16, **EXPERTS)
        config = tf.Qwen3_5MoeConfig(text_config=text, vision_config=vision, **TOKENS)
        return tf.Qwen3_5MoeForConditionalGeneration(config).eval()
    raise ValueError(family)


EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe", "qwen3_vl_moe"]
# A text timestamp before every frame of a video; get_rope_index splits a video into one-frame grids.
PER_FRAME = ["qwen3_vl", "qwen3_5", "qwen3_5_moe", "qwen3_vl_moe"]


@pytest.fixture(scope="module")
def models():
    return {}


def model_for(models, family):
    if family not in models:
        models[family] = _build(family)
    return models[family]


def _image_tokens(grid):
    t, h, w = grid
    return [VSTART] + [IMAGE] * (t * h * w // MERGE**2) + [VEND]


def make_case(seed: int, kind: str):
    """A left-padded batch of chat-like sequences with random text and images of random sizes.

    kind: "text" (no images), "one" (one image per sample), "several" (0-3 images of different
    sizes per sample). Returns input_ids (B, L), attention_mask (B, L), image_grid_thw (N, 3).
    """
    rng = random.Random(seed)
    batch = rng.randint(1, 4)
    seqs, grids = [], []
    for _ in range(batch):
        n_images = {"text": 0, "one": 1, "several": rng.randint(0, 3)}[kind]
        seq = [rng.randrange(0, 250) for _ in range(rng.randint(1, 6))]
        for _ in range(n_images):
            # grid h, w in patches: multiples of the merge size, deliberately non-square
            grid = (1, MERGE * rng.randint(1, 5), MERGE * rng.randint(1, 5))
            grids.append(grid)
            seq += _image_tokens(grid) + [rng.randrange(0, 250) for _ in range(rng.randint(1, 5))]
        seqs.append(seq)
    length = max(map(len, seqs)) + rng.randint(0, 3)  # sometimes every row is padded
    input_ids = torch.full((batch, length), PAD)
    mask = torch.zeros(batch, length, dtype=torch.bool)
    for b, seq in enumerate(seqs):
        input_ids[b, length - len(seq) :] = torch.tensor(seq)
        mask[b, length - len(seq) :] = True
    image_grid_thw = torch.tensor(grids, dtype=torch.long) if grids else None
    return input_ids, mask, image_grid_thw


def reference(model, input_ids, mask, image_grid_thw, video_grid_thw=None, second_per_grid_ts=None):
    """transformers: (rope rows (3, B, L), the 4-row ids generate() builds (4, B, L))."""
    mm_token_type_ids = (input_ids == IMAGE).long() + 2 * (input_ids == VIDEO).long()
    kwargs = dict(mm_token_type_ids=mm_token_type_ids, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw)
    if second_per_grid_ts is not None:
        kwargs["second_per_grid_ts"] = second_per_grid_ts
    rope, _ = model.model.get_rope_index(input_ids, attention_mask=mask.long(), **kwargs)
    model.model.rope_deltas = None
    gen = model._prepare_position_ids_for_generation(input_ids, dict(kwargs, input_ids=input_ids, attention_mask=mask.long()))
    model.model.rope_deltas = None
    return rope, gen


CASES = [(seed, kind) for seed in range(8) for kind in ("text", "one", "several")]  # 24 cases per family


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed,kind", CASES)
def test_matches_transformers_rope_index(models, family, seed, kind):
    model = model_for(models, family)
    input_ids, mask, grids = make_case(seed, kind)
    ours = get_position_ids(input_ids, mask, grids, None, model.config)
    rope, gen = reference(model, input_ids, mask, grids)
    assert ours.shape == (input_ids.shape[0], 4, input_ids.shape[1])
    assert torch.equal(to_model_layout(ours)[1:], rope)
    assert torch.equal(to_model_layout(ours), gen)


def test_hand_computed_example():
    """One image of grid (1, 4, 6) after 2 text tokens, left padded by 1.

    Unpadded: text a b -> 0 1; <vision_start> -> 2; 6 image tokens (h 2 x w 3 after merge 2)
    start at 3: T = 3 3 3 3 3 3, H = 3 3 3 4 4 4, W = 3 4 5 3 4 5; the next text token continues
    at 3 + max(2, 3) = 6: <vision_end> -> 6, c -> 7. Text row: 0 .. 10.
    """
    config = types.SimpleNamespace(
        model_type="qwen2_5_vl",
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_config=types.SimpleNamespace(spatial_merge_size=2, tokens_per_second=2),
    )
    ids = torch.tensor([[PAD, 1, 2, VSTART] + [IMAGE] * 6 + [VEND, 3]])
    mask = ids != PAD
    got = get_position_ids(ids, mask, torch.tensor([[1, 4, 6]]), None, config)
    expected = torch.tensor(
        [
            [0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
            [0, 0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7],
            [0, 0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7],
            [0, 0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7],
        ]
    )
    assert torch.equal(got[0], expected)
    # extended by 2 response tokens: 11 12 in the text row, 8 9 in the rope rows
    ext = extend_position_ids(got, 2)
    assert torch.equal(ext[0, :, -2:], torch.tensor([[11, 12], [8, 9], [8, 9], [8, 9]]))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", range(4))
def test_extend_matches_rope_index_over_prompt_plus_response(models, family, seed):
    """Positions of a generated response = get_rope_index over the full prompt + response."""
    model = model_for(models, family)
    input_ids, mask, grids = make_case(100 + seed, "several")
    rng = random.Random(seed)
    response_length = rng.randint(1, 6)
    response = torch.randint(0, 250, (input_ids.shape[0], response_length), generator=torch.Generator().manual_seed(seed))
    full_ids = torch.cat([input_ids, response], dim=1)
    full_mask = torch.cat([mask, torch.ones_like(response, dtype=torch.bool)], dim=1)

    prompt_ids = get_position_ids(input_ids, mask, grids, None, model.config)
    extended = extend_position_ids(prompt_ids, response_length)
    rope, _ = reference(model, full_ids, full_mask, grids)
    assert torch.equal(to_model_layout(extended)[1:], rope)
    assert torch.equal(extended[:, 0], text_position_ids(full_mask))


def video_case(family):
    """Two videos (t > 1) between text; Qwen3-VL (and Qwen3.5, the MoEs) put a text timestamp before every frame."""
    grids = [(2, 4, 2), (3, 2, 4)]
    seq = [5, 6]
    for t, h, w in grids:
        if family in PER_FRAME:
            for _ in range(t):
                seq += [7, VSTART] + [VIDEO] * (h * w // 4) + [VEND]
        else:
            seq += [VSTART] + [VIDEO] * (t * h * w // 4) + [VEND]
        seq += [8]
    ids = torch.tensor([[PAD] + seq])
    seconds = torch.tensor([0.5, 2.0]) if family == "qwen2_5_vl" else None
    return ids, ids != PAD, torch.tensor(grids), seconds


def vllm_positions(family, model_config, seq, video_grid_thw, seconds):
    """vLLM's mRoPE positions for one unpadded sequence of videos (its own implementation)."""
    import importlib
    from types import SimpleNamespace

    module = importlib.import_module(f"vllm.model_executor.models.{family}")
    cls = getattr(module, {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}[family])
    starts = [i for i, token in enumerate(seq) if token == VIDEO and (i == 0 or seq[i - 1] != VIDEO)]
    features = []
    for k, start in enumerate(starts):
        data = {"video_grid_thw": SimpleNamespace(data=video_grid_thw[k])}
        if seconds is not None:
            data["second_per_grid_ts"] = SimpleNamespace(data=seconds[k])
        features.append(SimpleNamespace(mm_position=SimpleNamespace(offset=start), modality="video", data=data))
    fake = SimpleNamespace(config=model_config)
    fake.iter_mm_grid_thw = lambda feats: cls.iter_mm_grid_thw(fake, feats)
    positions, _ = cls.get_mrope_input_positions(fake, list(seq), features)
    return positions


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_videos_match_vllm_and_qwens_reference(models, family):
    """Videos between text, with Qwen2.5-VL's seconds-per-grid scaling of the T row. After a video the
    text continues from the largest position + 1 (Qwen's reference code, vLLM); transformers 5.19
    continues from start + max(h, w), which only differs when the time axis reaches further."""
    model = model_for(models, family)
    ids, mask, video_grid_thw, seconds = video_case(family)
    ours = get_position_ids(ids, mask, None, video_grid_thw, model.config, second_per_grid_ts=seconds)
    reference = vllm_positions(family, model.config, ids[0][mask[0]].tolist(), video_grid_thw, seconds)
    assert torch.equal(ours[0, 1:, mask[0]], reference)
    if family == "qwen2_vl":
        # by hand: text 5, 6 -> 0, 1; vision_start 2; video 1 (t, h, w) = (2, 2, 1) merged: T 3..4, H 3..4, W 3 (max 4);
        # vision_end 5, text 8 -> 6, vision_start 7; video 2 (3, 1, 2): T 8..10, H 8, W 8..9 (max 10); vision_end 11
        assert ours[0, 1:, -2].tolist() == [11, 11, 11]  # transformers: 8 + max(1, 2) = 10
        rope, _ = reference_rope(model, ids, mask, video_grid_thw, seconds)
        assert rope[:, 0, -2].tolist() == [10, 10, 10]


def reference_rope(model, ids, mask, video_grid_thw, seconds):
    return reference(model, ids, mask, None, video_grid_thw.clone(), seconds)


@pytest.mark.parametrize("family", PER_FRAME)
def test_qwen3_videos_match_transformers(models, family):
    """Qwen3-VL, Qwen3.5, Qwen3.5-MoE, Qwen3-VL-MoE: every frame is its own t = 1 grid after a
    timestamp, so transformers agrees.

    By hand (after the left pad): text 5, 6 -> 0, 1; video 1, (t, h, w) = (2, 4, 2), merged 2 x 1 per
    frame: frame 1: stamp 2, vision_start 3, 2 tokens T 4 4, H 4 5, W 4 4, vision_end 4 + max(2, 1) = 6;
    frame 2: stamp 7, start 8, tokens at 9 (H 9 10), end 11; text 8 -> 12; video 2, (3, 2, 4), 1 x 2 per
    frame: frame k (0..2) stamp 13 + 5k, start 14 + 5k, tokens at 15 + 5k (W +0 +1), end 17 + 5k; so
    frame 3's end is 27 and the last text 28.
    """
    model = model_for(models, family)
    ids, mask, video_grid_thw, _ = video_case(family)
    ours = get_position_ids(ids, mask, None, video_grid_thw, model.config)
    rope, gen = reference_rope(model, ids, mask, video_grid_thw, None)
    assert torch.equal(to_model_layout(ours)[1:], rope)
    assert torch.equal(to_model_layout(ours), gen)
    assert ours[0, 1:, 5:7].tolist() == [[4, 4], [4, 5], [4, 4]]  # frame 1's tokens (after pad, 5, 6, stamp, start)
    assert ours[0, 1:, -1].tolist() == [28, 28, 28] and ours[0, 0, -1] == ids.shape[1] - 2  # text row: 0 .. n-2


@pytest.mark.parametrize("family", PER_FRAME)
def test_qwen3_video_positions_extend_over_a_response(models, family):
    """A prompt with a per-frame video + a response: extend_position_ids equals transformers'
    get_rope_index (T/H/W) and the generate() 4 rows over the whole sequence, where the T/H/W rows
    run behind the text row (a frame of 2 x 2 tokens advances them by 2).

    By hand, row 0: text 5, 6 -> 0, 1; frame 1 of (2, 4, 4) (2 x 2 tokens per frame): stamp 2, vision_start
    3, tokens T 4 4 4 4, H 4 4 5 5, W 4 5 4 5, vision_end 4 + 2 = 6; frame 2: stamp 7, start 8, tokens at
    9, end 11; text 8 -> 12; response -> 13 14 15 16. Its text row: 17 prompt tokens (2 + 2 x 7 + 1), so
    the response at 17 .. 20. Row 1 (text 5 6 8, left padded): 0 1 2, response 3 .. 6 in every row.
    """
    model = model_for(models, family)
    frame = [7, VSTART] + [VIDEO] * 4 + [VEND]
    row0 = [5, 6] + frame + frame + [8]
    ids = torch.tensor([row0, [PAD] * (len(row0) - 3) + [5, 6, 8]])
    mask = ids != PAD
    video_grid_thw = torch.tensor([[2, 4, 4]])
    response = torch.tensor([[9, 10, 11, 12], [12, 11, 10, 9]])
    full_ids = torch.cat([ids, response], dim=1)
    full_mask = torch.cat([mask, torch.ones_like(response, dtype=torch.bool)], dim=1)
    extended = extend_position_ids(get_position_ids(ids, mask, None, video_grid_thw, model.config), response.shape[1])
    rope, gen = reference_rope(model, full_ids, full_mask, video_grid_thw, None)
    assert torch.equal(to_model_layout(extended)[1:, full_mask], rope[:, full_mask])
    assert torch.equal(to_model_layout(extended)[:, full_mask], gen[:, full_mask])
    assert extended[0, :, 4:8].tolist() == [[4, 5, 6, 7], [4, 4, 4, 4], [4, 4, 5, 5], [4, 5, 4, 5]]  # frame 1's tokens
    assert extended[0, :, -4:].tolist() == [[17, 18, 19, 20]] + [[13, 14, 15, 16]] * 3
    assert extended[1, :, -4:].tolist() == [[3, 4, 5, 6]] * 4


def test_text_only_model_gets_1d_ids():
    """A text-only config: (B, L) ids counting real tokens; 0 at padding (like transformers' generate)."""
    config = types.SimpleNamespace(model_type="qwen2")
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    got = get_position_ids(ids, mask, None, None, config)
    assert torch.equal(got, torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]))
    assert torch.equal(extend_position_ids(got, 2), torch.tensor([[0, 0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6]]))
    assert not uses_mrope(config)


def test_mismatch_names_the_sample(models):
    model = model_for(models, "qwen2_5_vl")
    ids = torch.tensor([[1, VSTART] + [IMAGE] * 4 + [VEND], [1, VSTART] + [IMAGE] * 3 + [VEND, 2]])
    mask = torch.ones_like(ids, dtype=torch.bool)
    grids = torch.tensor([[1, 4, 4], [1, 4, 4]])  # 4 tokens each; sample 1 has only 3
    with pytest.raises(ValueError, match=r"sample 1: image grid .* needs 4 image tokens at position 2, found 3"):
        get_position_ids(ids, mask, grids, None, model.config)
    with pytest.raises(ValueError, match=r"1 image and 0 video grid rows have no tokens"):
        get_position_ids(ids[:1], mask[:1], grids, None, model.config)
    with pytest.raises(ValueError, match=r"sample 0: more images in input_ids"):
        get_position_ids(ids[:1], mask[:1], None, None, model.config)


def test_unknown_vision_model_type_is_refused():
    config = types.SimpleNamespace(model_type="llava", vision_config=object())
    with pytest.raises(NotImplementedError, match="llava"):
        get_position_ids(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool), None, None, config)
