"""The reward actor (a RewardManager in its own Ray actor, so scoring overlaps the log-prob passes)
and `build_reward_inputs`, rollout Batch -> RewardInputs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ray

from easyvlm.rewards.manager import RewardManager, RewardSettings
from easyvlm.rewards.types import RewardInput, RewardResult

if TYPE_CHECKING:  # the actor's process never imports torch (~0.5 GiB resident): Batch is the driver's
    from easyvlm.data.batch import Batch


class RewardActor:
    """Holds one RewardManager (and its worker processes) for the whole run."""

    def __init__(self, settings: RewardSettings):
        self.manager = RewardManager(settings)

    def compute(self, inputs: list[RewardInput]) -> RewardResult:
        return self.manager.compute(inputs)

    def close(self) -> None:
        self.manager.close()

    @staticmethod
    def node() -> dict[str, str]:
        """Where this actor runs, as ``worker_group.node_info`` says it (not imported: it imports torch)."""
        import socket

        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "host": socket.gethostname()}

    @staticmethod
    def peak_rss() -> int:
        """This process's peak resident bytes (``perf/peak_rss_gb/reward``)."""
        from easyvlm.utils.memory import peak_rss_bytes

        return peak_rss_bytes()


def create_reward_actor(settings: RewardSettings, num_cpus: int, name: str | None = None) -> "ray.actor.ActorHandle":
    """Start a RewardActor reserving ``num_cpus`` (Ray initialised, reward files loaded in the driver)."""
    options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": 0}
    if name is not None:
        options["name"] = name
    return ray.remote(RewardActor).options(**options).remote(settings)


def build_reward_inputs(
    batch: Batch, tokenizer: Any, skip_special_tokens: bool = True,
    reward_model_scores: tuple[list[float], list[float]] | None = None,
) -> list[RewardInput]:
    """One RewardInput per sample of a rollout Batch: needs ``responses``, ``response_mask`` (B, T)
    and ``ground_truth``; uses ``prompt_text``, ``images``, ``original_image_sizes`` and ``extra``
    if present. ``reward_model_scores``: (scores, raw scores), one per sample."""
    batch.require("responses", "response_mask", "ground_truth")
    responses, mask = batch["responses"], batch["response_mask"].bool()
    n = len(batch)
    token_ids = [responses[i][mask[i]].tolist() for i in range(n)]
    texts = tokenizer.batch_decode(token_ids, skip_special_tokens=skip_special_tokens)
    prompts = batch.get("prompt_text", [""] * n)
    images = batch.get("images", [None] * n)
    sizes = batch.get("original_image_sizes", [None] * n)
    extra = batch.get("extra", [None] * n)
    trajectories = batch.get("trajectory", [None] * n)  # multi-turn runs (easyvlm.agents.loop)
    rm_scores, rm_raw = reward_model_scores if reward_model_scores is not None else ([None] * n, [None] * n)
    questions = batch.get("question", [""] * n)
    return [
        RewardInput(
            response=texts[i] if trajectories[i] is None else _last_model_turn(trajectories[i]),
            response_length=len(token_ids[i]),
            ground_truth=batch["ground_truth"][i],
            prompt=prompts[i] or "",
            images=list(images[i] or []),
            original_image_sizes=None if sizes[i] is None else [tuple(s) for s in sizes[i]],
            extra=dict(extra[i] or {}),
            trajectory=trajectories[i],
            reward_model_score=rm_scores[i],
            reward_model_raw_score=rm_raw[i],
            question=questions[i] or "",
        )
        for i in range(n)
    ]


def _last_model_turn(trajectory: dict) -> str:
    turns = [m["content"] for m in trajectory["messages"] if m["role"] == "assistant"]
    return turns[-1] if turns else ""
