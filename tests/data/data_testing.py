"""Helpers for the data pipeline tests: configs, files of rows, images."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from PIL import Image

from easyvlm.config.schema import DataConfig

# Pixel limits for the tiny model: factor 28; 56x56 = 4 tokens ... 224x224 = 64 tokens.
MIN_PIXELS = 28 * 28 * 4
MAX_PIXELS = 28 * 28 * 64


def data_config(**overrides) -> DataConfig:
    base = dict(
        train_files="",
        prompt_key="problem",
        answer_key="answer",
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        max_prompt_length=256,
        rollout_batch_size=2,
        filter_overlong_prompts=False,
        filter_overlong_prompts_workers=1,
    )
    base.update(overrides)
    return dataclasses.replace(DataConfig(), **base)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_image(path: Path, width: int, height: int, colour=(200, 30, 30), mode: str = "RGB") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.new("RGB", (width, height), colour)
    # a second colour so that resizing and patch order show in the pixel values
    image.paste((20, 40, 220), (0, 0, max(1, width // 3), max(1, height // 2)))
    image.convert(mode).save(path)
    return path


def assert_vllm_matches_the_forward(batch, hf_model, model_path: str, processor, limits: dict[str, int]) -> None:
    """vLLM, given each sample's ``raw_prompt_ids`` with its images and videos (the rollout's
    request, easyvlm.rollout.vllm.vllm_request), expands them into exactly the batch's ``input_ids``
    and gives the prompt tokens the log-probs of transformers' forward over the padded batch with
    its ``position_ids`` (float32 on both sides but different CPU kernels: equal within 1e-4, not bit for bit)."""
    import torch
    from vllm import LLM, SamplingParams

    from easyvlm.data.collate import concat_multi_modal_inputs
    from easyvlm.data.videos import vllm_mm_processor_kwargs
    from easyvlm.models.position_ids import to_model_layout
    from easyvlm.rollout.vllm import vllm_request

    llm = LLM(
        model=model_path,
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=8,
        enforce_eager=True,
        seed=0,
        kv_cache_memory_bytes=64 * 2**20,
        limit_mm_per_prompt=limits,
        mm_processor_kwargs=vllm_mm_processor_kwargs(processor),
    )
    n = len(batch)
    requests = [
        vllm_request(ids, images, videos)
        for ids, images, videos in zip(batch["raw_prompt_ids"], batch["images"], batch.get("videos") or [[]] * n)
    ]
    outputs = llm.generate(requests, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False)
    with torch.no_grad():
        logits = hf_model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=to_model_layout(batch["position_ids"]),
            **concat_multi_modal_inputs(batch["multi_modal_inputs"]),
        ).logits
    for i, out in enumerate(outputs):
        mask = batch["attention_mask"][i]
        ids = batch["input_ids"][i][mask]
        assert list(out.prompt_token_ids) == ids.tolist(), f"sample {i}: vLLM's expansion differs from input_ids"
        vllm_logprobs = torch.tensor([step[token].logprob for step, token in zip(out.prompt_logprobs[1:], ids[1:].tolist())])
        hf_logprobs = torch.log_softmax(logits[i][mask][:-1], dim=-1).gather(-1, ids[1:, None])[:, 0]
        torch.testing.assert_close(vllm_logprobs, hf_logprobs, rtol=1e-4, atol=1e-4, msg=lambda m: f"sample {i}: {m}")
    del llm
