"""The architectures easyvlm builds tiny models of, with transformers' own classes, so a built model loads with
the Auto classes and in vLLM as its family's real checkpoints do: ``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``,
``qwen3_5`` (gated-DeltaNet and gated attention layers), ``qwen3_5_moe``, ``qwen3_vl_moe``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# family -> (config, model, processor, video processor) class names in transformers. The Qwen3
# families share Qwen3-VL's processor and video processor (per-frame timestamps in the prompt).
FAMILIES = {
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", "Qwen2VLProcessor", "Qwen2VLVideoProcessor"),
    "qwen2_5_vl": (
        "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor",
    ),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", "Qwen3VLProcessor", "Qwen3VLVideoProcessor"),
    "qwen3_vl_moe": (
        "Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration", "Qwen3VLProcessor", "Qwen3VLVideoProcessor",
    ),
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", "Qwen3VLProcessor", "Qwen3VLVideoProcessor"),
    "qwen3_5_moe": (
        "Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", "Qwen3VLProcessor", "Qwen3VLVideoProcessor",
    ),
}
QWEN3_VISION = frozenset({"qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"})  # patch 16, learned positions
QWEN3_5 = frozenset({"qwen3_5", "qwen3_5_moe"})
MOE = frozenset({"qwen3_vl_moe", "qwen3_5_moe"})


@dataclass(frozen=True)
class BuiltinModelSpec:
    """Sizes of a built-in Qwen-VL model of ``family`` (a key of FAMILIES); some fields serve only some families.
    ``mrope_section`` must sum to head_dim x partial_rotary_factor / 2. Fields after ``description`` enter the
    cache key only when not at their defaults, so older builds keep their keys."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    mrope_section: tuple[int, int, int]
    vision_depth: int
    vision_hidden_size: int
    vision_intermediate_size: int
    vision_num_heads: int
    # Vision blocks with full attention (the others use windowed attention, as in Qwen2.5-VL).
    vision_fullatt_block_indexes: tuple[int, ...]
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    # Processor pixel limits: a 56x56 image gives 4 image tokens, 84x84 gives 9.
    min_pixels: int = 28 * 28 * 4
    max_pixels: int = 28 * 28 * 64
    max_position_embeddings: int = 4096
    # Whole-word tokens added after the special tokens. A real BPE vocabulary has single tokens
    # for common words; a byte-only one spells every answer over several tokens, and RL then
    # pushes down the spelling of wrong answers along with the choice (it garbles the words).
    word_tokens: tuple[str, ...] = ()
    seed: int = 0
    description: str = ""
    family: str = field(default="qwen2_5_vl", repr=False)
    # Qwen3-VL: vision blocks whose outputs are also added to the first decoder layers' hidden
    # states at the image tokens (DeepStack), and the size of the learned position-embedding grid
    # (a square number; interpolated to each image's grid).
    vision_deepstack_indexes: tuple[int, ...] = field(default=(), repr=False)
    vision_num_position_embeddings: int = field(default=0, repr=False)
    # Qwen3.5: each decoder layer's token mixer ("linear_attention" or "full_attention"), the
    # gated-DeltaNet sizes (key heads, value heads, one head size for both, convolution width), the
    # softmax attention's head size and the share of it that rotates.
    layer_types: tuple[str, ...] = field(default=(), repr=False)
    linear_key_heads: int = field(default=0, repr=False)
    linear_value_heads: int = field(default=0, repr=False)
    linear_head_dim: int = field(default=0, repr=False)
    linear_conv_kernel: int = field(default=4, repr=False)
    head_dim: int = field(default=0, repr=False)  # 0: hidden_size / num_attention_heads
    partial_rotary_factor: float = field(default=1.0, repr=False)
    # MoE: experts per layer, experts per token, each expert's MLP width (Qwen3.5-MoE's shared
    # expert has the same width).
    num_experts: int = field(default=0, repr=False)
    num_experts_per_tok: int = field(default=0, repr=False)
    moe_intermediate_size: int = field(default=0, repr=False)

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


