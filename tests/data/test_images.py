"""fit_image / smart_resize / load_image, and that the processor and vLLM's rule leave fitted images alone."""

from __future__ import annotations

import io
import itertools

import pytest
import torch
from PIL import Image

from easyvlm.data.images import (
    ImageLoadError,
    fit_image,
    fitted_size,
    load_image,
    smart_resize,
    vllm_mm_processor_kwargs,
)

from data_testing import MAX_PIXELS, MIN_PIXELS, make_image

FACTOR = 28
SIZES = [(1, 1), (13, 7), (28, 28), (55, 57), (97, 13), (201, 333), (640, 480), (3000, 17), (29, 1999), (500, 499)]
LIMITS = [(MIN_PIXELS, MAX_PIXELS), (28 * 28, 28 * 28 * 4), (262144, 4194304)]


@pytest.mark.parametrize("min_pixels,max_pixels", LIMITS)
def test_smart_resize_matches_transformers(min_pixels, max_pixels):
    """transformers' rule is the one the HF processor and vLLM apply."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as hf_resize

    for h, w in SIZES:
        if max(h, w) / min(h, w) > 200:
            continue
        assert smart_resize(h, w, FACTOR, min_pixels, max_pixels) == hf_resize(h, w, FACTOR, min_pixels, max_pixels), (h, w)


def test_smart_resize_hand_example():
    # 97x55 (h x w) at factor 28: round(3.46) * 28 = 84, round(1.96) * 28 = 56 -> 84 x 56 = 4704
    # pixels, inside [3136, 50176]: kept.
    assert smart_resize(97, 55, 28, 3136, 50176) == (84, 56)
    # 640x480 -> round to 644x476 = 306544 > 50176: scale = sqrt(307200 / 50176) = 2.474;
    # floor(640 / 2.474 / 28) * 28 = 252, floor(480 / 2.474 / 28) * 28 = 168 -> 42336 pixels.
    assert smart_resize(640, 480, 28, 3136, 50176) == (252, 168)


@pytest.mark.parametrize("min_pixels,max_pixels", LIMITS)
def test_fitted_size_is_a_fixed_point_inside_the_limits(min_pixels, max_pixels):
    from qwen_vl_utils import smart_resize as qwen_utils_resize

    for h, w in itertools.product([1, 5, 28, 55, 97, 333, 1000], repeat=2):
        if max(h, w) / min(h, w) > 200:
            continue
        fh, fw = fitted_size(h, w, min_pixels, max_pixels, FACTOR)
        assert fh % FACTOR == 0 and fw % FACTOR == 0
        assert smart_resize(fh, fw, FACTOR, min_pixels, max_pixels) == (fh, fw)
        # qwen-vl-utils' rule differs on tiny and very thin images (13x7 -> 28x28 there, 56x28 in
        # transformers), but leaves fitted images alone too
        assert qwen_utils_resize(fh, fw, FACTOR, min_pixels, max_pixels) == (fh, fw)


def test_fitted_size_iterates_where_one_pass_is_not_a_fixed_point():
    # 28 x 5000 with max 28*28*16 = 12544: scale = sqrt(140000 / 12544) = 3.34, the short side
    # cannot go below one factor (28) and the long one floors to 53 * 28 = 1484: 41552 pixels,
    # still > max. Passes: 1484 -> 812 -> 588 -> 504 -> 448 (28 x 448 = 12544 = max, fixed).
    assert smart_resize(28, 5000, 28, 784, 12544) == (28, 1484)
    assert fitted_size(28, 5000, 784, 12544, 28) == (28, 448)


def test_fit_image_resizes_and_converts_to_rgb(tmp_path):
    image = Image.open(make_image(tmp_path / "a.png", 97, 55, mode="RGBA"))
    fitted = fit_image(image, MIN_PIXELS, MAX_PIXELS, FACTOR)
    assert fitted.mode == "RGB" and fitted.size == (84, 56)  # (width, height): 97 -> 84, 55 -> 56
    same = fit_image(fitted, MIN_PIXELS, MAX_PIXELS, FACTOR)
    assert same is fitted  # already fitted: not resized again


def test_fit_image_refuses_extreme_aspect_ratio():
    with pytest.raises(ImageLoadError, match="aspect ratio above 200"):
        fit_image(Image.new("RGB", (1000, 3)), MIN_PIXELS, MAX_PIXELS, FACTOR)


def test_load_image_accepts_every_form(tmp_path):
    path = make_image(tmp_path / "img" / "a.png", 30, 20)
    raw = path.read_bytes()
    expected = Image.open(path).convert("RGB").tobytes()
    forms = [str(path), "a.png", raw, {"bytes": raw, "path": None}, {"path": str(path)}, Image.open(path)]
    for value in forms:
        image = load_image(value, base_dir=tmp_path / "img")
        assert image.convert("RGB").tobytes() == expected, type(value)


@pytest.mark.parametrize(
    "value,message",
    [
        ("missing.png", r"image file '.*missing.png' does not exist \(given as 'missing.png'\)"),
        (b"not an image", r"image bytes \(12 bytes\) cannot be decoded"),
        ({"path": None, "bytes": None}, r"has neither 'bytes' nor 'path'"),
        (3.5, r"image of type float"),
    ],
)
def test_load_image_errors_say_what(tmp_path, value, message):
    with pytest.raises(ImageLoadError, match=message):
        load_image(value, base_dir=tmp_path)


def test_truncated_file_is_unreadable(tmp_path):
    path = make_image(tmp_path / "a.png", 60, 60)
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(ImageLoadError, match="cannot be read"):
        load_image(str(path))


ODD_SIZES = [(13, 7), (97, 55), (333, 201), (57, 250), (1000, 999)]


@pytest.mark.parametrize("width,height", ODD_SIZES)
def test_processor_keeps_fitted_images_and_token_count(processor, width, height):
    """On a fitted image the processor's own resize (with the same limits) is a no-op, and the
    prompt gets grid.prod() // merge**2 image tokens, each patch 28x28 -> h/14 * w/14 patches."""
    image = Image.new("RGB", (width, height), (10, 200, 30))
    fitted = fit_image(image, MIN_PIXELS, MAX_PIXELS, FACTOR)
    fh, fw = fitted.height, fitted.width
    kwargs = dict(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, return_tensors="pt")
    resized = processor.image_processor(images=[fitted], do_resize=True, **kwargs)
    no_resize = processor.image_processor(images=[fitted], do_resize=False, **kwargs)
    assert resized["image_grid_thw"].tolist() == [[1, fh // 14, fw // 14]]
    torch.testing.assert_close(resized["pixel_values"], no_resize["pixel_values"], rtol=0, atol=0)

    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}], add_generation_prompt=True, tokenize=False
    )
    out = processor(text=[text], images=[fitted], do_resize=False, return_tensors="pt")
    n_tokens = int((out["input_ids"] == processor.image_token_id).sum())
    assert n_tokens == (fh // 28) * (fw // 28) == int(out["image_grid_thw"].prod()) // 4


def test_vllm_mm_processor_kwargs_carry_the_data_limits():
    # transformers 5's form (pixel counts under size); min_pixels= / max_pixels= are deprecated
    expected = {"size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}}
    assert vllm_mm_processor_kwargs(MIN_PIXELS, MAX_PIXELS) == expected


def test_png_bytes_roundtrip_through_dict():
    buf = io.BytesIO()
    Image.new("L", (5, 4), 77).save(buf, format="PNG")
    image = load_image({"bytes": buf.getvalue()})
    assert image.size == (5, 4) and image.getpixel((0, 0)) == 77
