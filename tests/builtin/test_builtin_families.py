"""The three builtin families (tiny Qwen2-VL, Qwen2.5-VL, Qwen3-VL): each loads with transformers'
Auto classes as its own architecture and processor, builds reproducibly, and its real processor
output gives the position ids of transformers' ``get_rope_index`` (images, and Qwen3-VL's videos with
per-frame timestamps); ``RLDataset`` sizes the synthetic task's images to the family's factor.

References: transformers (classes, processor, ``get_rope_index`` and the 4-row ids ``generate``
builds), never easyvlm's own code.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from easyvlm.builtin.models import BUILTIN_MODELS, SPECIAL_TOKENS, build_model, materialize_model
from easyvlm.models.position_ids import get_position_ids, to_model_layout

# family name -> (builtin model, model class, processor class, video processor class, patch size)
FAMILIES = {
    "qwen2_vl": ("tiny-qwen2-vl", "Qwen2VLForConditionalGeneration", "Qwen2VLProcessor", "Qwen2VLVideoProcessor", 14),
    "qwen2_5_vl": (
        "tiny-qwen2.5-vl", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor", 14,
    ),
    "qwen3_vl": ("tiny-qwen3-vl", "Qwen3VLForConditionalGeneration", "Qwen3VLProcessor", "Qwen3VLVideoProcessor", 16),
}


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
    assert len(tokenizer) == 256 + len(SPECIAL_TOKENS) == model.config.get_text_config().vocab_size
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert model.config.image_token_id == ids["<|image_pad|>"] == processor.image_token_id
    assert model.config.video_token_id == ids["<|video_pad|>"] == processor.video_token_id
    assert (model.config.vision_start_token_id, model.config.vision_end_token_id) == (
        ids["<|vision_start|>"], ids["<|vision_end|>"],
    )
    text_config = model.config.get_text_config()
    assert (text_config.eos_token_id, text_config.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert 0.3e6 < sum(p.numel() for p in model.parameters()) < 1.5e6  # tiny


def test_qwen3_vl_architecture(easyvlm_cache_dir):
    """What makes the tiny Qwen3-VL a Qwen3-VL: interleaved mRoPE, q/k norms, DeepStack."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(materialize_model("tiny-qwen3-vl", cache_dir=easyvlm_cache_dir))
    text = model.config.text_config
    assert text.rope_parameters["mrope_interleaved"] and text.head_dim * text.num_attention_heads == text.hidden_size
    assert model.config.vision_config.deepstack_visual_indexes == [0]
    assert len(model.model.visual.deepstack_merger_list) == 1
    assert hasattr(model.model.language_model.layers[0].self_attn, "q_norm")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen3-vl"])  # tiny-qwen2.5-vl: test_models.py
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


def test_qwen3_vl_video_timestamps_and_position_ids(easyvlm_cache_dir):
    """A 4-frame video (2 temporal patches): Qwen3-VL's processor puts a ``<t seconds>`` text
    before each temporal patch's tokens, which the byte-level tokenizer spells in byte tokens, the
    same ids alone (as vLLM tokenizes them) as in context; the position ids are transformers'.
    (Qwen2/2.5-VL videos: easyvlm follows Qwen's and vLLM's positions, not transformers 5.19's;
    tests/data checks them against vLLM.)"""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model_dir = materialize_model("tiny-qwen3-vl", cache_dir=easyvlm_cache_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
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
    changes = ({}, {"family": "qwen2_vl"}, {"vision_deepstack_indexes": (0,)}, {"vision_num_position_embeddings": 64})
    keys = {spec_key(dataclasses.replace(spec, **change)) for change in changes}
    assert len(keys) == 4
