"""Built-in models: tiny Qwen-VL models built offline into the easyvlm cache, and their ``builtin:``
model-path scheme. ``materialize_model(name)`` writes a Hugging Face directory (seeded random
weights, a byte-level tokenizer with Qwen's special tokens, the family's processor) that
transformers and vLLM load like a real checkpoint. Token ids differ from Qwen's: read them from the
tokenizer or config. docs/builtin_assets.md."""

from __future__ import annotations

import json
import os
from dataclasses import fields, replace
from pathlib import Path

from easyvlm.builtin.families import FAMILIES, BuiltinModelSpec, model_config, processor
from easyvlm.builtin.synthetic import PALETTE, SHAPES
from easyvlm.builtin.synthetic_zoom import call_tokens
from easyvlm.builtin.gui_warm_start import ACTION_TOKENS
from easyvlm.builtin.warm_start import WARM_STARTS, build_warm_start, warm_start_key
from easyvlm.models.paths import ModelNotFoundError, ModelScheme, register_model_scheme
from easyvlm.utils.cache import build_once, cache_root

# Bump when anything in the build changes (spec values, tokenizer, template, processor settings):
# the cache key includes it, so users never load a stale build.
BUILD_VERSION = 2

BUILTIN_PREFIX = "builtin:"
ZOOM_CALL_TOKENS = call_tokens()

# Qwen2.5-VL's special tokens. Their ids here are 256.. (after the 256 byte tokens), not Qwen's.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen's chat format without the default system prompt (it would cost ~30 byte tokens per prompt).
# Content is a string or a list of {"type": "image"|"video"|"text"} items, like Qwen2.5-VL's template.
# Tools as in Qwen2.5's template, compacted for a byte-level vocabulary: the system turn lists each
# tool's signature and the <tool_call>{json}</tool_call> format; results come back as a user turn of
# <tool_response> blocks (images allowed). Without tools and tool messages the output is unchanged.
CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}"
    "{{- content -}}"
    "{%- else -%}"
    "{%- for item in content -%}"
    "{%- if item['type'] == 'image' or 'image' in item or 'image_url' in item -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] == 'video' or 'video' in item -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in item -%}"
    "{{- item['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{{- render(messages[0]['content']) + '\\n' -}}{%- endif -%}"
    "{{- 'Tools:' -}}"
    "{%- for tool in tools -%}"
    "{%- set f = tool['function'] if 'function' in tool else tool -%}"
    "{{- ' ' + f['name'] + '(' + (f['parameters']['properties'] | list | join(', ')) + ')' -}}"
    "{%- endfor -%}"
    "{{- '\\nCall: <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' and tools and loop.first -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + render(message['content']) + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + render(message['content']) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


_TINY = BuiltinModelSpec(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    mrope_section=(4, 6, 6),  # head_dim 32 -> 16 rotary frequency pairs
    vision_depth=2,
    vision_hidden_size=64,
    vision_intermediate_size=128,
    vision_num_heads=4,
    vision_fullatt_block_indexes=(1,),
    description="tests",
)

_TINY_QWEN3_VL = replace(
    _TINY,
    family="qwen3_vl",
    # Qwen3-VL's text model has an explicit head_dim (128 by default): 128 / 4 heads = 32 here.
    # Interleaved mRoPE spreads T/H/W over the 16 rotary pairs as T H W T H W ...: the H and W
    # sections (5 each, x 3) must fit in them; the real models use [24, 20, 20] of 64 pairs.
    mrope_section=(6, 5, 5),
    vision_fullatt_block_indexes=(),
    patch_size=16,  # factor 32: a 64x64 image gives 4 image tokens, 96x96 gives 9
    min_pixels=32 * 32 * 4,
    max_pixels=32 * 32 * 64,
    # Block 0's output also enters after decoder layer 0 (DeepStack). Not (0, 1): a feature
    # added after the last decoder layer reaches only the image tokens' own logits, so its
    # merger would get no gradient.
    vision_deepstack_indexes=(0,),
    vision_num_position_embeddings=256,  # a 16 x 16 grid (the real models: 48 x 48)
    description="tests (Qwen3-VL)",
)

