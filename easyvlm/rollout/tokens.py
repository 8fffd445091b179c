"""Which token ids a rollout may never emit, and which end one, from the tokenizer and model config."""

from __future__ import annotations

from typing import Any

# Vision placeholders of the Qwen-VL family. A response that contains one would break the next
# forward pass (the processor expands each placeholder into image features), so they are blocked.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
VISION_TOKEN_ID_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def model_vocab_size(model_config: Any) -> int:
    """The number of rows of the LM head (V): the text config's ``vocab_size``."""
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    return int(text_config.vocab_size)


def blocked_token_ids(tokenizer: Any, model_config: Any) -> list[int]:
    """Sorted ids that sampling must never produce: the vision placeholders (model config and tokenizer)
    and a padded LM head's rows the tokenizer cannot decode (Qwen2.5-VL: 152064 rows, 151665 tokens).
    Raises ValueError for a tokenizer far smaller than the LM head (not this model's)."""
    blocked: set[int] = set()
    for name in VISION_TOKEN_ID_FIELDS:
        token_id = getattr(model_config, name, None)
        if token_id is not None:
            blocked.add(int(token_id))
    unk = getattr(tokenizer, "unk_token_id", None)
    vocab = tokenizer.get_vocab()
    blocked.update(vocab[token] for token in VISION_TOKENS if token in vocab and vocab[token] != unk)
    rows = model_vocab_size(model_config)
    if len(tokenizer) < rows // 2:
        # e.g. transformers 5 builds an EMPTY tokenizer (1 token) from a directory without tokenizer files
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's LM head has {rows} rows: it is not this "
            f"model's tokenizer (a model directory without tokenizer files?); set worker.actor.model.tokenizer_path"
        )
    blocked.update(range(len(tokenizer), rows))
    return sorted(blocked)


def eos_token_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """Sorted ids that end a response: the tokenizer's EOS plus the generation config's. Raises
    ValueError when neither names one."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    extra = getattr(generation_config, "eos_token_id", None)
    if extra is not None:
        ids.update(int(i) for i in ([extra] if isinstance(extra, int) else extra))
    if not ids:
        raise ValueError(
            "no EOS token: the tokenizer has no eos_token and the model's generation_config.json lists no "
            "eos_token_id; set one of them in the model directory so that responses can end"
        )
    return sorted(ids)


def pad_token_id(tokenizer: Any) -> int:
    """The tokenizer's pad id, else its EOS id (the id that fills responses after they end)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad_token nor an eos_token; set pad_token in the model directory")
    return int(pad)
