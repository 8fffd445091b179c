"""The transformers ``generate`` rollout engine: a fallback and vLLM's reference. It generates from
the prompt Batch's processor outputs, as the actor trains (docs/rollout.md, "Sampling")."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from torch import Tensor
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from easyvlm.data.batch import Batch
from easyvlm.data.collate import concat_multi_modal_inputs
from easyvlm.models.loading import apply_lora, is_vision_language_config
from easyvlm.models.paths import local_model_dir
from easyvlm.models.position_ids import to_model_layout
from easyvlm.models.vision_attention import batch_vision_windows
from easyvlm.rollout.base import RolloutEngine, is_greedy, mix_seeds
from easyvlm.rollout.lora import lora_base_name
from easyvlm.rollout.routing_record import RoutingRecorder
from easyvlm.rollout.specs import RolloutSpec, Sampling

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def load_generation_model(
    model_path: str, hf_config: Any, dtype: torch.dtype, device: str, trust_remote_code: bool = False
) -> torch.nn.Module:
    """The model for generation: an image-text-to-text class when transformers maps one, else causal LM."""
    vision_language = is_vision_language_config(hf_config)
    auto = AutoModelForImageTextToText if vision_language else AutoModelForCausalLM
    model = auto.from_pretrained(model_path, config=hf_config, dtype=dtype, trust_remote_code=trust_remote_code)
    if vision_language:  # the prompts' images through the tower in a few SDPA calls, as the actor's
        batch_vision_windows(model)
    return model.to(device).eval()


class ChosenTokenLogprobs(LogitsProcessor):
    """Last of generate()'s logits processors: each sampled token's log-prob under the distribution it
    was drawn from, one step at a time; each call takes the previous step's token."""

    def __init__(self):
        self.previous: Tensor | None = None  # (B, V) log-probs of the latest step
        self.taken: list[Tensor] = []  # (B,) per finished step

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self.previous is not None:
            self.taken.append(self.previous.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.previous = scores.float().log_softmax(-1)
        return scores

    def logprobs(self, generated: Tensor) -> Tensor:
        """(B, L) generated ids -> (B, L) float32 log-probs; steps computed past the last token are dropped."""
        length = generated.shape[1]
        taken = self.taken[:length]
        if len(taken) < length:
            taken.append(self.previous.gather(-1, generated[:, length - 1 :]).squeeze(-1))
        return torch.stack(taken, 1) if taken else generated.new_zeros(generated.shape, dtype=torch.float32)


def mm_token_type_ids(input_ids: Tensor, model_config: Any) -> Tensor:
    """(B, L) int64 -> (B, L) int32: 0 text, 1 image token, 2 video token (Qwen2/2.5-VL's ``generate``
    builds mRoPE positions only with these)."""
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    for value, name in ((1, "image_token_id"), (2, "video_token_id")):
        token_id = getattr(model_config, name, None)
        if token_id is not None:
            types[input_ids == token_id] = value
    return types


class HFRolloutEngine(RolloutEngine):
    """transformers ``generate`` behind the RolloutEngine interface, built from a `RolloutSpec`;
    ``model`` (e.g. a copy of the actor's module) replaces loading ``model_dir``."""

    def __init__(self, spec: RolloutSpec, model: torch.nn.Module | None = None):
        super().__init__(spec.sampling, spec.response_length, spec.tokens.pad, spec.tokens.eos, spec.tokens.blocked)
        engine = spec.engine
        self.device = device = engine.device
        torch_dtype = torch.float32 if device == "cpu" else DTYPES.get(engine.dtype, torch.float32)
        if model is None:
            model_dir = local_model_dir(engine.model_dir, engine.model_path)
            model = load_generation_model(model_dir, engine.hf_config, torch_dtype, device, engine.trust_remote_code)
        # Neutral defaults: generate() fills every unset field from model.generation_config.
        model.generation_config = GenerationConfig()
        self.lora = engine.lora
        if self.lora is not None:  # adapters served unmerged: the actor's PEFT wrapping, B = 0 until the first sync
            with torch.random.fork_rng(devices=[]):  # PEFT's initial A draws from the global RNG (the actor's)
                model = apply_lora(model, self.lora.lora).eval()
        self.model = model
        # a weight sync's names (the base model's, or PEFT's for adapters) -> the model's state-dict names
        self._names = {lora_base_name(name): name for name in model.state_dict()} if self.lora is not None else {}
        # MoE, router replay R3: the experts of every token generate() feeds the model (routing_record.py)
        self.routing = RoutingRecorder(model) if engine.record_routing else None
        self.micro_batch_size = engine.max_num_seqs
        self.weight_sync_device = device
        self._weights = unique_weights(self.model)  # what sleep() parks in host memory
        self._host_copies: list[Tensor] = []
        self._parked = False  # the weights wait in host memory (sleep)
        generator = torch.Generator().manual_seed(engine.generation.seed)
        self._rng_state = generator.get_state()

    def _generation_config(self, sampling: Sampling) -> GenerationConfig:
        # temperature, top-k and top-p stay at their neutral values here: generate() would append
        # their warpers after every processor passed to it, and ChosenTokenLogprobs must see the
        # final distribution (_logits_processors passes them itself, in transformers' order)
        neutral = dict(temperature=1.0, top_k=0, top_p=1.0) if not is_greedy(sampling) else {}
        return GenerationConfig(
            do_sample=not is_greedy(sampling),
            **neutral,
            max_new_tokens=sampling.max_tokens,
            eos_token_id=None if sampling.ignore_eos else self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            suppress_tokens=self.blocked_token_ids or None,
            return_dict_in_generate=True,
        )

    @staticmethod
    def _logits_processors(sampling: Sampling, recorder: ChosenTokenLogprobs) -> LogitsProcessorList:
        """The sampling warpers in transformers' order (temperature, top-k, top-p), then ``recorder``."""
        warpers = []
        if not is_greedy(sampling):
            if sampling.temperature != 1.0:
                warpers.append(TemperatureLogitsWarper(sampling.temperature))
            if sampling.top_k > 0:
                warpers.append(TopKLogitsWarper(top_k=sampling.top_k))
            if sampling.top_p < 1.0:
                warpers.append(TopPLogitsWarper(top_p=sampling.top_p))
        return LogitsProcessorList([*warpers, recorder])

    @torch.no_grad()
    def _sample(
        self, prompts: Batch, sampling: Sampling, seeds: list[int] | None = None
    ) -> tuple[list[list[int]], list[list[float]]]:
        if seeds is not None:
            # generate() draws all rows from one RNG: seed it from all the rows' seeds, so the same
            # call samples the same tokens (given the same micro-batches), whatever came before
            devices = [torch.device(self.device)] if self.device != "cpu" else []
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(mix_seeds(*seeds))
                return self._sample_chunks(prompts, sampling)
        if self.device != "cpu":  # GPUs: the device's global RNG (seeded by the trainer)
            return self._sample_chunks(prompts, sampling)
        # Sample from the engine's RNG stream without disturbing the caller's (e.g. the actor's).
        with torch.random.fork_rng(devices=[]):
            torch.random.set_rng_state(self._rng_state)
            out = self._sample_chunks(prompts, sampling)
            self._rng_state = torch.random.get_rng_state()
        return out

    def _sample_chunks(self, prompts: Batch, sampling: Sampling) -> tuple[list[list[int]], list[list[float]]]:
        responses: list[list[int]] = []
        logprobs: list[list[float]] = []
        for chunk in prompts.split(self.micro_batch_size or len(prompts)):
            ids, lps = self._generate(chunk, sampling)
            responses += ids
            logprobs += lps
        return responses, logprobs

    def _generate(self, prompts: Batch, sampling: Sampling) -> tuple[list[list[int]], list[list[float]]]:
        input_ids = prompts["input_ids"].to(self.device)
        mm = concat_multi_modal_inputs(prompts.get("multi_modal_inputs") or [])
        if mm:
            mm["mm_token_type_ids"] = mm_token_type_ids(input_ids, self.model.config)
        if self.routing is None:
            return self._generate_tokens(prompts, input_ids, mm, sampling)
        with self.routing.generate_call(prompts["attention_mask"]) as lengths:
            responses, logprobs = self._generate_tokens(prompts, input_ids, mm, sampling)
            lengths += [len(row) for row in responses]
        return responses, logprobs

    def take_routing(self, width: int) -> Tensor | None:
        return None if self.routing is None else self.routing.take(width)

    def _generate_tokens(
        self, prompts: Batch, input_ids: Tensor, mm: dict, sampling: Sampling
    ) -> tuple[list[list[int]], list[list[float]]]:
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=prompts["attention_mask"].to(self.device).long(),
            # The batch's positions, which the actor trains with: generate() extends them by last + 1
            # per new token (as extend_position_ids does). transformers' own would differ after a
            # video (easyvlm.models.position_ids).
            position_ids=to_model_layout(prompts["position_ids"]).to(self.device),
            **{k: v.to(self.device) for k, v in mm.items()},
            generation_config=self._generation_config(sampling),
            logits_processor=self._logits_processors(sampling, recorder := ChosenTokenLogprobs()),
        )
        generated = out.sequences[:, input_ids.shape[1] :]  # (B, L)
        token_logprobs = recorder.logprobs(generated).cpu()  # (B, L), of the processed distributions
        generated = generated.cpu()
        responses, logprobs = [], []
        for row, row_logprobs in zip(generated, token_logprobs):
            length = row.numel()
            if not sampling.ignore_eos:
                # generate() pads finished rows (with an id that may itself be an EOS): cut at the first EOS.
                eos = torch.isin(row, torch.tensor(self.eos_token_ids)).nonzero()
                if eos.numel():
                    length = int(eos[0]) + 1
            responses.append(row[:length].tolist())
            logprobs.append(row_logprobs[:length].tolist())
        return responses, logprobs

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Copy tensors named as ``model.state_dict()``'s keys (a subset is fine) into the model. Raises
        KeyError or ValueError (shape) only after consuming the iterator, a collective every rank reads."""
        targets = self.model.state_dict()  # views of the parameters: copy_ writes the weights
        unknown, misshapen = [], []
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = targets.get(self._names.get(name, name))
                if target is None:
                    unknown.append(name)
                elif target.shape != tensor.shape:
                    misshapen.append(f"{name}: {tuple(tensor.shape)}, the model's {tuple(target.shape)}")
                else:
                    target.copy_(tensor)  # casts to the engine's dtype on the way
        if unknown:
            raise KeyError(
                f"update_weights: {len(unknown)} names are not parameters of the rollout model, e.g. "
                f"{unknown[:3]}; send the names of the transformers model's in-memory state_dict()"
            )
        if misshapen:
            raise ValueError(f"update_weights: {len(misshapen)} tensors do not fit the rollout model: {misshapen[:3]}")

    def update_adapter(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """``AdapterEngine.update_adapter``: PEFT's names are the PEFT-wrapped model's own."""
        assert self.lora is not None, "update_adapter: the plan serves no adapters (EngineSpec.lora)"
        self.update_weights(named_tensors)

    def sleep(self) -> None:
        """GPU: park the weights in pinned host memory until ``wake_up``, as vLLM's sleep level 1 does."""
        if self.device != "cpu" and not self._parked:
            park_in_host_memory(self._weights, self._host_copies)
            self._parked = True
            torch.cuda.empty_cache()

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        if self._parked:
            restore_from_host_memory(self._weights, self.device)
            self._parked = False


def unique_weights(model: torch.nn.Module) -> list[Tensor]:
    """The model's parameters and buffers, each once (tied weights are one tensor)."""
    seen: dict[int, Tensor] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        seen.setdefault(id(tensor), tensor)
    return list(seen.values())


def park_in_host_memory(weights: list[Tensor], host_copies: list[Tensor]) -> None:
    """Move each tensor's data into its (reused, pinned) host copy, keeping the tensor objects."""
    pin = torch.cuda.is_available()
    if not host_copies:
        host_copies.extend(torch.empty(w.shape, dtype=w.dtype, pin_memory=pin) for w in weights)
    for weight, host in zip(weights, host_copies):
        host.copy_(weight.data, non_blocking=pin)
    if pin:
        torch.cuda.synchronize()  # the copies must land before the device storage is freed
    for weight, host in zip(weights, host_copies):
        weight.data = host


def restore_from_host_memory(weights: list[Tensor], device: str | torch.device) -> None:
    """Give each parked tensor device storage again; the host copies stay for the next park."""
    for weight in weights:
        weight.data = weight.data.to(device, non_blocking=True, copy=True)  # never aliasing the host copy
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
