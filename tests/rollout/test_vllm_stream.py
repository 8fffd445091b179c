"""The vLLM engine's generation stream (partial rollouts: ``RolloutEngine.stream_*``) on the built-in
tiny Qwen2.5-VL: groups submitted, advanced a few scheduler steps at a time, new weights loaded
between two steps; against generate() and transformers.

One engine for the module, built with ``enforce_eager=true`` (no torch.compile: ~9 s to build
instead of ~25 s; the stream drives the same scheduler and model either way).
"""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import recompute_logprobs, response_logits, rollout_plan, with_sampling
from transformers import AutoModelForImageTextToText

from easyvlm.data.batch import Batch
from easyvlm.rollout.base import SEED_KEY, prompt_seeds
from easyvlm.rollout.factory import build_rollout

T = 12  # response length
VLLM_OVERRIDES = (
    "worker.rollout.name=vllm",
    "worker.rollout.max_num_seqs=32",
    "worker.rollout.disable_tqdm=true",
    "worker.rollout.gpu_memory_utilization=0.1",
    "worker.rollout.enforce_eager=true",
)
# After a pause the tokens so far are prefilled in one pass instead of the decode steps that computed
# their KV the first time: the same float32 products summed in other orders (other kernels and batch
# shapes), so log-probs may move by float32 rounding, ~1e-7 relative to the logits. Measured on this
# model: 0 (seeded, n=2) and 4.8e-7 (greedy, n=1); 1e-5 leaves room for other CPUs' kernels, far below
# what other weights change (> 0.1 for the perturbation of test_vllm.py's weight-sync test).
RECOMPUTED_KV_ATOL = 1e-5


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    """vLLM, n=2, temperature 1, seed 3 (rollout_helpers), no chunked prefill (seeded sampling)."""
    engine = build_rollout(rollout_plan(tiny_model_path, T, *VLLM_OVERRIDES).rollout)
    yield engine
    engine.stream_cancel()


@pytest.fixture(autouse=True)
def empty_stream(request):
    """Every test of the engine starts and ends with nothing in flight (a failed one cancels what it
    left)."""
    if "engine" not in request.fixturenames:
        yield
        return
    engine = request.getfixturevalue("engine")
    assert engine.stream_pending() == 0 and not engine.llm.llm_engine.has_unfinished_requests()
    yield
    engine.stream_cancel()
    engine.stream_advance(0)  # drop groups completed and not returned
    engine.stream_start_version(0)


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return AutoModelForImageTextToText.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def with_seeds(prompts: Batch, step: int) -> Batch:
    prompts = prompts.copy()
    prompts[SEED_KEY] = prompt_seeds(1, (0, step, 0), len(prompts))
    return prompts


def run_to_end(engine, steps_per_call: int = 1, limit: int = 200) -> dict[tuple[int, int], Batch]:
    """Advance until no group is pending; the groups returned, by id."""
    groups: dict[tuple[int, int], Batch] = {}
    for _ in range(limit):
        if not engine.stream_pending():
            return groups
        for key, batch in engine.stream_advance(steps_per_call):
            assert key not in groups
            groups[key] = batch
    raise AssertionError(f"{engine.stream_pending()} groups still pending after {limit} calls")


def stream_rows(groups: dict[tuple[int, int], Batch], tag: int, count: int) -> Batch:
    """The groups of ``tag`` as one Batch in prompt order (rows as generate() orders them)."""
    return Batch.concat([groups[(tag, i)] for i in range(count)])


STREAM_KEYS = {"rollout_token_versions", "rollout_version"}


def assert_same_rollout(streamed: Batch, expected: Batch, logprob_atol: float, extra: set[str] = STREAM_KEYS) -> None:
    """The keys of ``expected`` plus ``extra``, the same dtypes and shapes, the same values
    (log-probs within ``logprob_atol``)."""
    assert set(streamed.keys()) == set(expected.keys()) | extra
    for key in expected.keys():
        want, got = expected[key], streamed[key]
        if isinstance(want, torch.Tensor):
            assert (got.dtype, got.shape) == (want.dtype, want.shape), key
            if key == "rollout_logprobs":
                torch.testing.assert_close(got, want, atol=logprob_atol, rtol=0)
            else:
                assert torch.equal(got, want), key
        elif key not in ("images", "multi_modal_inputs"):  # PIL images and tensors compare poorly
            assert got == want, key


