"""The six builtin families (tiny Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, Qwen3.5-MoE, Qwen3-VL-MoE):
each loads with transformers' Auto classes as its own architecture and processor, builds
reproducibly, and its real processor output gives the position ids of transformers'
``get_rope_index`` (images, and the per-frame videos with timestamps of the families on Qwen3-VL's
processor), also over a prompt + response training row; ``RLDataset`` sizes the synthetic task's
images to the family's factor. The new families' own architecture (Qwen3.5's hybrid decoder and
partial rotary, the experts) is checked on the modules transformers builds from the files.

References: transformers (classes, processor, ``get_rope_index`` and the 4-row ids ``generate``
builds), never easyvlm's own code.
"""

from __future__ import annotations

import hashlib
import importlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from easyvlm.builtin.models import BUILTIN_MODELS, SPECIAL_TOKENS, build_model, materialize_model
from easyvlm.builtin.synthetic import PALETTE, SHAPES
from easyvlm.models.position_ids import extend_position_ids, get_position_ids, to_model_layout

# family name -> (builtin model, model class, processor class, video processor class, patch size)
FAMILIES = {
    "qwen2_vl": ("tiny-qwen2-vl", "Qwen2VLForConditionalGeneration", "Qwen2VLProcessor", "Qwen2VLVideoProcessor", 14),
    "qwen2_5_vl": (
        "tiny-qwen2.5-vl", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor", 14,
    ),
    "qwen3_vl": ("tiny-qwen3-vl", "Qwen3VLForConditionalGeneration", "Qwen3VLProcessor", "Qwen3VLVideoProcessor", 16),
    # the 2026 families: Qwen3-VL's processor and video processor (transformers has no Qwen3.5 ones)
    "qwen3_5": ("tiny-qwen3.5", "Qwen3_5ForConditionalGeneration", "Qwen3VLProcessor", "Qwen3VLVideoProcessor", 16),
    "qwen3_5_moe": (
        "tiny-qwen3.5-moe", "Qwen3_5MoeForConditionalGeneration", "Qwen3VLProcessor", "Qwen3VLVideoProcessor", 16,
    ),
    "qwen3_vl_moe": (
        "tiny-qwen3-vl-moe", "Qwen3VLMoeForConditionalGeneration", "Qwen3VLProcessor", "Qwen3VLVideoProcessor", 16,
    ),
}
# Families whose videos carry a text timestamp before each temporal patch (Qwen3-VL's processor)
# and whose get_rope_index splits a video into one-frame grids.
PER_FRAME = ("qwen3_vl", "qwen3_5", "qwen3_5_moe", "qwen3_vl_moe")
# The bases of the 2026 families have the synthetic task's answer words as single tokens after the
# specials: 5 colours + 3 shapes = 8 words, so 256 bytes + 8 specials + 8 words = 272 ids.
WORD_TOKEN_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_vl_moe")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(family, easyvlm_cache_dir) -> str:
    return str(materialize_model(FAMILIES[family][0], cache_dir=easyvlm_cache_dir))


@pytest.fixture(scope="module")
def assets(model_dir):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    return AutoModelForImageTextToText.from_pretrained(model_dir).eval(), AutoProcessor.from_pretrained(model_dir)


