"""Teachers for on-policy distillation tests, written into a test's directory from the builtin models:
one whose output layer is padded past the tokenizer, and one that takes another model's tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

# what a model directory holds besides the weights: the tokenizer, the processor, the chat template
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "processor_config.json", "chat_template.jinja")


def with_files_of(model_dir: str | Path, files_dir: str | Path, out: Path) -> Path:
    """A copy of ``model_dir`` at ``out`` with the tokenizer and processor files of ``files_dir``."""
    shutil.copytree(model_dir, out)
    for name in TOKENIZER_FILES:
        if (Path(files_dir) / name).is_file():
            shutil.copy(Path(files_dir) / name, out / name)
    return out


def padded_teacher(model_dir: str | Path, extra_rows: int, out: Path) -> Path:
    """``model_dir``'s model with ``extra_rows`` more output rows (and embedding rows) than its
    tokenizer has tokens, as transformers' ``resize_token_embeddings`` makes them (Qwen2.5-VL-7B's
    152,064 rows for 151,665 tokens), saved with the same tokenizer and processor."""
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    rows = model.config.get_text_config().vocab_size
    model.resize_token_embeddings(rows + extra_rows)
    assert model.config.get_text_config().vocab_size == rows + extra_rows
    model.save_pretrained(out)
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (Path(model_dir) / name).is_file():
            shutil.copy(Path(model_dir) / name, out / name)
    return out