# Qwen3.5: a hybrid decoder (three gated-DeltaNet layers, then one gated softmax attention layer, as
# the real models repeat), Qwen3-VL's tower without DeepStack, partial rotary: a quarter of the
# head_dim of 64 rotates (8 frequency pairs, interleaved T H W; the real models: [11, 11, 10] of 32).
_TINY_QWEN3_5 = replace(
    _TINY_QWEN3_VL,
    family="qwen3_5",
    num_hidden_layers=4,
    layer_types=("linear_attention", "linear_attention", "linear_attention", "full_attention"),
    linear_key_heads=2,
    linear_value_heads=4,  # two value heads per key head, as the real models
    linear_head_dim=32,
    head_dim=64,
    partial_rotary_factor=0.25,
    mrope_section=(3, 3, 2),
    vision_deepstack_indexes=(),
    word_tokens=(*PALETTE, *SHAPES),
    description="tests and demo base (Qwen3.5)",
)

# The bench model's decoder sizes (hidden 512, 8 layers, 8 heads of 64) in the Qwen3-VL family: its
# tower (patch 16, learned positions on a 32 x 32 grid, DeepStack after decoder layer 1), interleaved
# mRoPE over the 32 rotary pairs (the real models' [24, 20, 20] of 64, halved).
_BENCH_QWEN3_VL = BuiltinModelSpec(
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    mrope_section=(12, 10, 10),
    vision_depth=4,
    vision_hidden_size=256,
    vision_intermediate_size=1024,
    vision_num_heads=4,
    vision_fullatt_block_indexes=(),
    patch_size=16,
    min_pixels=32 * 32 * 4,
    max_pixels=32 * 32 * 256,
    family="qwen3_vl",
    vision_deepstack_indexes=(1,),
    vision_num_position_embeddings=1024,
)

BUILTIN_MODELS: dict[str, BuiltinModelSpec] = {
    # Tests: builds in seconds, ~0.6 M parameters.
    "tiny-qwen2.5-vl": _TINY,
    # The demo's base: the tiny model with the synthetic task's answer words as single tokens.
    "tiny-qwen2.5-vl-words": replace(
        _TINY, word_tokens=(*PALETTE, *SHAPES), description="the CPU demo's base model (answer words are single tokens)"
    ),
    # The base of the demo's distillation teacher (warm start tiny-qwen2.5-vl-teacher), ~2.8 M
    # parameters: twice as wide (text and vision), one more decoder layer. The tokenizer (same word
    # tokens), head_dim 32 (so the same mrope_section) and the processor's patch, merge and pixel
    # settings are the student's: a teacher scores the student's token ids on the student's prompts.
    "tiny-qwen2.5-vl-words-large": replace(
        _TINY, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=4, vision_hidden_size=128, vision_intermediate_size=256,
        word_tokens=(*PALETTE, *SHAPES), description="base of the CPU demo's distillation teacher",
    ),
    # The tools demo's base: answer words and the pieces of a zoom call are single tokens.
    "tiny-qwen2.5-vl-tools": replace(
        _TINY, word_tokens=(*PALETTE, *SHAPES, *ZOOM_CALL_TOKENS),
        description="the tools demo's base model (answer words and zoom-call pieces are single tokens)",
    ),
    # The GUI demo's base: colour words and the actions click(1)..click(7) are single tokens (spelt in
    # bytes, sampled actions garbled: "cliclick(5").
    "tiny-qwen2.5-vl-clicks": replace(
        _TINY, word_tokens=(*PALETTE, *SHAPES, *ACTION_TOKENS),
        description="the GUI demo's base model (colour words and click(N) actions are single tokens)",
    ),
    # The other two families at the same sizes (tests: every path of the loop runs with each).
    "tiny-qwen2-vl": replace(_TINY, family="qwen2_vl", vision_fullatt_block_indexes=(), description="tests (Qwen2-VL)"),
    "tiny-qwen3-vl": _TINY_QWEN3_VL,
    # tiny-qwen2.5-vl-clicks's tokens on Qwen3-VL: unlike it, it learns the GUI screens' first click
    # (bench/gui_first_click.py; docs/benchmarks.md, "A base that learns the first click").
    "tiny-qwen3-vl-clicks": replace(
        _TINY_QWEN3_VL, word_tokens=(*PALETTE, *SHAPES, *ACTION_TOKENS),
        description="GUI base on Qwen3-VL (colour words and click(N) actions are single tokens)",
    ),
    "tiny-qwen3-vl-words": replace(_TINY_QWEN3_VL, word_tokens=(*PALETTE, *SHAPES),
                                   description="demo base (Qwen3-VL, dense): the answer words are single tokens"),
    # The 2026 families (tests, and the demo's base through their warm starts: answer words are
    # single tokens): Qwen3.5 dense and MoE, Qwen3-VL-MoE; 4 experts, top-2 routing. Expert width 48,
    # not 64: a fused expert tensor whose two sizes are equal (hidden 128 = 2 x 64) is ambiguous to
    # transformers' loader, which transposes Qwen3-VL-MoE's checkpoint layout only when shapes differ.
    "tiny-qwen3.5": _TINY_QWEN3_5,
    "tiny-qwen3.5-moe": replace(
        _TINY_QWEN3_5, family="qwen3_5_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        description="tests and demo base (Qwen3.5-MoE)",
    ),
    "tiny-qwen3-vl-moe": replace(
        _TINY_QWEN3_VL, family="qwen3_vl_moe", word_tokens=(*PALETTE, *SHAPES), num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=48, description="tests and demo base (Qwen3-VL-MoE)",
    ),
    # Benchmarks: the same architecture at ~40 M parameters.
    "bench-qwen2.5-vl": BuiltinModelSpec(
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        mrope_section=(8, 12, 12),  # head_dim 64 -> 32 pairs
        vision_depth=4,
        vision_hidden_size=256,
        vision_intermediate_size=1024,
        vision_num_heads=4,
        vision_fullatt_block_indexes=(1, 3),
        description="benchmarks",
    ),
    # MoE at the bench model's width (issue 54): Qwen3-VL-MoE, 16 experts of 1024, top-2 (2 x 1024 active:
    # the dense twin's MLP width), ~235 M parameters (~33 M active per token); and that dense twin, the
    # same model with one MLP of 2048 per layer (~42 M). Expert width 1024, not 512: a fused expert
    # tensor with two equal sizes is ambiguous to transformers' loader (see the tiny MoE models).
    "bench-qwen3-vl": replace(_BENCH_QWEN3_VL, description="benchmarks (the dense twin of bench-qwen3-vl-moe)"),
    "bench-qwen3-vl-moe": replace(
        _BENCH_QWEN3_VL, family="qwen3_vl_moe", num_experts=16, num_experts_per_tok=2, moe_intermediate_size=1024,
        description="benchmarks (MoE: 16 experts, top-2)",
    ),
}