def model_config(spec: BuiltinModelSpec, ids: dict[str, int], vocab_size: int) -> Any:
    """The transformers config of ``spec``: one text model, one vision tower per family."""
    import transformers

    head_dim = spec.attention_head_dim
    rotary_pairs = int(head_dim * spec.partial_rotary_factor) // 2
    if sum(spec.mrope_section) != rotary_pairs:
        raise ValueError(f"mrope_section {spec.mrope_section} must sum to the {rotary_pairs} rotary frequency pairs")
    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": list(spec.mrope_section)}
    text = dict(
        # Exactly the tokenizer's size: a padded vocabulary lets a random model sample ids that
        # the tokenizer cannot decode (see docs/builtin_assets.md).
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters=rope,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    if spec.family in QWEN3_VISION:
        # The Qwen3 decoders: a separate head_dim, q/k norms, interleaved mRoPE
        text.update(head_dim=head_dim, rope_parameters=dict(rope, rope_theta=5000000.0, mrope_interleaved=True))
    text.update(_hybrid_and_moe(spec))
    config_cls = getattr(transformers, FAMILIES[spec.family][0])
    extra = {}
    # Qwen2/2.5-VL's configs drop top-level copies of these ids (passed as the Qwen2.5-VL build always
    # did); the Qwen3 configs would keep them, where the real ones have them in text_config only.
    if spec.family not in QWEN3_VISION:
        extra = dict(
            bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"]
        )
    return config_cls(
        text_config=text,
        vision_config=vision_config(spec),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        **extra,
        tie_word_embeddings=False,
        dtype="float32",
    )


def _hybrid_and_moe(spec: BuiltinModelSpec) -> dict:
    """The text-config entries of Qwen3.5's linear-attention layers and of the MoE families."""
    entries: dict[str, Any] = {}
    if spec.family in QWEN3_5:
        if len(spec.layer_types) != spec.num_hidden_layers or "linear_attention" not in spec.layer_types:
            raise ValueError(f"{spec.family}: layer_types needs one entry per layer, some 'linear_attention'")
        entries.update(
            layer_types=list(spec.layer_types),
            linear_num_key_heads=spec.linear_key_heads,
            linear_num_value_heads=spec.linear_value_heads,
            linear_key_head_dim=spec.linear_head_dim,
            linear_value_head_dim=spec.linear_head_dim,
            linear_conv_kernel_dim=spec.linear_conv_kernel,
        )
        entries["rope_parameters"] = dict(
            rope_type="default", rope_theta=10000000.0, mrope_section=list(spec.mrope_section),
            mrope_interleaved=True, partial_rotary_factor=spec.partial_rotary_factor,
        )
    if spec.family in MOE:
        if not (spec.num_experts >= 4 and 2 <= spec.num_experts_per_tok < spec.num_experts):
            raise ValueError(f"{spec.family}: at least 4 experts and top-2 routing (got {spec.num_experts}, "
                             f"top-{spec.num_experts_per_tok})")
        entries.update(
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            moe_intermediate_size=spec.moe_intermediate_size,
            # transformers always renormalises the top-k routing weights; vLLM reads this key (the
            # real checkpoints carry it) and fails without it
            norm_topk_prob=True,
        )
    if spec.family == "qwen3_5_moe":  # every layer is MoE (no dense MLP width), plus a shared expert
        entries.pop("intermediate_size", None)
        entries["shared_expert_intermediate_size"] = spec.moe_intermediate_size
    if spec.family == "qwen3_vl_moe":
        entries["decoder_sparse_step"] = 1  # every layer sparse, as Qwen3-VL-30B-A3B
    return entries


def vision_config(spec: BuiltinModelSpec) -> dict:
    """The vision tower's config of ``spec``'s family (each family names the same sizes differently)."""
    patches = dict(
        patch_size=spec.patch_size,
        spatial_merge_size=spec.spatial_merge_size,
        temporal_patch_size=spec.temporal_patch_size,
    )
    if spec.family == "qwen2_5_vl":
        return dict(
            depth=spec.vision_depth,
            hidden_size=spec.vision_hidden_size,
            intermediate_size=spec.vision_intermediate_size,
            num_heads=spec.vision_num_heads,
            out_hidden_size=spec.hidden_size,
            **patches,
            fullatt_block_indexes=list(spec.vision_fullatt_block_indexes),
        )
    if spec.family == "qwen2_vl":
        if spec.vision_intermediate_size % spec.vision_hidden_size:
            raise ValueError("Qwen2-VL: vision_intermediate_size must be a multiple of vision_hidden_size (mlp_ratio)")
        return dict(
            depth=spec.vision_depth,
            embed_dim=spec.vision_hidden_size,
            hidden_size=spec.hidden_size,  # Qwen2-VL's name for the merger's output size
            mlp_ratio=spec.vision_intermediate_size // spec.vision_hidden_size,
            num_heads=spec.vision_num_heads,
            **patches,
        )
    if spec.family in QWEN3_VISION:
        # a ViT with learned position embeddings; Qwen3-VL's also feeds DeepStack features to the
        # first decoder layers (Qwen3.5's tower has none)
        tower = dict(
            depth=spec.vision_depth,
            hidden_size=spec.vision_hidden_size,
            intermediate_size=spec.vision_intermediate_size,
            num_heads=spec.vision_num_heads,
            out_hidden_size=spec.hidden_size,
            **patches,
            num_position_embeddings=spec.vision_num_position_embeddings,
        )
        if spec.family not in QWEN3_5:
            if len(spec.vision_deepstack_indexes) >= spec.num_hidden_layers:
                raise ValueError("Qwen3-VL: DeepStack features enter after decoder layers 0, 1, ...; spare the last one")
            tower["deepstack_visual_indexes"] = list(spec.vision_deepstack_indexes)
        return tower
    raise ValueError(f"unknown model family {spec.family!r}; known: {sorted(FAMILIES)}")


def processor(spec: BuiltinModelSpec, tokenizer: Any, chat_template: str) -> Any:
    """The family's processor: Qwen2-VL's image processor (all families use it) and the family's
    video processor, with the spec's patch sizes and pixel limits."""
    import transformers
    from transformers import Qwen2VLImageProcessor

    _, _, processor_name, video_name = FAMILIES[spec.family]
    common = dict(
        patch_size=spec.patch_size, temporal_patch_size=spec.temporal_patch_size, merge_size=spec.spatial_merge_size
    )
    if spec.family in QWEN3_VISION:
        # As the real Qwen3-VL preprocessor configs: mean/std 0.5; the video limits count all
        # frames of a video together (Qwen3-VL's video smart_resize), here up to 8 frames' worth.
        norm = dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
        pixel_limits = dict(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)
        image_processor = Qwen2VLImageProcessor(**pixel_limits, **common, **norm)
        video_size = {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels * 8}
        video_processor = getattr(transformers, video_name)(size=video_size, **common, **norm)
    else:
        pixel_limits = dict(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)
        image_processor = Qwen2VLImageProcessor(**pixel_limits, **common)
        video_processor = getattr(transformers, video_name)(**pixel_limits, **common)
    return getattr(transformers, processor_name)(
        image_processor=image_processor,
        video_processor=video_processor,
        tokenizer=tokenizer,
        chat_template=chat_template,
    )