def _noise(width: int, height: int, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _prompt(processor, content: list[dict]) -> str:
    messages = [{"role": "user", "content": [*content, {"type": "text", "text": "What is it?"}]}]
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _rope_reference(model, enc) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' position ids of a processor output: get_rope_index (T/H/W rows, (3, B, L)) and
    the 4-row ids that generate() feeds the forward."""
    keys = ("mm_token_type_ids", "image_grid_thw", "video_grid_thw", "second_per_grid_ts")
    kwargs = {k: enc[k] for k in keys if k in enc}
    rope, _ = model.model.get_rope_index(enc["input_ids"], attention_mask=enc["attention_mask"], **kwargs)
    model.model.rope_deltas = None
    inputs = dict(kwargs, input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
    generate = model._prepare_position_ids_for_generation(enc["input_ids"], inputs)
    model.model.rope_deltas = None
    return rope, generate


def test_auto_classes_give_the_family(family, assets):
    model, processor = assets
    _, model_cls, processor_cls, video_cls, patch = FAMILIES[family]
    assert model.config.model_type == family
    assert type(model).__name__ == model_cls
    assert type(processor).__name__ == processor_cls
    assert type(processor.video_processor).__name__ == video_cls
    assert processor.image_processor.patch_size == processor.video_processor.patch_size == patch
    assert model.config.vision_config.patch_size == patch
    # ids from the tokenizer, as everywhere: the config and processor agree with it
    tokenizer = processor.tokenizer
    words = [*PALETTE, *SHAPES] if family in WORD_TOKEN_FAMILIES else []
    assert len(tokenizer) == (272 if words else 264) == model.config.get_text_config().vocab_size
    assert model.get_output_embeddings().weight.shape[0] == len(tokenizer)  # not one id more
    # each answer word is one token, ids 264.. in order after the specials (and spelled in bytes where
    # the base has no word tokens)
    for k, word in enumerate(words):
        assert tokenizer(word, add_special_tokens=False)["input_ids"] == [256 + len(SPECIAL_TOKENS) + k]
        assert tokenizer.decode([256 + len(SPECIAL_TOKENS) + k]) == word
    if not words:
        assert len(tokenizer("purple", add_special_tokens=False)["input_ids"]) == len("purple")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert model.config.image_token_id == ids["<|image_pad|>"] == processor.image_token_id
    assert model.config.video_token_id == ids["<|video_pad|>"] == processor.video_token_id
    assert (model.config.vision_start_token_id, model.config.vision_end_token_id) == (
        ids["<|vision_start|>"], ids["<|vision_end|>"],
    )
    text_config = model.config.get_text_config()
    assert (text_config.eos_token_id, text_config.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert 0.3e6 < sum(p.numel() for p in model.parameters()) < 1.5e6  # tiny


def _load(name, cache_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(materialize_model(name, cache_dir=cache_dir)).eval()


@pytest.mark.parametrize("name", ["tiny-qwen3-vl", "tiny-qwen3-vl-moe"])
def test_qwen3_vl_architecture(name, easyvlm_cache_dir):
    """What makes the tiny Qwen3-VL (and Qwen3-VL-MoE) a Qwen3-VL: interleaved mRoPE, q/k norms, DeepStack."""
    model = _load(name, easyvlm_cache_dir)
    text = model.config.text_config
    assert text.rope_parameters["mrope_interleaved"] and text.head_dim * text.num_attention_heads == text.hidden_size
    assert model.config.vision_config.deepstack_visual_indexes == [0]
    assert len(model.model.visual.deepstack_merger_list) == 1
    assert all(hasattr(layer.self_attn, "q_norm") for layer in model.model.language_model.layers)
    _assert_interleaved_mrope(model, rotary_pairs=16)  # head_dim 32, all of it rotates


def _assert_interleaved_mrope(model, rotary_pairs: int) -> None:
    """transformers' rotary embedding of the model, given distinct T, H, W positions: rotary pair j turns
    by the position of row j % 3 (T H W T H W ..., interleaved mRoPE: sections [6, 5, 5] put H at pairs
    1 4 7 10 13 and W at 2 5 8 11 14; [3, 3, 2] put H at 1 4 7 and W at 2 5), and only 2 x rotary_pairs
    dims of the head get a cos/sin (transformers' apply_rotary_pos_emb passes the rest through)."""
    rotary = model.model.language_model.rotary_emb
    positions = torch.tensor([5, 11, 17]).view(3, 1, 1)  # T, H, W of one token
    x = torch.zeros(1, 1, model.config.text_config.hidden_size)
    cos, sin = rotary(x, positions)
    assert cos.shape[-1] == 2 * rotary_pairs == rotary.inv_freq.numel() * 2
    rows = torch.arange(rotary_pairs) % 3
    angles = positions.view(3)[rows].double() * rotary.inv_freq.double()
    torch.testing.assert_close(cos[0, 0].double(), torch.cat([angles, angles]).cos(), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[0, 0].double(), torch.cat([angles, angles]).sin(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["tiny-qwen3.5", "tiny-qwen3.5-moe"])
def test_qwen3_5_architecture(name, easyvlm_cache_dir):
    """What makes the tiny Qwen3.5 a Qwen3.5: layers 0-2 gated DeltaNet (linear attention: a causal
    convolution of width 4, 2 key heads, 4 value heads of 32), layer 3 gated softmax attention with
    q/k norms; a quarter of its head_dim of 64 rotates (16 dims, 8 frequency pairs, theta 1e7), in
    interleaved mRoPE; Qwen3-VL's vision tower without DeepStack."""
    model = _load(name, easyvlm_cache_dir)
    text = model.config.text_config
    assert text.layer_types == ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    layers = model.model.language_model.layers
    assert [hasattr(layer, "linear_attn") for layer in layers] == [True, True, True, False]
    assert [hasattr(layer, "self_attn") for layer in layers] == [False, False, False, True]
    for layer in layers[:3]:
        mixer = layer.linear_attn
        assert (mixer.num_k_heads, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim) == (2, 4, 32, 32)
        # the modules' own sizes: conv over q, k (2 heads x 32 each) and v (4 x 32): 64 + 64 + 128 = 256
        # channels, kernel 4; one decay and one beta per value head
        assert mixer.conv1d.kernel_size == (4,) and mixer.conv1d.weight.shape == (256, 1, 4)
        assert mixer.in_proj_qkv.weight.shape[0] == 256
        assert mixer.in_proj_a.weight.shape[0] == mixer.in_proj_b.weight.shape[0] == mixer.A_log.numel() == 4
    attention = layers[3].self_attn
    assert attention.head_dim == 64 and hasattr(attention, "q_norm") and hasattr(attention, "k_norm")
    # gated attention: q_proj gives the query and its output gate, 4 heads x 64 x 2 = 512
    assert attention.q_proj.weight.shape[0] == 512
    assert text.rope_parameters["partial_rotary_factor"] == 0.25
    inv_freq = model.model.language_model.rotary_emb.inv_freq  # rotary dim 64 / 4 = 16
    torch.testing.assert_close(inv_freq, 1.0 / (1e7 ** (torch.arange(0, 16, 2).float() / 16)), rtol=1e-6, atol=0)
    _assert_interleaved_mrope(model, rotary_pairs=8)
    # transformers' partial rotary: dims 16.. of q and k pass through apply_rotary_pos_emb unchanged
    module = importlib.import_module(type(attention).__module__)  # transformers' modeling_qwen3_5(_moe)
    cos, sin = model.model.language_model.rotary_emb(torch.zeros(1, 1, 128), torch.tensor([7, 8, 9]).view(3, 1, 1))
    q, k = torch.randn(1, 4, 1, 64), torch.randn(1, 2, 1, 64)
    q_out, k_out = module.apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(q_out[..., 16:], q[..., 16:]) and torch.equal(k_out[..., 16:], k[..., 16:])
    assert not torch.allclose(q_out[..., :16], q[..., :16])
    # no DeepStack: no config entry, no merger list, no parameter of it anywhere
    assert getattr(model.config.vision_config, "deepstack_visual_indexes", None) in (None, [])
    assert not hasattr(model.model.visual, "deepstack_merger_list")
    assert not [n for n, _ in model.named_parameters() if "deepstack" in n]
    assert model.config.vision_config.patch_size == 16 and model.config.vision_config.num_position_embeddings == 256


@pytest.mark.parametrize("name,shared", [("tiny-qwen3.5-moe", True), ("tiny-qwen3-vl-moe", False)])
def test_moe_architecture(name, shared, easyvlm_cache_dir):
    """Every decoder layer a sparse MoE: 4 experts of width 48 (fused: gate_up (4, 2 x 48, 128), down
    (4, 128, 48)), a router of 4 rows picking the top 2 with weights that sum to 1, every expert
    picked for some of 256 random tokens (a random router, not a degenerate one); Qwen3.5-MoE adds a
    shared expert of width 48 with its gate (one logit per token), Qwen3-VL-MoE has none."""
    model = _load(name, easyvlm_cache_dir)
    text = model.config.text_config
    assert (text.num_experts, text.num_experts_per_tok, text.moe_intermediate_size) == (4, 2, 48)
    generator = torch.Generator().manual_seed(0)
    for layer in model.model.language_model.layers:
        moe = layer.mlp
        assert moe.experts.gate_up_proj.shape == (4, 96, 128) and moe.experts.down_proj.shape == (4, 128, 48)
        assert moe.gate.weight.shape == (4, 128) and (moe.gate.top_k, moe.gate.num_experts) == (2, 4)
        _, weights, chosen = moe.gate(torch.randn(256, 128, generator=generator))
        assert chosen.shape == (256, 2) and (chosen[:, 0] != chosen[:, 1]).all()
        torch.testing.assert_close(weights.sum(-1), torch.ones(256))
        assert set(chosen.flatten().tolist()) == {0, 1, 2, 3}
        if shared:
            assert moe.shared_expert.gate_proj.weight.shape == (48, 128)
            assert moe.shared_expert.down_proj.weight.shape == (128, 48)
            assert moe.shared_expert_gate.weight.shape == (1, 128)
        else:
            assert not hasattr(moe, "shared_expert")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize(  # tiny-qwen2.5-vl: test_models.py
    "name", ["tiny-qwen2-vl", "tiny-qwen3-vl", "tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-qwen3-vl-moe"]
)
def test_build_is_reproducible(name, easyvlm_cache_dir, tmp_path):
    model_dir = materialize_model(name, cache_dir=easyvlm_cache_dir)
    build_model(BUILTIN_MODELS[name], tmp_path, name=name)
    for file in ("model.safetensors", "config.json", "tokenizer.json", "processor_config.json", "chat_template.jinja"):
        assert _sha256(tmp_path / file) == _sha256(Path(model_dir) / file), file


def test_processor_expands_image_tokens(family, assets):
    """factor = patch x merge (28, or 32 for Qwen3-VL): 2 x 2 factors -> 4 tokens, 3 x 2 -> 6."""
    model, processor = assets
    factor = FAMILIES[family][4] * 2
    for (width, height), grid in (((2 * factor, 2 * factor), [1, 4, 4]), ((3 * factor, 2 * factor), [1, 4, 6])):
        text = _prompt(processor, [{"type": "image"}])
        enc = processor(text=[text], images=[_noise(width, height)], return_tensors="pt")
        assert enc["image_grid_thw"].tolist() == [grid]
        assert int((enc["input_ids"] == model.config.image_token_id).sum()) == grid[1] * grid[2] // 4
        patch = FAMILIES[family][4]
        assert enc["pixel_values"].shape == (grid[1] * grid[2], 3 * 2 * patch * patch)


def test_image_prompt_position_ids_equal_transformers(family, assets):
    """A left-padded batch from the real processor: two images of different sizes, one portrait
    image, and a text-only prompt."""
    model, processor = assets
    factor = FAMILIES[family][4] * 2
    texts = [
        _prompt(processor, [{"type": "image"}, {"type": "image"}]),
        _prompt(processor, [{"type": "image"}]),
        _prompt(processor, []),
    ]
    images = [_noise(2 * factor, 3 * factor, 1), _noise(5 * factor, 2 * factor, 2), _noise(3 * factor, 4 * factor, 3)]
    processor.tokenizer.padding_side = "left"
    enc = processor(text=texts, images=images, padding=True, return_tensors="pt")
    ours = get_position_ids(enc["input_ids"], enc["attention_mask"], enc["image_grid_thw"], None, model.config)
    rope, generate = _rope_reference(model, enc)
    assert torch.equal(to_model_layout(ours)[1:], rope)
    assert torch.equal(to_model_layout(ours), generate)
    assert (rope[1] != rope[2]).any() and (rope[0] != rope[2]).any()  # images: really 3-D positions


@pytest.mark.parametrize("family", PER_FRAME, indirect=True)
def test_qwen3_vl_video_timestamps_and_position_ids(family, assets):
    """A 4-frame video (2 temporal patches): Qwen3-VL's processor (also Qwen3.5's, Qwen3.5-MoE's and
    Qwen3-VL-MoE's) puts a ``<t seconds>`` text before each temporal patch's tokens, which the
    byte-level tokenizer spells in byte tokens, the same ids alone (as vLLM tokenizes them) as in
    context; the position ids are transformers' (each family's own ``get_rope_index``, which splits
    the video into one-frame grids). (Qwen2/2.5-VL videos: easyvlm follows Qwen's and vLLM's
    positions, not transformers 5.19's; tests/data checks them against vLLM.)"""
    model, processor = assets
    frames = np.stack([np.asarray(_noise(64, 64, seed)) for seed in range(4)])
    metadata = {"fps": 2.0, "frames_indices": [0, 1, 2, 3], "total_num_frames": 4}
    enc = processor(
        text=[_prompt(processor, [{"type": "video"}])], videos=[frames], video_metadata=[metadata],
        do_sample_frames=False, return_tensors="pt",
    )
    assert enc["video_grid_thw"].tolist() == [[2, 4, 4]]
    # frames at 0, 0.5, 1, 1.5 s; a timestamp per temporal patch (the mean of its 2 frames), inside
    # the template's own <|vision_start|> ... <|vision_end|> (transformers >= 5.10, as vLLM)
    frame = "<|vision_start|>" + "<|video_pad|>" * 4 + "<|vision_end|>"
    expanded = f"<|vision_start|><0.2 seconds>{frame}<1.2 seconds>{frame}<|vision_end|>"
    assert expanded in processor.tokenizer.decode(enc["input_ids"][0])
    ids = enc["input_ids"][0].tolist()
    for stamp in ("<0.2 seconds>", "<1.2 seconds>"):
        alone = processor.tokenizer(stamp, add_special_tokens=False)["input_ids"]
        assert len(alone) == len(stamp) and processor.tokenizer.unk_token_id not in alone
        at = [k for k in range(len(ids)) if ids[k : k + len(alone)] == alone]
        assert len(at) == 1 and ids[at[0] + len(alone)] == model.config.vision_start_token_id
    ours = get_position_ids(enc["input_ids"], enc["attention_mask"], None, enc["video_grid_thw"], model.config)
    rope, generate = _rope_reference(model, enc)
    assert torch.equal(to_model_layout(ours)[1:], rope)
    assert torch.equal(to_model_layout(ours), generate)


def _response_batch(tokenizer, texts: list[str], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded response ids (B, length) and their mask, as a rollout returns them."""
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    ids = torch.full((len(rows), length), tokenizer.pad_token_id)
    mask = torch.zeros(len(rows), length, dtype=torch.bool)
    for b, row in enumerate(rows):
        ids[b, : len(row)], mask[b, : len(row)] = torch.tensor(row), True
    return ids, mask


def test_training_row_position_ids_equal_transformers_over_prompt_and_response(family, assets):
    """A training row: the prompt's ids from ``get_position_ids``, extended over the response
    (``concat_prompt_response``: ``extend_position_ids``), equal at every real token what transformers
    computes over the whole prompt + response sequence (``get_rope_index`` and the 4 rows of
    ``_prepare_position_ids_for_generation``): left-padded prompts (two images of different shapes;
    for the per-frame families a 6-frame video of non-square frames), right-padded responses of
    different lengths (with the answer words, single tokens in the 2026 bases), one without EOS.
    (Qwen2/2.5-VL: no video, where easyvlm follows Qwen's reference after it, not transformers 5.19.)"""
    from easyvlm.rollout.postprocess import concat_prompt_response

    model, processor = assets
    factor = FAMILIES[family][4] * 2
    tokenizer = processor.tokenizer
    tokenizer.padding_side = "left"
    per_frame = family in PER_FRAME
    texts = [_prompt(processor, [{"type": "image"}, {"type": "image"}]), _prompt(processor, [])]
    images = [_noise(3 * factor, 2 * factor, 4), _noise(factor, 4 * factor, 5)]  # merged grids 2 x 3 and 4 x 1
    kwargs = {}
    if per_frame:
        texts.insert(1, _prompt(processor, [{"type": "video"}]))
        # 6 frames of 128 x 64 (w x h): 3 temporal patches of a 4 x 8 patch grid = 2 x 4 tokens each
        frames = np.stack([np.asarray(_noise(4 * factor, 2 * factor, seed)) for seed in range(6)])
        metadata = {"fps": 2.0, "frames_indices": list(range(6)), "total_num_frames": 6}
        kwargs = dict(videos=[frames], video_metadata=[metadata], do_sample_frames=False)
    enc = processor(text=texts, images=images, padding=True, return_tensors="pt", **kwargs)
    if per_frame:
        assert enc["video_grid_thw"].tolist() == [[3, 4, 8]]
    answers = ["red circle<|im_end|>", "a green square<|im_end|>", "purple triangle"][: len(texts)]
    responses, response_mask = _response_batch(tokenizer, answers, length=20)
    # "red circle<|im_end|>": red, space, circle, EOS = 4 tokens with word tokens, 3 + 1 + 6 + 1 = 11 bytes
    # without; "a green square<|im_end|>": 6 or 15; "purple triangle": 3 or 15
    lengths = [4, 6, 3] if family in WORD_TOKEN_FAMILIES else [11, 15, 15]
    assert response_mask.sum(-1).tolist() == lengths[: len(texts)]

    prompt_positions = get_position_ids(
        enc["input_ids"], enc["attention_mask"], enc["image_grid_thw"], enc.get("video_grid_thw"), model.config
    )
    input_ids, attention_mask, positions = concat_prompt_response(
        enc["input_ids"], enc["attention_mask"], prompt_positions, responses, response_mask
    )
    assert torch.equal(positions, extend_position_ids(prompt_positions, responses.shape[1]))
    full = dict(enc, input_ids=input_ids, attention_mask=attention_mask.long(),
                mm_token_type_ids=torch.cat([enc["mm_token_type_ids"], torch.zeros_like(responses)], dim=1))
    rope, generate = _rope_reference(model, full)
    ours = to_model_layout(positions)
    assert torch.equal(ours[1:, attention_mask], rope[:, attention_mask])
    assert torch.equal(ours[:, attention_mask], generate[:, attention_mask])
    # not trivially the text row: after images (and the video) the T/H/W rows run behind it
    for b in range(len(texts) - 1):
        assert (rope[:, b, attention_mask[b]][:, -1] < generate[0, b, attention_mask[b]][-1]).all()


def test_rl_dataset_sizes_the_synthetic_images_to_the_family(family, assets, synthetic_train_file):
    """builtin:synthetic rows (56x56 images) with the demo's data.min/max_pixels: each image is
    fitted to the family's factor (56x56 for 28, 64x64 for 32), a fixed point of the processor (its
    own resize gives the same pixels), and the prompt's position ids are transformers'."""
    from easyvlm.config.schema import DataConfig
    from easyvlm.data.dataset import RLDataset

    model, processor = assets
    factor = FAMILIES[family][4] * 2
    data = DataConfig(train_files=synthetic_train_file, prompt_key="problem", min_pixels=3136, max_pixels=50176)
    dataset = RLDataset(synthetic_train_file, data, processor.tokenizer, processor, model.config)
    for i in range(3):
        sample = dataset[i]
        (image,) = sample["images"]
        assert image.size == (2 * factor, 2 * factor)
        mm = sample["multi_modal_inputs"]
        assert mm["image_grid_thw"].tolist() == [[1, 4, 4]]
        again = processor(text=[sample["prompt_text"]], images=[image], return_tensors="pt")  # with its own resize
        assert again["input_ids"][0].tolist() == sample["input_ids"].tolist()
        torch.testing.assert_close(again["pixel_values"], mm["pixel_values"], rtol=0, atol=0)
        ids = sample["input_ids"][None]
        enc = dict(again, attention_mask=torch.ones_like(ids))
        rope, _ = _rope_reference(model, enc)
        assert torch.equal(sample["position_ids"][1:], rope[:, 0])


def test_cache_key_counts_the_family_fields():
    """The fields that came with the families are out of ``repr`` (the Qwen2.5-VL specs kept their
    cache keys) but still change the key when set."""
    import dataclasses

    from easyvlm.builtin.models import spec_key

    spec = BUILTIN_MODELS["tiny-qwen2.5-vl"]
    assert "family" not in repr(spec)
    assert spec_key(dataclasses.replace(spec, family="qwen2_5_vl")) == spec_key(spec)
    changes = (
        {}, {"family": "qwen2_vl"}, {"vision_deepstack_indexes": (0,)}, {"vision_num_position_embeddings": 64},
        # the Qwen3.5 and MoE fields
        {"layer_types": ("linear_attention", "full_attention")}, {"linear_key_heads": 2}, {"linear_value_heads": 4},
        {"linear_head_dim": 32}, {"linear_conv_kernel": 3}, {"head_dim": 64}, {"partial_rotary_factor": 0.25},
        {"num_experts": 4}, {"num_experts_per_tok": 2}, {"moe_intermediate_size": 48},
    )
    keys = {spec_key(dataclasses.replace(spec, **change)) for change in changes}
    assert len(keys) == len(changes) == 14
    # the six tiny families: six builds
    names = ("tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-qwen3-vl-moe")
    assert len({spec_key(BUILTIN_MODELS[name]) for name in names}) == 6
