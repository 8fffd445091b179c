"""Image sizing (EasyR1's two stages), the processor's own limits, and where relative paths resolve.

The reference for sizes is a re-statement of EasyR1's arithmetic written here (``easyr1_size``):
``verl/utils/dataset.py`` ``process_image`` (stage 1, int() truncation), then transformers' own
``smart_resize`` with the processor's limits (stage 2, what the HF processor and vLLM run).
"""

from __future__ import annotations

import io
import itertools
import math
import os
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from easyvlm.data.images import (
    ImageLoadError,
    check_pixel_limits,
    fit_image,
    fitted_size,
    image_factor,
    load_image,
    prescale_size,
    processor_pixel_limits,
    resolve_image_path,
    smart_resize,
)
from easyvlm.data.videos import vllm_mm_processor_kwargs

from data_testing import MAX_PIXELS, MIN_PIXELS, make_image

FACTOR = 28  # Qwen2/2.5-VL: patch 14 x merge 2
EASYR1 = (262144, 4194304)  # EasyR1's data.min_pixels / data.max_pixels defaults (verl/trainer/config.py)
QWEN25 = (3136, 12845056)  # Qwen2.5-VL's preprocessor config: min_pixels 56*56, max_pixels 28*28*16384
TINY = (MIN_PIXELS, MAX_PIXELS)  # the builtin tiny model's processor: 56*56 .. 28*28*64 (see builtin/models.py)


def hf_smart_resize(height, width, factor, min_pixels, max_pixels):
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as resize

    return resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)


def easyr1_stage1(height, width, min_pixels, max_pixels):
    """EasyR1's process_image sizes (PIL: width first), or None where PIL would get a 0 side."""
    w, h = width, height
    if max_pixels is not None and w * h > max_pixels:
        k = math.sqrt(max_pixels / (w * h))
        w, h = int(w * k), int(h * k)
    if min(w, h) < 1:
        return None
    if min_pixels is not None and w * h < min_pixels:
        k = math.sqrt(min_pixels / (w * h))
        w, h = int(w * k), int(h * k)
    return h, w


def easyr1_size(height, width, data_limits, factor, processor_limits):
    """EasyR1's final (height, width); None where EasyR1 itself fails (0 side, aspect ratio > 200)."""
    stage1 = easyr1_stage1(height, width, *data_limits)
    if stage1 is None:
        return None
    try:
        return hf_smart_resize(*stage1, factor, *processor_limits)
    except ValueError:  # aspect ratio > 200
        return None


def is_fixed_point(size, factor, processor_limits) -> bool:
    try:
        return hf_smart_resize(*size, factor, *processor_limits) == tuple(size)
    except ValueError:
        return False


def fit(height, width, data_limits, factor, processor_limits):
    low, high = processor_limits
    return fitted_size(height, width, *data_limits, factor, processor_min_pixels=low, processor_max_pixels=high)


