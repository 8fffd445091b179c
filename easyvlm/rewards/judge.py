"""A generative judge (``worker.judge``): a VLM's verdict on each sample, parsed into ``judge_score``,
from a pool of Ray actors with a cache; docs/rewards.md, "Model-based rewards: a generative judge"."""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from functools import lru_cache
from typing import Any, Callable, Sequence

from easyvlm.rewards.types import RewardError, RewardInput

IMAGE_PLACEHOLDER = "<image>"


@lru_cache(maxsize=4)
def load_template(path: str) -> Any:
    import jinja2

    with open(path) as f:
        return jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(f.read())


def judge_prompt(template_path: str, item: RewardInput) -> str:
    """The judge's prompt text of one sample: the template rendered with ``question`` (``<image>``
    placeholders kept), ``response``, ``ground_truth`` and ``num_images``."""
    return load_template(template_path).render(
        question=item.question, response=item.response, ground_truth=item.ground_truth, num_images=len(item.images),
    )


def cache_key(text: str, image_digests: Sequence[bytes]) -> str:
    digest = hashlib.sha256(text.encode())
    for image in image_digests:
        digest.update(b"\0" + image)
    return digest.hexdigest()


def image_digest(image: Any) -> bytes:
    """The pixels' hash (mode and size included): no encoding, so it costs one pass over the bytes."""
    return hashlib.sha256(f"{image.mode}{image.size}".encode() + image.tobytes()).digest()


class JudgeActor:
    """One judge engine (a Ray actor): prompt rows -> verdict texts, in one generate call."""

    def __init__(self, spec: Any):
        from easyvlm.data.dataset import PromptEncoder
        from easyvlm.rollout.factory import build_rollout

        self.spec = spec
        self.engine = build_rollout(spec.rollout)
        self.encoder = PromptEncoder(spec.data, spec.tokenizer, spec.processor, spec.rollout.engine.hf_config)

    def verdicts(self, requests: list[tuple[str, list]]) -> list[str]:
        from easyvlm.data.collate import collate_prompts
        from easyvlm.data.dataset import RowError

        import torch

        samples = []
        for index, (prompt, images) in enumerate(requests):
            try:
                enc = self.encoder.apply_length_policy(self.encoder.encode({"prompt": prompt, "answer": "", "images": images}))
            except RowError as err:
                raise RewardError(f"worker.judge: the judge prompt of request {index} cannot be encoded: {err}") from err
            samples.append({"input_ids": torch.tensor(enc.input_ids), "position_ids": self.encoder.position_ids(enc),
                             "raw_prompt_ids": enc.raw_prompt_ids, "images": enc.images,
                             "multi_modal_inputs": enc.multi_modal_inputs, "uid": f"judge-{index}"})
        out = self.engine.generate(collate_prompts(samples, self.encoder.pad_token_id))
        mask = out["response_mask"].bool()
        ids = [out["responses"][i][mask[i]].tolist() for i in range(len(out))]
        return self.spec.tokenizer.batch_decode(ids, skip_special_tokens=True)


