"""The built-in tiny Qwen2.5-VL: loads with transformers' Auto classes and vLLM, builds reproducibly,
and model paths resolve (or fail with a useful message)."""

from __future__ import annotations

import gc
import hashlib
import json
import time
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from easyvlm.builtin.models import (
    BUILTIN_MODELS,
    SPECIAL_TOKENS,
    build_model,
    build_tokenizer,
    materialize_model,
)
from easyvlm.models.paths import ModelNotFoundError, resolve_model_path

QUESTION = "What colour is the shape?"


def _image(side: int, colour=(220, 30, 30)) -> Image.Image:
    image = Image.new("RGB", (side, side), (255, 255, 255))
    ImageDraw.Draw(image).rectangle((side // 4, side // 4, side // 2, side // 2), fill=colour)
    return image


def _messages() -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]


@pytest.fixture(scope="module")
def hf_assets(tiny_model_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(tiny_model_path).eval()
    return model, AutoProcessor.from_pretrained(tiny_model_path), AutoTokenizer.from_pretrained(tiny_model_path)


def test_tokenizer_config_and_processor_agree(hf_assets):
    model, processor, tokenizer = hf_assets
    config = model.config
    # 256 byte tokens + the 8 special tokens, and not one id more (a random model must not be able
    # to sample an id the tokenizer cannot decode).
    assert len(tokenizer) == 256 + len(SPECIAL_TOKENS) == config.text_config.vocab_size
    assert model.get_output_embeddings().weight.shape[0] == len(tokenizer)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert config.image_token_id == ids["<|image_pad|>"] == processor.image_token_id
    assert config.video_token_id == ids["<|video_pad|>"] == processor.video_token_id
    assert config.vision_start_token_id == ids["<|vision_start|>"]
    assert config.vision_end_token_id == ids["<|vision_end|>"]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert config.text_config.eos_token_id == tokenizer.eos_token_id
    assert config.text_config.pad_token_id == tokenizer.pad_token_id
    generation = json.loads((Path(model.name_or_path) / "generation_config.json").read_text())
    assert tokenizer.eos_token_id in generation["eos_token_id"]
    # Byte-level: any text round-trips, one token per UTF-8 byte ("é" is 2 bytes).
    text = "héllo 3 <|image_pad|>"
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    assert len(tokenizer(text).input_ids) == len("héllo 3 ".encode()) + 1


def test_chat_template_renders_images_videos_and_text(hf_assets):
    _, processor, tokenizer = hf_assets
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "Hi?"}]},
        {"role": "assistant", "content": "red"},
    ]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
        "<|vision_start|><|video_pad|><|vision_end|>Hi?<|im_end|>\n"
        "<|im_start|>assistant\nred<|im_end|>\n"
    )
    assert tokenizer.apply_chat_template(messages, tokenize=False) == expected
    assert processor.apply_chat_template(messages, tokenize=False) == expected
    prompt = tokenizer.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(
    # side/14 patches per side, merged 2x2 into one token: 56 px -> 4x4 patches -> 4 tokens;
    # 84 px -> 6x6 -> 9 tokens.
    "side, grid, n_tokens",
    [(56, [1, 4, 4], 4), (84, [1, 6, 6], 9)],
)
def test_processor_expands_image_tokens(hf_assets, side, grid, n_tokens):
    model, processor, _ = hf_assets
    text = processor.apply_chat_template(_messages(), tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[_image(side)], return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [grid]
    merge = model.config.vision_config.spatial_merge_size
    n_pad = int((inputs["input_ids"] == model.config.image_token_id).sum())
    assert n_pad == n_tokens == int(inputs["image_grid_thw"].prod()) // merge**2
    # one row of 3*2*14*14 = 1176 values per patch
    assert inputs["pixel_values"].shape == (grid[1] * grid[2], 1176)


def test_hf_generate_uses_the_image_and_stays_in_vocab(hf_assets):
    model, processor, tokenizer = hf_assets
    text = processor.apply_chat_template(_messages(), tokenize=False, add_generation_prompt=True)
    red = processor(text=[text], images=[_image(56)], return_tensors="pt")
    blue = processor(text=[text], images=[_image(56, (30, 70, 220))], return_tensors="pt")
    with torch.no_grad():
        logits_red = model(**red).logits[0, -1]
        logits_blue = model(**blue).logits[0, -1]
    # Same text, different pixels: the next-token distribution must change (the image is read).
    assert (logits_red - logits_blue).abs().max() > 1e-4

    torch.manual_seed(0)
    out = model.generate(**red, max_new_tokens=12, do_sample=True, pad_token_id=tokenizer.pad_token_id)
    new_ids = out[0, red["input_ids"].shape[1] :]
    assert len(new_ids) > 0
    assert int(new_ids.max()) < len(tokenizer)


@pytest.mark.slow
def test_vllm_generates_with_an_image_and_matches_transformers(tiny_model_path, hf_assets):
    from vllm import LLM, SamplingParams

    model, processor, tokenizer = hf_assets
    image = _image(56)
    text = processor.apply_chat_template(_messages(), tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(text).input_ids  # one <|image_pad|>: vLLM expands it itself
    hf_inputs = processor(text=[text], images=[image], return_tensors="pt")

    llm = LLM(
        model=tiny_model_path,
        enforce_eager=True,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=2,
        seed=0,
        kv_cache_memory_bytes=16 * 2**20,  # on the CPU the default reserves 90 % of RAM
        limit_mm_per_prompt={"image": 1, "video": 0},
    )
    try:
        params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)
        (out,) = llm.generate([{"prompt_token_ids": prompt_ids, "multi_modal_data": {"image": [image]}}], params)
    finally:
        del llm
        gc.collect()

    # vLLM expanded the placeholder exactly as the HF processor does (4 pads for 56x56).
    assert out.prompt_token_ids == hf_inputs["input_ids"][0].tolist()
    response = list(out.outputs[0].token_ids)
    assert len(response) > 0 and max(response) < len(tokenizer)
    vllm_logprobs = torch.tensor([step[tok].logprob for step, tok in zip(out.outputs[0].logprobs, response)])

    # Teacher-forced transformers log-probs of the same tokens.
    full_ids = torch.cat([hf_inputs["input_ids"], torch.tensor([response])], dim=1)
    # transformers 5.19 computes mRoPE (3D) positions only when given mm_token_type_ids (0 = text);
    # without them it silently uses 1D positions, which shifts log-probs by ~1e-3 here.
    mm_token_type_ids = torch.cat([hf_inputs["mm_token_type_ids"], torch.zeros(1, len(response), dtype=torch.int)], 1)
    with torch.no_grad():
        logits = model(
            input_ids=full_ids,
            attention_mask=torch.ones_like(full_ids),
            mm_token_type_ids=mm_token_type_ids,
            pixel_values=hf_inputs["pixel_values"],
            image_grid_thw=hf_inputs["image_grid_thw"],
        ).logits[0]
    P = hf_inputs["input_ids"].shape[1]
    hf_logprobs = torch.log_softmax(logits[P - 1 : -1], dim=-1).gather(1, torch.tensor(response)[:, None])[:, 0]
    torch.testing.assert_close(vllm_logprobs, hf_logprobs)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_build_is_deterministic(tmp_path, tiny_model_path):
    spec = BUILTIN_MODELS["tiny-qwen2.5-vl"]
    first, second = tmp_path / "a", tmp_path / "b"
    for out in (first, second):
        out.mkdir()
        build_model(spec, out, name="tiny-qwen2.5-vl")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "processor_config.json"):
        assert _sha256(first / name) == _sha256(second / name), name
    # ... and the cached build (made by an earlier call, maybe another process) is the same too.
    assert _sha256(first / "model.safetensors") == _sha256(Path(tiny_model_path) / "model.safetensors")