# (height, width, (data.min_pixels, data.max_pixels), factor, (processor min, max))
SIZE_CASES = [
    # EasyR1's defaults with Qwen2.5-VL's processor
    (120, 160, EASYR1, FACTOR, QWEN25),  # small: stage 1 scales up (336 tokens, derived below)
    (2000, 3000, EASYR1, FACTOR, QWEN25),  # large: stage 1 scales down (5,400 tokens, derived below)
    (1, 1, EASYR1, FACTOR, QWEN25),  # tiny: 1x1 -> 512x512 -> 504x504
    (3, 2, EASYR1, FACTOR, QWEN25),
    (512, 512, EASYR1, FACTOR, QWEN25),  # exactly min_pixels: stage 1 leaves it
    (2048, 2048, EASYR1, FACTOR, QWEN25),  # exactly max_pixels
    (10000, 10000, EASYR1, FACTOR, QWEN25),  # huge square
    (6000, 8000, EASYR1, FACTOR, QWEN25),
    (100, 5000, EASYR1, FACTOR, QWEN25),  # wide, aspect 50
    (5000, 100, EASYR1, FACTOR, QWEN25),  # tall
    (20, 2000, EASYR1, FACTOR, QWEN25),  # aspect 100, tiny short side
    (114, 111, EASYR1, FACTOR, QWEN25),  # truncation matters (derived below)
    (2000, 2424, EASYR1, FACTOR, QWEN25),  # truncation matters (derived below)
    # no data limits: only stage 2
    (120, 160, (None, None), FACTOR, QWEN25),
    (13, 7, (None, None), FACTOR, QWEN25),
    (5000, 7000, (None, None), FACTOR, QWEN25),  # above the processor's max: stage 2 shrinks
    (30, 5000, (None, None), FACTOR, QWEN25),
    (640, 480, (None, None), FACTOR, TINY),
    (1, 1, (None, None), FACTOR, TINY),
    # one data limit only
    (120, 160, (262144, None), FACTOR, QWEN25),
    (3000, 2000, (None, 1048576), FACTOR, QWEN25),
    (700, 900, (None, 100000), FACTOR, QWEN25),  # max < pixels
    (50, 60, (100000, None), FACTOR, QWEN25),  # min > pixels
    # data limits that the processor's override: stage 2 undoes part of stage 1
    (120, 160, EASYR1, FACTOR, TINY),  # EasyR1's defaults on the tiny model: up to 591x443, then down to <= 50176
    (3000, 2000, EASYR1, FACTOR, TINY),
    (97, 55, TINY, FACTOR, TINY),  # the test data limits on the tiny model
    (333, 201, TINY, FACTOR, TINY),
    (1000, 999, TINY, FACTOR, TINY),
    (57, 250, TINY, FACTOR, TINY),
    (3, 4, TINY, FACTOR, TINY),
    (200, 200, (100, 1000), FACTOR, QWEN25),  # data max < one 28x28 block: stage 2 brings it back to 3136+
    (300, 7000, (3136, 50176), FACTOR, QWEN25),
    # factor 32 (Qwen3-VL: patch 16 x merge 2)
    (120, 160, EASYR1, 32, (65536, 16777216)),
    (3000, 2000, EASYR1, 32, (65536, 16777216)),
    (45, 700, (None, None), 32, (4096, 1048576)),
]


@pytest.mark.parametrize("height,width,data_limits,factor,processor_limits", SIZE_CASES)
def test_fitted_size_is_easyr1s_two_stage_size(height, width, data_limits, factor, processor_limits):
    expected = easyr1_size(height, width, data_limits, factor, processor_limits)
    assert expected is not None and is_fixed_point(expected, factor, processor_limits)  # the table's cases are usable
    assert fit(height, width, data_limits, factor, processor_limits) == expected


