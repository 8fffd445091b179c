"""Helpers for the model tests: a tiny text-only causal LM (Qwen2 or Llama) saved to a directory."""

from __future__ import annotations

from pathlib import Path


def build_tiny_text_model(out_dir: Path, model_type: str = "qwen2") -> str:
    """Write a random 2-layer, hidden-64 ``model_type`` model plus the built-in byte tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from easyvlm.builtin.models import build_tokenizer

    tokenizer = build_tokenizer()
    config_cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[model_type]
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)