@pytest.mark.slow
def test_stream_equals_generate_when_seeded(engine, prompts):
    """Test 1: a seeded group streamed one step at a time samples what generate() samples (the same
    requests, seeds and sampling parameters). Tokens exactly; log-probs within 1e-6: the same
    computation but for the batch (the stream's requests with images prefill without the prefix
    cache, generate()'s read it), so at most float32 rounding, ~1e-7 of the logits (measured:
    identical)."""
    seeded = with_seeds(prompts, step=1)
    expected = engine.generate(seeded)  # the plan's n = 2, temperature 1
    engine.stream_submit(seeded, tag=7)
    assert engine.stream_pending() == 3
    groups = run_to_end(engine, steps_per_call=1)
    assert sorted(groups) == [(7, 0), (7, 1), (7, 2)]
    streamed = stream_rows(groups, 7, 3)
    assert_same_rollout(streamed, expected, logprob_atol=1e-6)
    mask = streamed["response_mask"]
    assert streamed["rollout_token_versions"].dtype == torch.long
    assert torch.equal(streamed["rollout_token_versions"], torch.where(mask, 0, -1))
    assert torch.equal(streamed["rollout_version"], torch.zeros(6, dtype=torch.long))
    assert engine.stream_pending() == 0 and not engine.llm.llm_engine.has_unfinished_requests()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["seeded", "greedy"])
def test_pause_and_resume_with_the_same_weights(engine, model, prompts, mode):
    """Test 2: two scheduler steps (the prefill and one decode step: two tokens per sample), then
    the same weights loaded as version 1: the requests are preempted, prefill their prompt and
    tokens again and go on with their seeded generators, sampling what an uninterrupted
    generate() samples. generate() first also puts the prompts' images in the prefix cache: the case
    where vLLM would hand the stream's requests to its model runner without their pixels
    (VLLMRolloutEngine.stream_submit)."""
    if mode == "seeded":
        batch, sampling = with_seeds(prompts, step=2), with_sampling(engine, n=2)
    else:
        batch, sampling = prompts, with_sampling(engine, n=1, temperature=0.0)
    expected = engine.generate(batch, sampling)
    engine.stream_submit(batch, tag=1, sampling=sampling)
    assert engine.stream_advance(2) == []
    engine.stream_set_weights(model.state_dict().items(), version=1)
    assert engine.stream_version() == 1
    streamed = stream_rows(run_to_end(engine, steps_per_call=3), 1, 3)
    diff = (streamed["rollout_logprobs"] - expected["rollout_logprobs"]).abs().max()
    print(f"{mode}: max |log-prob difference| after the recomputed KV {diff:.2e}")
    assert_same_rollout(streamed, expected, logprob_atol=RECOMPUTED_KV_ATOL)
    mask = streamed["response_mask"]
    assert mask[:, 2:].any(), "no sample goes on after the switch: nothing to check"
    positions = torch.arange(T).expand_as(mask)
    assert torch.equal(streamed["rollout_token_versions"], torch.where(mask, (positions >= 2).long(), -1))
    assert torch.equal(streamed["rollout_version"], torch.zeros(len(mask), dtype=torch.long))
    spans = ((streamed["rollout_token_versions"] == 0).any(1) & (streamed["rollout_token_versions"] == 1).any(1)).sum()
    assert spans >= 1