class Judge:
    """The driver's side: the actor pool, the cache, the parser and the failure handling."""

    def __init__(self, spec: Any, start_actor: Callable[[int], Any] | None = None):
        """``start_actor(index)``: a new judge actor (default: a JudgeActor); one that times out is replaced."""
        from easyvlm.utils.plugins import load_plugin

        self.spec = spec
        self.parser: Callable[..., float] = load_plugin(spec.parser)[0]
        self._start = start_actor or (lambda index: _start_actor(spec, index))
        self.actors = [self._start(i) for i in range(spec.calls.num_workers)]
        self.cache: OrderedDict[str, float] = OrderedDict()

    def score(self, inputs: Sequence[RewardInput]) -> tuple[list[float], dict[str, float]]:
        """One score per input (0 for a failure with on_error=zero) and the call's metrics."""
        import ray

        start = time.perf_counter()
        prompts = [judge_prompt(self.spec.template, item) for item in inputs]
        digests: dict[int, bytes] = {}  # a GRPO group's samples share their image objects: hash each once
        keys = [cache_key(p + "\0" + item.response, [digests.setdefault(id(im), image_digest(im)) for im in item.images])
                for p, item in zip(prompts, inputs)]
        unique: dict[str, int] = {}  # the same prompt and response twice in one step: judged once
        for i, key in enumerate(keys):
            if key not in self.cache:
                unique.setdefault(key, i)
        asked = list(unique.values())
        metrics = {"judge/requests": float(len(inputs)), "judge/cache_hits": float(len(inputs) - len(asked)),
                   "judge/calls": 0.0, "judge/parse_failures": 0.0, "judge/timeouts": 0.0}
        verdicts: dict[int, str | None] = {}
        if asked:
            shares = [asked[k :: len(self.actors)] for k in range(len(self.actors))]
            calls = [(k, share, actor.verdicts.remote([(prompts[i], list(inputs[i].images)) for i in share]))
                     for k, (share, actor) in enumerate(zip(shares, self.actors)) if share]
            metrics["judge/calls"] = float(len(calls))
            deadline = time.monotonic() + self.spec.calls.timeout  # the engines work in parallel: one limit for all
            for k, share, ref in calls:
                try:
                    texts = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
                except ray.exceptions.GetTimeoutError:
                    metrics["judge/timeouts"] += sum(1 for key in keys if unique.get(key) in share)
                    ray.kill(self.actors[k])  # it may be stuck: a new engine serves the next calls
                    self.actors[k] = self._start(k)
                    self._fail(share[0], f"the judge took longer than worker.judge.timeout={self.spec.calls.timeout} s")
                    texts = [None] * len(share)
                for i, text in zip(share, texts):
                    verdicts[i] = text
        scores: list[float] = []
        for i, (key, item) in enumerate(zip(keys, inputs)):
            if key in self.cache:
                self.cache.move_to_end(key)
                scores.append(self.cache[key])
                continue
            text = verdicts.get(unique[key])
            value = None if text is None else self._parse(text, item, i)
            if value is None:
                metrics["judge/parse_failures"] += text is not None
                scores.append(0.0)
                continue
            scores.append(value)
            self._remember(key, value)
        metrics["judge/score_mean"] = sum(scores) / len(scores) if scores else 0.0
        metrics["timing_s/judge"] = time.perf_counter() - start
        return scores, metrics

    def _parse(self, verdict: str, item: RewardInput, index: int) -> float | None:
        import math

        try:
            value = float(self.parser(verdict, item.to_dict()))
            if not math.isfinite(value):
                raise ValueError(f"returned {value}")
        except Exception as exc:  # the parser is user code: any failure is this sample's
            self._fail(index, f"the parser {self.spec.parser} could not read the verdict {verdict!r}: "
                              f"{type(exc).__name__}: {exc}")
            return None
        return value

    def _fail(self, index: int, problem: str) -> None:
        if self.spec.calls.on_error == "raise":
            raise RewardError(f"worker.judge: sample {index}: {problem}. Set worker.judge.on_error=zero to score such "
                              "samples 0 and keep training (they are counted in judge/parse_failures and judge/timeouts).",
                              self.spec.parser, index)

    def _remember(self, key: str, value: float) -> None:
        if self.spec.calls.cache_size <= 0:
            return
        self.cache[key] = value
        while len(self.cache) > self.spec.calls.cache_size:
            self.cache.popitem(last=False)

    def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []


def _start_actor(spec: Any, index: int) -> Any:
    import ray

    gpus = 1 if spec.rollout.engine.device == "cuda" else 0  # a judge engine per GPU; on the CPU, a CPU
    return ray.remote(JudgeActor).options(num_cpus=1, num_gpus=gpus, name=f"easyvlm-judge-{index}").remote(spec)