def test_parameter_counts(tiny_model_path):
    # Recorded by the build; the tiny model must stay tiny (~0.6 M: docs/builtin_assets.md) and the bench model
    # within 30-60 M.
    info = json.loads((Path(tiny_model_path) / "easyvlm_builtin.json").read_text())
    assert info["name"] == "tiny-qwen2.5-vl"
    assert 0.3e6 < info["num_parameters"] < 1.5e6


def test_materialize_is_cached(tiny_model_path, easyvlm_cache_dir):
    start = time.perf_counter()
    again = materialize_model("tiny-qwen2.5-vl", cache_dir=easyvlm_cache_dir)
    assert time.perf_counter() - start < 0.2  # a stat, no rebuild (a build takes seconds)
    assert str(again) == tiny_model_path
    assert again.name.startswith("tiny-qwen2.5-vl-v")


def test_resolve_builtin_and_local_dir(tiny_model_path):
    # conftest exports EASYVLM_CACHE, so the default cache is the fixtures' cache.
    assert resolve_model_path("builtin:tiny-qwen2.5-vl") == tiny_model_path
    assert resolve_model_path(tiny_model_path) == tiny_model_path


def test_resolve_unknown_builtin_lists_names():
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model_path("builtin:huge-model")
    message = str(err.value)
    assert "'huge-model'" in message
    assert "builtin:tiny-qwen2.5-vl" in message and "builtin:bench-qwen2.5-vl" in message


def test_resolve_hub_id_offline_explains():
    # HF_HUB_OFFLINE=1 (conftest) and an id no cache holds: nothing can be found or fetched.
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model_path("easyvlm-test/no-such-model")
    message = str(err.value)
    assert "'easyvlm-test/no-such-model'" in message
    assert "HF_HUB_OFFLINE" in message
    assert "local model directory" in message and "builtin:tiny-qwen2.5-vl" in message