def test_the_two_numbers_from_the_brief():
    # 160x120 (w x h), EasyR1's defaults, Qwen2.5-VL's processor (3136 .. 12845056 pixels):
    #   stage 1: 19200 < 262144, k = sqrt(262144 / 19200) = 3.69504; int(160 k) = int(591.21) = 591,
    #            int(120 k) = int(443.41) = 443 (261813 pixels, a little under min: truncation)
    #   stage 2: round(443 / 28) = round(15.82) = 16 -> 448; round(591 / 28) = round(21.11) = 21 -> 588;
    #            448 * 588 = 263424 is inside the processor's range -> 448 x 588
    #   tokens: (448 / 28) * (588 / 28) = 16 * 21 = 336.
    #   (One smart_resize into [262144, 4194304], the old rule, gave ceil(15.84) x ceil(21.11) = 16 x 22 = 352.)
    h, w = fit(120, 160, EASYR1, FACTOR, QWEN25)
    assert (h, w) == (448, 588) and (h // 28) * (w // 28) == 336
    # 3000x2000, EasyR1's defaults:
    #   stage 1: 6e6 > 4194304, k = sqrt(4194304 / 6e6) = 0.836092; int(3000 k) = int(2508.28) = 2508,
    #            int(2000 k) = int(1672.18) = 1672
    #   stage 2: round(1672 / 28) = round(59.71) = 60 -> 1680; round(2508 / 28) = round(89.57) = 90 -> 2520;
    #            4233600 pixels (above data.max_pixels, as in EasyR1; inside the processor's range)
    #   tokens: 60 * 90 = 5400.  (The old rule: floor(59.72) x floor(89.58) = 59 x 89 = 5251.)
    h, w = fit(2000, 3000, EASYR1, FACTOR, QWEN25)
    assert (h, w) == (1680, 2520) and (h // 28) * (w // 28) == 5400


def test_truncation_not_rounding_in_stage_1():
    # 111x114 (w x h): k = sqrt(262144 / 12654) = 4.551516; 114 k = 518.87 -> int 518 (round: 519),
    # 111 k = 505.22 -> 505. round(518 / 28) = round(18.5) = 18 (Python rounds half to even) -> 504;
    # round(505 / 28) = round(18.04) = 18 -> 504. Rounding to 519 would give round(18.54) = 19 -> 532.
    assert prescale_size(114, 111, *EASYR1) == (518, 505)
    assert fit(114, 111, EASYR1, FACTOR, QWEN25) == (504, 504)
    # 2424x2000: k = sqrt(4194304 / 4848000) = 0.930141; 2000 k = 1860.28 -> 1860, 2424 k = 2254.66 -> 2254
    # (round: 2255). round(1860 / 28) = round(66.43) = 66 -> 1848; round(2254 / 28) = round(80.5) = 80 -> 2240
    # (2255 / 28 = 80.54 -> 81 -> 2268).
    assert prescale_size(2000, 2424, *EASYR1) == (1860, 2254)
    assert fit(2000, 2424, EASYR1, FACTOR, QWEN25) == (1848, 2240)


# (data limits, processor limits, how many of the grid's 69 usable sizes are accepted). The refused
# ones are thin: e.g. 4321x28 with EasyR1's defaults -> 6360x41 -> 6356x28, aspect 227 > 200.
LIMIT_SETS = [
    (EASYR1, QWEN25, 67),
    (EASYR1, TINY, 61),
    ((None, None), QWEN25, 69),
    ((None, None), TINY, 65),
    (TINY, TINY, 65),
    ((3136, 4194304), QWEN25, 69),
    ((500000, None), TINY, 61),
]


@pytest.mark.parametrize("data_limits,processor_limits,n_accepted", LIMIT_SETS)
def test_refused_only_where_the_processor_would_resize_again(data_limits, processor_limits, n_accepted):
    """Over a grid of sizes: the result is EasyR1's and a fixed point, or the image is refused and
    EasyR1's size is not a fixed point (vLLM would resize it again) or EasyR1 fails itself."""
    sides = [1, 3, 17, 28, 55, 97, 333, 1000, 4321]
    usable = [(h, w) for h, w in itertools.product(sides, repeat=2) if max(h, w) / min(h, w) <= 200]
    assert len(usable) == 69  # 81 pairs minus 12 with an aspect ratio above 200
    accepted = 0
    for h, w in usable:
        expected = easyr1_size(h, w, data_limits, FACTOR, processor_limits)
        try:
            got = fit(h, w, data_limits, FACTOR, processor_limits)
        except ImageLoadError:
            assert expected is None or not is_fixed_point(expected, FACTOR, processor_limits), (h, w)
        else:
            accepted += 1
            assert got == expected and is_fixed_point(got, FACTOR, processor_limits), (h, w)
    assert accepted == n_accepted


@pytest.mark.parametrize("min_pixels,max_pixels", [TINY, (28 * 28, 28 * 28 * 4), EASYR1, QWEN25])
def test_smart_resize_matches_transformers(min_pixels, max_pixels):
    for h, w in [(1, 1), (13, 7), (28, 28), (55, 57), (97, 13), (201, 333), (640, 480), (3000, 17), (29, 1999)]:
        expected = hf_smart_resize(h, w, FACTOR, min_pixels, max_pixels)
        assert smart_resize(h, w, FACTOR, min_pixels, max_pixels) == expected, (h, w)


def test_refusals_say_why():
    # aspect ratio 1000 / 3 > 200, refused before any resize
    with pytest.raises(ImageLoadError, match="aspect ratio above 200"):
        fit(3, 1000, EASYR1, FACTOR, QWEN25)
    # data.max_pixels = 100 on 1x150: k = sqrt(100 / 150) = 0.816, int(0.816) = 0 (PIL would refuse it)
    with pytest.raises(ImageLoadError, match=r"data.max_pixels=100 shrinks this 1x150 image to 0x122"):
        fit(150, 1, (None, 100), FACTOR, QWEN25)
    # 3050x30 on the tiny model (max 50176 = 64 blocks): round -> 28 x 3052 > max, k = sqrt(91500 / 50176) =
    # 1.3504; short side max(28, floor(0.79) * 28) = 28, long side floor(3050 / 1.3504 / 28) = floor(80.66) = 80
    # -> 28 x 2240 = 62720 > 50176. Again: k = sqrt(62720 / 50176) = 1.1180, floor(2240 / 1.1180 / 28) =
    # floor(71.55) = 71 -> 28 x 1988. Not a fixed point: refused, or vLLM would disagree with training.
    message = (
        r"image of 3050x30 cannot be sized consistently: data.min_pixels/data.max_pixels give 3050x30, the "
        r"processor's limits \[3136, 50176\] give 2240x28 \(62720 pixels\), which the processor and vLLM would "
        r"resize again to 1988x28"
    )
    with pytest.raises(ImageLoadError, match=message):
        fit(30, 3050, (None, None), FACTOR, TINY)
    # 190x1 with EasyR1's defaults: k = sqrt(262144 / 190) = 37.144 -> 7057x37 (aspect 190.7), then
    # round(37 / 28) = 1 -> 28 and round(7057 / 28) = 252 -> 7056: aspect 252, which vLLM's resize refuses.
    # (EasyR1 gives the processor 7057x37, which it accepts; easyvlm cannot hand vLLM a 7056x28 image.)
    message = (
        r"image of 190x1, resized to 7057x37 by data.min_pixels/data.max_pixels, then to multiples of 28 with "
        r"the processor's pixel limits \[3136, 12845056\]: image of 7056x28 has an aspect ratio above 200"
    )
    with pytest.raises(ImageLoadError, match=message):
        fit(1, 190, EASYR1, FACTOR, QWEN25)
    # 200x1: 7240x36 after stage 1 (int truncation: aspect 201.1), which EasyR1's processor refuses too
    with pytest.raises(ImageLoadError, match=r"resized to 7240x36 .*: image of 7240x36 has an aspect ratio above 200"):
        fit(1, 200, EASYR1, FACTOR, QWEN25)


def test_fit_image_resizes_once_and_converts_to_rgb(tmp_path):
    image = Image.open(make_image(tmp_path / "a.png", 97, 55, mode="RGBA"))
    fitted = fit_image(image, *TINY, FACTOR, processor_min_pixels=MIN_PIXELS, processor_max_pixels=MAX_PIXELS)
    # 97x55 (w x h): stage 1 leaves 5335 pixels; round(55 / 28) = 2 -> 56, round(97 / 28) = 3 -> 84
    assert fitted.mode == "RGB" and fitted.size == (84, 56)
    direct = image.convert("RGB").resize((84, 56), resample=Image.Resampling.BICUBIC)
    assert fitted.tobytes() == direct.tobytes()  # one bicubic resize from the original
    same = fit_image(fitted, *TINY, FACTOR, processor_min_pixels=MIN_PIXELS, processor_max_pixels=MAX_PIXELS)
    assert same is fitted  # already fitted: not resized again


def test_check_pixel_limits():
    check_pixel_limits(None, None, FACTOR, processor_min_pixels=3136, processor_max_pixels=50176)
    # data.max_pixels below one 28x28 block is fine: stage 2 brings the image back to the processor's range
    check_pixel_limits(100, 1000, FACTOR, processor_min_pixels=3136, processor_max_pixels=50176)
    with pytest.raises(ValueError, match=r"data.min_pixels=0 must be positive, or null"):
        check_pixel_limits(0, None, FACTOR, processor_min_pixels=3136, processor_max_pixels=50176)
    with pytest.raises(ValueError, match=r"data.min_pixels=5000 must be <= data.max_pixels=4000"):
        check_pixel_limits(5000, 4000, FACTOR, processor_min_pixels=3136, processor_max_pixels=50176)
    with pytest.raises(ValueError, match=r"processor's pixel limits \[100, 700\].*one 28x28 block \(784 pixels\)"):
        check_pixel_limits(None, None, FACTOR, processor_min_pixels=100, processor_max_pixels=700)


# ----------------------------------------------------------------------------- the processor's limits
def test_processor_pixel_limits_in_every_form(processor):
    from transformers import Qwen2VLImageProcessor

    assert processor_pixel_limits(processor) == TINY  # transformers 5: a SizeDict with the two edges
    assert processor_pixel_limits(processor.image_processor) == TINY
    assert processor_pixel_limits(Qwen2VLImageProcessor(min_pixels=1000, max_pixels=9000)) == (1000, 9000)
    old = SimpleNamespace(patch_size=14, merge_size=2, size={"min_pixels": 11, "max_pixels": 22})  # transformers 4.4x
    assert processor_pixel_limits(old) == (11, 22)
    attrs = SimpleNamespace(patch_size=14, merge_size=2, size={"height": 1}, min_pixels=33, max_pixels=44)
    assert processor_pixel_limits(SimpleNamespace(image_processor=attrs)) == (33, 44)
    # both forms, disagreeing: size wins, as vLLM reads image_processor.size for its defaults
    both = SimpleNamespace(
        patch_size=14, merge_size=2, size={"shortest_edge": 5, "longest_edge": 6}, min_pixels=7, max_pixels=8
    )
    assert processor_pixel_limits(both) == (5, 6)
    with pytest.raises(ValueError, match="cannot read the pixel limits"):
        processor_pixel_limits(SimpleNamespace(patch_size=14, merge_size=2, size=None))
    with pytest.raises(ValueError, match="has no image_processor"):
        processor_pixel_limits(processor.tokenizer)
    assert image_factor(processor) == 28


def test_vllm_mm_processor_kwargs_carry_the_processors_limits(processor):
    # transformers 5's form (pixel counts under size); min_pixels= / max_pixels= are deprecated
    limits = {"size": {"shortest_edge": 3136, "longest_edge": 50176}}  # per modality: Qwen3-VL's differ
    assert vllm_mm_processor_kwargs(processor) == {"images_kwargs": limits, "videos_kwargs": {**limits, "cap_pixels_per_frame": False}}
    assert vllm_mm_processor_kwargs(processor.tokenizer) == {}  # text-only model: nothing to set
    assert vllm_mm_processor_kwargs(None) == {}


def test_vllm_resolves_the_kwargs_to_the_processors_limits(processor):
    """vLLM's own resolution of mm_processor_kwargs (the sizes its smart_resize uses for token counts)."""
    from vllm.model_executor.models.qwen2_vl import Qwen2VLProcessingInfo

    defaults = {"shortest_edge": 1, "longest_edge": 2}  # stand-ins, to see that the kwargs override them
    kwargs = vllm_mm_processor_kwargs(processor)
    for scope in ("images_kwargs", "videos_kwargs"):  # vLLM reads one scope per modality
        size = Qwen2VLProcessingInfo._get_vision_size(kwargs[scope], default_size=defaults)
        assert (size["shortest_edge"], size["longest_edge"]) == TINY


def test_vllm_kwargs_keep_the_video_processors_own_limits(processor):
    """Qwen3-VL's image and video processors have different limits: each modality gets its own."""
    import copy

    other = copy.deepcopy(processor)
    other.video_processor.size = {"shortest_edge": 6272, "longest_edge": 25088}
    kwargs = vllm_mm_processor_kwargs(other)
    assert kwargs["images_kwargs"]["size"] == {"shortest_edge": 3136, "longest_edge": 50176}
    assert kwargs["videos_kwargs"]["size"] == {"shortest_edge": 6272, "longest_edge": 25088}


ODD_SIZES = [(13, 7), (97, 55), (333, 201), (57, 250), (1000, 999), (160, 120), (640, 480)]


@pytest.mark.parametrize(
    "data_limits", [(None, None), TINY, EASYR1], ids=["no-data-limits", "test-limits", "easyr1-defaults"]
)
@pytest.mark.parametrize("width,height", ODD_SIZES)
def test_hf_processor_on_easyr1s_input_gives_the_fitted_grid(processor, width, height, data_limits):
    """The real HF processor (do_resize=True, its own limits) on what EasyR1 hands it (the original image
    after stage 1; the original itself without data limits) gives the grid of easyvlm's fitted image;
    on the fitted image its resize is a no-op, and the prompt gets grid.prod() // 4 image tokens."""
    image = Image.new("RGB", (width, height), (10, 200, 30))
    image.paste((200, 20, 90), (0, 0, max(1, width // 3), max(1, height // 2)))
    fitted = fit_image(image, *data_limits, FACTOR, processor_min_pixels=MIN_PIXELS, processor_max_pixels=MAX_PIXELS)
    fh, fw = fitted.height, fitted.width
    stage1_h, stage1_w = easyr1_stage1(height, width, *data_limits)
    easyr1_input = image if (stage1_h, stage1_w) == (height, width) else image.resize((stage1_w, stage1_h))
    easyr1 = processor.image_processor(images=[easyr1_input], do_resize=True, return_tensors="pt")
    assert easyr1["image_grid_thw"].tolist() == [[1, fh // 14, fw // 14]]

    resized = processor.image_processor(images=[fitted], do_resize=True, return_tensors="pt")
    no_resize = processor.image_processor(images=[fitted], do_resize=False, return_tensors="pt")
    torch.testing.assert_close(resized["pixel_values"], no_resize["pixel_values"], rtol=0, atol=0)

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out = processor(text=[text], images=[fitted], do_resize=False, return_tensors="pt")
    n_tokens = int((out["input_ids"] == processor.image_token_id).sum())
    assert n_tokens == (fh // 28) * (fw // 28) == int(out["image_grid_thw"].prod()) // 4


def test_qwen25_processor_gives_336_and_5400_tokens():
    """A Qwen2VLImageProcessor with Qwen2.5-VL's limits, on EasyR1's stage-1 images (591x443, 2508x1672)."""
    from transformers import Qwen2VLImageProcessor

    image_processor = Qwen2VLImageProcessor(min_pixels=QWEN25[0], max_pixels=QWEN25[1])
    for (width, height), tokens in [((160, 120), 336), ((3000, 2000), 5400)]:
        h1, w1 = prescale_size(height, width, *EASYR1)
        out = image_processor(images=[Image.new("RGB", (w1, h1))], do_resize=True, return_tensors="pt")
        grid = out["image_grid_thw"]
        assert int(grid.prod()) // 4 == tokens
        fh, fw = fit(height, width, EASYR1, FACTOR, QWEN25)
        assert grid.tolist() == [[1, fh // 14, fw // 14]]


# ----------------------------------------------------------------------------- loading and paths
@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """image_dir/, data/ (the data file's directory) and cwd/ (the working directory)."""
    out = {name: tmp_path / name for name in ("image_dir", "data", "cwd")}
    for path in out.values():
        path.mkdir()
    monkeypatch.chdir(out["cwd"])
    return out


def width_of(value, search_dirs) -> int:
    return load_image(value, search_dirs).width  # each directory holds a different width


def test_image_dir_set_is_the_only_place(dirs):
    for width, name in [(10, "image_dir"), (20, "data"), (30, "cwd")]:
        make_image(dirs[name] / "a.png", width, 5)
    make_image(dirs["data"] / "only_in_data.png", 20, 5)
    assert width_of("a.png", [dirs["image_dir"]]) == 10
    message = (
        r"image file 'only_in_data.png' does not exist in any of the directories tried: '"
        + str(dirs["image_dir"])
        + r"'\. Relative paths resolve against data.image_dir"
    )
    with pytest.raises(ImageLoadError, match=message):
        load_image("only_in_data.png", [dirs["image_dir"]])


def test_no_image_dir_tries_the_data_dir_then_the_working_dir(dirs):
    make_image(dirs["data"] / "both.png", 20, 5)
    make_image(dirs["cwd"] / "both.png", 30, 5)
    make_image(dirs["cwd"] / "sub" / "cwd_only.png", 30, 5)
    search = [dirs["data"], os.getcwd()]
    assert width_of("both.png", search) == 20  # the data file's directory first
    assert width_of("sub/cwd_only.png", search) == 30  # then the working directory (EasyR1's rule)
    assert width_of({"path": "sub/cwd_only.png", "bytes": None}, search) == 30
    assert width_of("sub/cwd_only.png", []) == 30  # no directories: the working directory
    assert width_of("sub/cwd_only.png", [None, os.getcwd()]) == 30  # a hub data set has no file directory (None)
    message = (
        rf"image file 'img/missing.png' does not exist in any of the directories tried: '{dirs['data']}', "
        rf"'{dirs['cwd']}'\."
    )
    with pytest.raises(ImageLoadError, match=message):
        load_image("img/missing.png", search)


def test_absolute_paths_and_misuse(dirs):
    path = make_image(dirs["data"] / "abs.png", 20, 5)
    assert width_of(str(path), [dirs["image_dir"]]) == 20  # absolute: as is
    assert resolve_image_path(path, []) == path
    with pytest.raises(ImageLoadError, match=rf"image file '{dirs['data']}/gone.png' does not exist$"):
        load_image(str(dirs["data"] / "gone.png"), [dirs["image_dir"]])
    with pytest.raises(TypeError, match=r"search_dirs must be a list of directories"):
        load_image("abs.png", str(dirs["data"]))  # a bare string would be read as a list of characters


def test_load_image_accepts_every_form(tmp_path):
    path = make_image(tmp_path / "img" / "a.png", 30, 20)
    raw = path.read_bytes()
    expected = Image.open(path).convert("RGB").tobytes()
    forms = [str(path), "a.png", path, raw, {"bytes": raw, "path": None}, {"path": str(path)}, Image.open(path)]
    for value in forms:
        image = load_image(value, [tmp_path / "img"])
        assert image.convert("RGB").tobytes() == expected, type(value)


@pytest.mark.parametrize(
    "value,message",
    [
        (b"not an image", r"image bytes \(12 bytes\) cannot be decoded"),
        ({"path": None, "bytes": None}, r"has neither 'bytes' nor 'path'"),
        (3.5, r"image of type float"),
    ],
)
def test_load_image_errors_say_what(tmp_path, value, message):
    with pytest.raises(ImageLoadError, match=message):
        load_image(value, [tmp_path])


def test_truncated_file_is_unreadable(tmp_path):
    path = make_image(tmp_path / "a.png", 60, 60)
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(ImageLoadError, match="cannot be read"):
        load_image(str(path))


def test_png_bytes_roundtrip_through_dict():
    buf = io.BytesIO()
    Image.new("L", (5, 4), 77).save(buf, format="PNG")
    image = load_image({"bytes": buf.getvalue()})
    assert image.size == (5, 4) and image.getpixel((0, 0)) == 77