def _known_models_hint() -> str:
    names = ", ".join(f"{BUILTIN_PREFIX}{name}" for name in (*BUILTIN_MODELS, *WARM_STARTS))
    return f"built-in models: {names}"


def get_builtin_spec(name: str) -> BuiltinModelSpec:
    if name not in BUILTIN_MODELS:
        raise ModelNotFoundError(f"unknown built-in model {name!r}; {_known_models_hint()}")
    return BUILTIN_MODELS[name]


def model_cache_dir(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where ``materialize_model(name)`` puts its build (whether or not it exists yet)."""
    if name in WARM_STARTS:  # the key changes with the recipe, so a changed recipe rebuilds
        warm = WARM_STARTS[name]
        key = warm_start_key(warm, spec_key(get_builtin_spec(warm.base)))
        return cache_root(cache_dir) / "models" / f"{name}-v{BUILD_VERSION}-{key}"
    return cache_root(cache_dir) / "models" / f"{name}-v{BUILD_VERSION}-{spec_key(get_builtin_spec(name))}"


def spec_key(spec: BuiltinModelSpec) -> str:
    """A short hash of a spec, part of the cache path, so an edited spec never loads a stale build."""
    import hashlib

    text = repr(spec)
    extra = [(f.name, getattr(spec, f.name)) for f in fields(spec) if not f.repr and getattr(spec, f.name) != f.default]
    if extra:
        text += repr(extra)
    return hashlib.sha1(text.encode()).hexdigest()[:8]


def materialize_model(name: str = "tiny-qwen2.5-vl", cache_dir: str | os.PathLike | None = None) -> Path:
    """The directory of built-in model ``name``, built on first use (atomically) and cached;
    ``cache_dir`` overrides ``$EASYVLM_CACHE`` (default ``~/.cache/easyvlm``)."""
    if name in WARM_STARTS:  # a builtin model after a supervised warm start (built from the base)
        warm = WARM_STARTS[name]
        base = materialize_model(warm.base, cache_dir)
        return build_once(model_cache_dir(name, cache_dir), lambda out: build_warm_start(warm, base, out))
    spec = get_builtin_spec(name)
    return build_once(model_cache_dir(name, cache_dir), lambda out: build_model(spec, out, name=name))


# ---------------------------------------------------------------------------------------------
# Building


def build_tokenizer(word_tokens: tuple[str, ...] = ()):
    """Byte-level BPE (256 byte tokens, no merges) + Qwen special tokens + ``word_tokens`` (ASCII words,
    one token each wherever they occur), as PreTrainedTokenizerFast. eos = ``<|im_end|>``, pad =
    ``<|endoftext|>``, no bos (as Qwen)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split (use_regex=False): with no merges, every byte is a token anyway.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # Registered here, in SPECIAL_TOKENS order, so their ids are 256, 257, ... on every build.
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    for word in word_tokens:  # the byte-level decoder maps printable ASCII (but the space) to itself
        if not (word.isascii() and word.isprintable() and " " not in word):
            raise ValueError(f"word token {word!r}: only printable ASCII without spaces decodes unchanged")
    tok.add_tokens(list(word_tokens))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("<|im_end|>", "<|endoftext|>")],
        model_max_length=32768,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(spec: BuiltinModelSpec, out_dir: Path, name: str = "") -> None:
    """Write model, tokenizer, processor and generation config for ``spec`` into ``out_dir``."""
    import torch
    import transformers
    from transformers import GenerationConfig

    tokenizer = build_tokenizer(spec.word_tokens)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    unk = tokenizer.unk_token_id
    missing = [t for t, i in ids.items() if i is None or i == unk]
    if missing:
        raise RuntimeError(f"tokenizer build lost special tokens {missing}")

    config = model_config(spec, ids, len(tokenizer))
    torch.manual_seed(spec.seed)
    model = getattr(transformers, FAMILIES[spec.family][1])(config).to(torch.float32).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    from easyvlm.models.checkpoint_layout import rewrite_in_checkpoint_layout

    rewrite_in_checkpoint_layout(config, out_dir)  # the real checkpoints' layout, which transformers and vLLM load
    if not (out_dir / "config.json").is_file():  # never commit a build without weights to the cache
        raise RuntimeError(
            f"building {name or spec}: save_pretrained wrote no model files; transformers writes them only on rank 0 "
            f"of an initialised torch.distributed group: build in a process without one "
            f"(python -m easyvlm.builtin.models {name})"
        )
    # Only ids: vLLM takes sampling defaults (temperature, top_p ...) from this file.
    GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
    ).save_pretrained(out_dir)

    processor(spec, tokenizer, CHAT_TEMPLATE).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)

    n_params = sum(p.numel() for p in model.parameters())
    n_vision = sum(p.numel() for p in model.model.visual.parameters())
    info = {"name": name, "build_version": BUILD_VERSION, "num_parameters": n_params, "num_vision_parameters": n_vision}
    (out_dir / "easyvlm_builtin.json").write_text(json.dumps(info, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    """``python -m easyvlm.builtin.models [name ...] [--force]``: build (or rebuild) and print paths."""
    import argparse
    import shutil

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("names", nargs="*", default=list(BUILTIN_MODELS), help=f"default: {list(BUILTIN_MODELS)}")
    parser.add_argument("--cache-dir", default=None, help="default: $EASYVLM_CACHE or ~/.cache/easyvlm")
    parser.add_argument("--force", action="store_true", help="delete the cached build first (nothing may use it)")
    args = parser.parse_args(argv)
    for name in args.names:
        if args.force:
            shutil.rmtree(model_cache_dir(name, args.cache_dir), ignore_errors=True)
        path = materialize_model(name, args.cache_dir)
        info_file = path / "easyvlm_builtin.json"  # a warm start has none: its size is its base's
        size = f" ({json.loads(info_file.read_text())['num_parameters']:,} parameters)" if info_file.is_file() else ""
        print(f"{BUILTIN_PREFIX}{name}: {path}{size}")


def register() -> None:
    """Make ``builtin:<name>`` a model path that easyvlm.models.paths resolves (by building it here)."""
    register_model_scheme(BUILTIN_PREFIX, ModelScheme(build=lambda name: str(materialize_model(name)), known_names=_known_models_hint))


if __name__ == "__main__":
    main()