def test_resolve_missing_local_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="is not a directory"):
        resolve_model_path(str(tmp_path / "nope"))


def test_a_node_without_the_drivers_directory_finds_the_model_but_never_builds(tmp_path, tiny_model_path, monkeypatch):
    """``local_model_dir``: what a worker on another node of a cluster loads (the driver's cache and
    local paths do not exist there). It finds this node's build; it never builds one itself (no
    worker or engine start may turn into a model build): the driver's node preparation builds it."""
    from easyvlm.plan.launch import build_in_subprocess
    from easyvlm.models.paths import local_model_dir

    gone = str(tmp_path / "driver-cache" / "models" / Path(tiny_model_path).name)  # the driver's directory, not here
    assert local_model_dir(tiny_model_path, "builtin:tiny-qwen2.5-vl") == tiny_model_path  # present: used as is
    assert local_model_dir(gone) == gone  # nothing to resolve: the loader names the path
    monkeypatch.setenv("EASYVLM_CACHE", str(tmp_path / "node-cache"))  # this node's own cache, still empty
    with pytest.raises(ModelNotFoundError, match=r"builtin:tiny-qwen2.5-vl is not built on this node .*"
                       r"python -m easyvlm.builtin.models tiny-qwen2.5-vl"):
        local_model_dir(gone, "builtin:tiny-qwen2.5-vl")
    assert not (tmp_path / "node-cache").exists()  # the lookup built nothing
    built = build_in_subprocess("tiny-qwen2.5-vl")  # what easyvlm.plan.launch runs on each node
    assert built.parent == tmp_path / "node-cache" / "models"
    assert local_model_dir(gone, "builtin:tiny-qwen2.5-vl") == str(built)
    # built in another process, and the same bytes as the driver's
    assert _sha256(built / "model.safetensors") == _sha256(Path(tiny_model_path) / "model.safetensors")
    with pytest.raises(ModelNotFoundError, match="does not exist on this node .*every node mounts at the same path"):
        local_model_dir(gone, str(tmp_path / "my-model"))
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE"):  # a hub id: this node's HF cache, then the hub
        local_model_dir(gone, "easyvlm-test/no-such-model")


def test_the_run_names_its_builtin_models_for_the_nodes(tiny_model_path):
    """easyvlm.plan.launch builds on every node what some worker of the run loads: the policy (and
    its tokenizer), and nothing for a model given as a directory."""
    from plan_testing import plan_for

    from easyvlm.plan.launch import builtin_models

    assert builtin_models(plan_for("builtin:tiny-qwen2.5-vl")) == ["tiny-qwen2.5-vl"]
    assert builtin_models(plan_for(tiny_model_path)) == []


def test_a_build_on_a_rank_other_than_0_is_refused_not_cached(tmp_path, monkeypatch):
    """transformers writes model files only on rank 0 of an initialised torch.distributed group: a
    build there would be a cache entry without weights."""
    import transformers.distributed.mixin as mixin

    monkeypatch.setattr(mixin, "_is_torch_distributed_initialized", lambda: True)
    monkeypatch.setattr(mixin, "_get_torch_distributed_rank", lambda: 1)
    with pytest.raises(RuntimeError, match="wrote no model files.*rank 0"):
        build_model(BUILTIN_MODELS["tiny-qwen2.5-vl"], tmp_path, name="tiny-qwen2.5-vl")


def test_word_tokens_are_single_ids_after_the_special_tokens_and_decode_unchanged():
    tok = build_tokenizer(("red", "circle"))
    # ids: 256 bytes, then the 8 special tokens (256..263), then the words in order: 264, 265
    assert len(tok) == 256 + len(SPECIAL_TOKENS) + 2
    assert tok("red", add_special_tokens=False)["input_ids"] == [256 + len(SPECIAL_TOKENS)]
    assert tok("circle", add_special_tokens=False)["input_ids"] == [256 + len(SPECIAL_TOKENS) + 1]
    # inside other text too, and the byte-level decoder gives the text back
    text = "How many red shapes? circles"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("red")) == 1 and ids.count(tok.convert_tokens_to_ids("circle")) == 1
    assert tok.decode(ids) == text
    # a plain byte tokenizer spells the word: 3 ids
    assert len(build_tokenizer()("red", add_special_tokens=False)["input_ids"]) == 3


def test_word_tokens_reject_what_the_byte_decoder_would_change():
    with pytest.raises(ValueError, match="'dark red'"):
        build_tokenizer(("dark red",))


def test_cache_path_changes_with_the_spec():
    import dataclasses

    from easyvlm.builtin.models import spec_key

    spec = BUILTIN_MODELS["tiny-qwen2.5-vl"]
    assert spec_key(spec) == spec_key(dataclasses.replace(spec))
    assert spec_key(spec) != spec_key(dataclasses.replace(spec, word_tokens=("red",)))