@pytest.mark.slow
def test_new_weights_mid_generation(engine, model, tiny_model_path, prompts):
    """Test 3: greedy, perturbed weights loaded after two tokens: the first two tokens are the old
    weights' greedy ones, every later token is the new weights' greedy choice for its prefix
    (transformers' argmax over the streamed sequence), and the log-probs are each version's."""
    actor = AutoModelForImageTextToText.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():  # the "update": noise on every parameter, vision tower included
        for p in actor.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    greedy = with_sampling(engine, n=1, temperature=0.0)
    old = engine.generate(prompts, greedy)
    engine.stream_submit(prompts, tag=3, sampling=greedy)
    engine.stream_advance(2)
    try:
        engine.stream_set_weights(actor.state_dict().items(), version=1)
        streamed = stream_rows(run_to_end(engine, steps_per_call=4), 3, 3)
    finally:
        engine.stream_cancel()
        engine.update_weights(model.state_dict().items())  # the module's engine: original weights back

    responses, mask = streamed["responses"], streamed["response_mask"]
    assert mask[:, 2:].all(), "the tiny model samples no EOS in 12 greedy steps here"
    assert torch.equal(responses[:, :2], old["responses"][:, :2])
    # the check can fail: the new weights continue differently from the old ones
    assert not torch.equal(responses[:, 2:], old["responses"][:, 2:])
    blocked = engine.blocked_token_ids
    with torch.no_grad():
        logits = response_logits(actor, streamed)
    logits[..., blocked] = float("-inf")
    top2 = logits.topk(2, dim=-1).values
    gap = (top2[..., 0] - top2[..., 1])[:, 2:]
    assert gap.min() > 1e-4, f"near-tie on the greedy path (gap {gap.min():.2e}): comparison meaningless"
    assert torch.equal(logits.argmax(-1)[:, 2:], responses[:, 2:])
    new_logprobs = recompute_logprobs(actor, streamed, 0, blocked)
    old_logprobs = recompute_logprobs(model, streamed, 0, blocked)
    torch.testing.assert_close(streamed["rollout_logprobs"][:, 2:], new_logprobs[:, 2:], atol=1e-4, rtol=0)
    torch.testing.assert_close(streamed["rollout_logprobs"][:, :2], old_logprobs[:, :2], atol=1e-4, rtol=0)
    versions = torch.zeros_like(responses)
    versions[:, 2:] = 1
    assert torch.equal(streamed["rollout_token_versions"], versions)
    assert torch.equal(streamed["rollout_version"], torch.zeros(3, dtype=torch.long))


@pytest.mark.slow
def test_generate_while_the_stream_is_in_flight(engine, prompts):
    """Test 4: validation runs while stream groups are unfinished: generate() returns what it
    returns alone, and the stream's groups (advanced by generate()'s steps too) complete with all
    their tokens, as they would alone."""
    stream_batch, val_batch = with_seeds(prompts, step=4), with_seeds(prompts, step=5)
    four = with_sampling(engine, n=4)
    stream_alone = engine.generate(stream_batch)
    val_alone = engine.generate(val_batch, four)

    engine.stream_submit(stream_batch, tag=4)
    assert engine.stream_advance(2) == []
    val = engine.generate(val_batch, four)
    assert_same_rollout(val, val_alone, logprob_atol=1e-5, extra=set())
    # generate()'s 12 steps finished the stream's groups; they wait for the next stream_advance
    assert not engine.llm.llm_engine.has_unfinished_requests() and engine.stream_pending() == 3
    groups = engine.stream_advance(1)
    assert sorted(key for key, _ in groups) == [(4, 0), (4, 1), (4, 2)]
    streamed = stream_rows(dict(groups), 4, 3)
    assert_same_rollout(streamed, stream_alone, logprob_atol=1e-5)
    assert engine.stream_pending() == 0


