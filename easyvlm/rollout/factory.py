"""``build_rollout``: the RolloutEngine that ``worker.rollout.name`` asks for (vllm imported lazily)."""

from __future__ import annotations

from typing import Any

from easyvlm.rollout.base import RolloutEngine, Sampling
from easyvlm.rollout.tokens import blocked_token_ids, eos_token_ids, pad_token_id


def sampling_from_config(config: Any, response_length: int) -> Sampling:
    """The configured sampling of ``worker.rollout`` (max tokens = ``data.max_response_length``)."""
    return Sampling(
        n=config.n,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        max_tokens=response_length,
        ignore_eos=config.ignore_eos,
    ).validate(response_length)


def build_rollout(
    config: Any,
    model_path: str,
    tokenizer: Any,
    max_prompt_length: int,
    max_response_length: int,
    device: str = "cpu",
    mm_processor_kwargs: dict | None = None,
) -> RolloutEngine:
    """Build the engine for ``config`` (``worker.rollout``, a RolloutConfig).

    model_path: a local model directory (after ``resolve_model_path``), loaded by the engine itself;
    the actor's weights arrive later through ``update_weights``. tokenizer: the policy's tokenizer
    (pad, EOS and blocked ids come from it and the model config). max_prompt_length /
    max_response_length: ``data.*``; T = max_response_length, and vLLM's context is
    ``config.max_model_len`` or their sum. device: "cpu" or "cuda". mm_processor_kwargs (vLLM
    only): ``easyvlm.data.images.vllm_mm_processor_kwargs(data.min_pixels, data.max_pixels)``,
    so that vLLM's processor keeps the image sizes the data pipeline chose.
    """
    from transformers import AutoConfig, GenerationConfig

    model_config = AutoConfig.from_pretrained(model_path)
    try:
        generation_config = GenerationConfig.from_pretrained(model_path)
    except OSError:  # no generation_config.json: the tokenizer's EOS alone ends responses
        generation_config = None
    common = dict(
        sampling=sampling_from_config(config, max_response_length),
        response_length=max_response_length,
        pad_token_id=pad_token_id(tokenizer),
        eos_token_ids=eos_token_ids(tokenizer, generation_config),
        blocked_token_ids=blocked_token_ids(tokenizer, model_config),
    )
    if config.name == "vllm":
        from easyvlm.rollout.vllm import VLLMRolloutEngine

        max_model_len = config.max_model_len or max_prompt_length + max_response_length
        if max_model_len < max_prompt_length + max_response_length:
            raise ValueError(
                f"worker.rollout.max_model_len={max_model_len} is shorter than data.max_prompt_length + "
                f"data.max_response_length = {max_prompt_length + max_response_length}; raise it or leave it unset"
            )
        return VLLMRolloutEngine(
            config,
            model_path,
            model_config,
            max_model_len=max_model_len,
            device=device,
            mm_processor_kwargs=mm_processor_kwargs,
            **common,
        )
    if config.name == "hf":
        from easyvlm.rollout.hf import HFRolloutEngine

        return HFRolloutEngine(
            model_path,
            dtype=config.dtype,
            device=device,
            seed=config.seed,
            micro_batch_size=config.max_num_seqs,
            **common,
        )
    raise ValueError(f"worker.rollout.name={config.name!r} is not an engine; choose 'vllm' or 'hf'")