@pytest.mark.slow
def test_cancel(engine, prompts):
    """Test 5: a group that already finished (one token) comes back; the unfinished ones are
    cancelled and their requests aborted: nothing runs afterwards, and the engine still works."""
    engine.stream_submit(prompts.index([0]), tag=10, sampling=with_sampling(engine, max_tokens=1))
    engine.stream_submit(prompts, tag=11)
    done = engine.stream_advance(2)
    assert [key for key, _ in done] == [(10, 0)]
    assert engine.stream_pending() == 3
    assert sorted(engine.stream_cancel()) == [(11, 0), (11, 1), (11, 2)]
    assert engine.stream_pending() == 0
    assert not engine.llm.llm_engine.has_unfinished_requests()
    assert engine.stream_advance(5) == []
    greedy = with_sampling(engine, n=1, temperature=0.0, max_tokens=2)
    assert engine.generate(prompts, greedy)["response_mask"].sum() == 6


def test_refused_prompts_leave_the_stream_usable(engine, prompts):
    """_check_prompts refuses expanded raw_prompt_ids before anything is added, and the images it
    rendered do not stay marked as sent in vLLM's renderer cache (the next request with them would
    fail with MultiModalCacheMissError)."""
    expanded = prompts.copy()
    expanded["raw_prompt_ids"] = [row[mask].tolist() for row, mask in zip(prompts["input_ids"], prompts["attention_mask"])]
    with pytest.raises(ValueError, match="one vision placeholder per image"):
        engine.stream_submit(expanded, tag=20)
    assert engine.stream_pending() == 0 and not engine.llm.llm_engine.has_unfinished_requests()
    engine.stream_submit(prompts, tag=21, sampling=with_sampling(engine, n=1, max_tokens=2))
    assert sorted(run_to_end(engine, steps_per_call=5)) == [(21, 0), (21, 1), (21, 2)]


def test_weights_and_sleep_while_streaming(engine, model, prompts, monkeypatch):
    """update_weights is refused under unfinished groups (their KV cache would stay the old
    weights'); sleep() releases nothing then (vLLM's GPU sleep would drop the KV cache and abort
    the requests); the engines without a stream say which one has it."""
    engine.stream_submit(prompts.index([2]), tag=0, sampling=with_sampling(engine, max_tokens=2))
    with pytest.raises(RuntimeError, match="stream_set_weights"):
        engine.update_weights(model.state_dict().items())
    with pytest.raises(RuntimeError, match="unfinished"):
        engine.stream_start_version(3)
    with pytest.raises(ValueError, match="already in the stream"):
        engine.stream_submit(prompts.index([2]), tag=0)
    slept = []
    monkeypatch.setattr(engine, "device", "cuda")  # the GPU path (vLLM's sleep mode), spied on
    monkeypatch.setattr(engine.llm, "sleep", lambda level: slept.append(level))
    engine.sleep()
    assert slept == []
    run_to_end(engine)
    engine.sleep()
    assert slept == [1]


def test_engines_without_a_stream_refuse_it():
    """The stream is a protocol (StreamingEngine): the vLLM engine and the test double have it; an
    engine without it (the transformers engine) is refused by name of the engine that has one."""
    from easyvlm.rollout.base import RolloutEngine, StreamingEngine, streaming
    from easyvlm.rollout.hf import HFRolloutEngine
    from easyvlm.rollout.specs import Sampling
    from easyvlm.rollout.vllm import VLLMRolloutEngine
    from rollout_testing import FakeRolloutEngine

    class NoStream(RolloutEngine):
        def _sample(self, prompts, sampling, seeds=None):
            raise AssertionError("not called")

        def update_weights(self, named_tensors):
            pass

    sampling = Sampling(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=2, ignore_eos=False)
    engine = NoStream(sampling, 2, 0, [2], [])
    with pytest.raises(NotImplementedError, match="worker.rollout.name=vllm"):
        streaming(engine)
    fake = FakeRolloutEngine(lambda ids, j: [5], sampling, 2, 0, [2])
    assert streaming(fake) is fake
    # the classes themselves: every stream method present on vLLM's, none on the transformers engine's
    methods = [name for name in dir(StreamingEngine) if name.startswith("stream_")]
    assert len(methods) == 7 and all(callable(getattr(VLLMRolloutEngine, m, None)) for m in methods)
    assert not any(hasattr(HFRolloutEngine, m) for m in methods)
