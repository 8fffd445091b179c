"""Each image through a frozen vision tower once (``worker.actor.vision_cache_mb``,
easyvlm/models/vision_cache.py): the log-probs and gradients are bitwise those of recomputing, the
later passes encode nothing, the reference reuses the actor's entries only when its tower computes
alike, and a tower that trains is refused.

"Recomputing" is the model's own forward with ``pixel_values``, in micro-batches of one sample, so
that every tower call sees one image, as the cache's calls do (with several images per call a
matrix product's rounding depends on its row count: bitwise equality across groupings is not a
property of the tower, cached or not).
"""

from __future__ import annotations

import pytest
import torch
from workers_testing import MIXED_PROMPTS, PROMPTS, RESPONSE_LENGTHS, actor_spec, make_rl_batch, training_keys

from easyvlm.models.vision_cache import (
    MiB,
    Encoded,
    PendingVision,
    VisionEmbeddingCache,
    encode_pending,
    install_vision_cache,
    pixel_keys,
    same_frozen_tower,
)
from easyvlm.workers.actor import ActorWorker

ONE_SAMPLE = dict(micro_batch_size_per_device_for_experience=1, micro_batch_size_per_device_for_update=1,
                  dynamic_batching=False)
# images of PROMPTS: (56, 56), (84, 56), (56, 84), (56, 56) with other pixels; the forward adds a
# dummy image to micro-batches without one and a dummy video to those without a video (vision_dummy)
DISTINCT_INPUTS = 4 + 2


def make_actor(model_path: str, budget: int, **overrides) -> ActorWorker:
    spec = actor_spec(model_path, freeze_vision_tower=True, vision_cache_mb=budget, **{**ONE_SAMPLE, **overrides})
    assert spec.forward.vision_cache_mb == budget
    return ActorWorker(spec, rank=0, world_size=1)


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl", "qwen3.5"])
def test_cached_logprobs_are_bitwise_the_recomputed_ones(process_group, tiny_model_path, easyvlm_cache_dir, family):
    # qwen3-vl: the deepstack features travel with the embeddings; qwen3.5: gated-DeltaNet decoder,
    # Qwen3-VL's tower without deepstack; the mixed prompts add videos
    from easyvlm.builtin.models import materialize_model

    path = tiny_model_path if family == "qwen2.5-vl" else str(materialize_model(f"tiny-{family}", cache_dir=easyvlm_cache_dir))
    batch = make_rl_batch(path, PROMPTS[:4] + MIXED_PROMPTS[5:7], RESPONSE_LENGTHS[:6])
    recomputed = make_actor(path, 0).compute_logprobs(batch, with_entropy=True)
    actor = make_actor(path, 64)
    assert actor.setup.vision_cache is actor.vision.cache
    first = actor.compute_logprobs(batch, with_entropy=True)
    hits, misses = actor.vision.cache.take_counts()
    # 2 images, 2 videos, the dummy image and the dummy video; 6 forwards x (image + video) = 12 lookups
    assert (hits, misses) == (12 - 6, 6)
    second = actor.compute_logprobs(batch, with_entropy=True)
    assert actor.vision.cache.take_counts() == (12, 0)  # the second pass encodes nothing
    for out in (first, second):
        assert torch.equal(out["old_logprobs"], recomputed["old_logprobs"])
        assert torch.equal(out["entropies"], recomputed["entropies"])


def test_cached_update_is_bitwise_the_recomputed_one(process_group, tiny_model_path):
    batch = make_rl_batch(tiny_model_path, PROMPTS, RESPONSE_LENGTHS)
    noise, advantages = training_keys(batch)
    settings = dict(global_batch_size=8, max_grad_norm=0.5, extra=("data.rollout_batch_size=8",))
    results = []
    for budget in (0, 64):
        actor = make_actor(tiny_model_path, budget, **settings)
        data = batch.copy()
        data["old_logprobs"] = actor.compute_logprobs(batch)["old_logprobs"] + noise
        data["advantages"] = advantages
        metrics = actor.update_policy(data)
        results.append((metrics, actor.state_dict_for_sync(), actor))
    (plain, plain_weights, _), (cached, cached_weights, actor) = results
    assert plain["actor/grad_norm"] > 0.5  # clipping active: the norm itself is compared
    assert cached["actor/grad_norm"] == plain["actor/grad_norm"] and cached["actor/pg_loss"] == plain["actor/pg_loss"]
    changed = [name for name in plain_weights if not torch.equal(plain_weights[name], cached_weights[name])]
    assert changed == []
    # the update's 8 forwards found every input encoded by the old-log-prob pass
    assert len(actor.vision.cache.entries) == DISTINCT_INPUTS
    tower = {n: t for n, t in plain_weights.items() if ".visual." in f".{n}"}
    assert tower and all(torch.equal(t, cached_weights[n]) for n, t in tower.items())  # frozen


def test_each_image_is_encoded_alone(tiny_model_path):
    # three images in one forward: each entry is the tower's output for that image by itself
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_model_path, attn_implementation="sdpa").eval()
    model.requires_grad_(False)
    grid = torch.tensor([[1, 4, 4], [1, 8, 4], [1, 4, 4]])
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(0))
    cache = VisionEmbeddingCache(16)
    out = encode_pending(model, PendingVision({"pixel_values": pixels, "image_grid_thw": grid}), cache, torch.device("cpu"))
    starts = [0, 16, 48, 64]
    for i, embeds in enumerate(out["image"].pooler_output):
        alone = model.get_image_features(pixels[starts[i]:starts[i + 1]], grid[i:i + 1], return_dict=True)
        assert torch.equal(embeds, alone.pooler_output[0])
        assert embeds.shape == (int(grid[i].prod()) // 4, model.config.text_config.hidden_size)  # 2 x 2 merge
    assert cache.take_counts() == (0, 3)


def test_keys_follow_the_pixels_and_the_grid():
    gen = torch.Generator().manual_seed(0)
    pixels = torch.randn(32, 8, generator=gen)
    one, two = pixel_keys(pixels, torch.tensor([[1, 4, 4], [1, 4, 4]]))
    assert one != two  # other pixels
    assert pixel_keys(pixels[16:], torch.tensor([[1, 4, 4]])) == [two]  # same pixels, same key
    assert pixel_keys(pixels[:16], torch.tensor([[1, 2, 8]])) != [one]  # same bytes, another grid
    changed = pixels[:16].clone()
    changed[5, 3] = torch.nextafter(changed[5, 3], torch.tensor(1e9))  # one value, one ulp
    assert pixel_keys(changed, torch.tensor([[1, 4, 4]])) != [one]
    assert pixel_keys(pixels[:16].bfloat16(), torch.tensor([[1, 4, 4]])) != [one]  # another dtype
    assert pixel_keys(pixels[:16], torch.tensor([[1, 4, 4]]), "video") != [one]  # another encoder


def test_least_recently_used_entries_leave_beyond_the_budget():
    cache = VisionEmbeddingCache(1)  # 1 MiB
    entry = lambda: Encoded(torch.zeros(MiB // 4 // 3 + 1))  # noqa: E731 - a third of a MiB (+ 4 bytes)
    for key in (b"a", b"b"):
        cache.put(key, entry())
    assert cache.get(b"a") is not None  # a is now the most recent
    cache.put(b"c", entry())  # a, b, c: over the budget by 12 bytes: b leaves
    assert list(cache.entries) == [b"a", b"c"] and cache.nbytes == 2 * entry().nbytes
    assert cache.get(b"b") is None and cache.take_counts() == (1, 1)
    cache.put(b"big", Encoded(torch.zeros(MiB)))  # larger than the budget: everything leaves, itself too
    assert list(cache.entries) == [] and cache.nbytes == 0


def test_a_tower_that_trains_is_refused(tiny_model_path):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_model_path)
    with pytest.raises(ValueError, match="frozen vision tower"):
        install_vision_cache(model, VisionEmbeddingCache(1), torch.device("cpu"))
    # the config check refuses a budget without freeze_vision_tower: tests/config/test_validate.py RULES


def test_the_default_budget_follows_the_frozen_tower(tiny_model_path):
    from plan_testing import plan_for

    frozen = plan_for(tiny_model_path, "worker.actor.model.freeze_vision_tower=true")
    assert frozen.actor.forward.vision_cache_mb == frozen.ref.forward.vision_cache_mb == 1024
    assert plan_for(tiny_model_path).actor.forward.vision_cache_mb == 0
    assert plan_for(tiny_model_path, "worker.actor.model.freeze_vision_tower=true",
                    "worker.actor.vision_cache_mb=0").actor.forward.vision_cache_mb == 0


def test_the_reference_reuses_the_actors_entries(process_group, tiny_model_path):
    from plan_testing import plan_for

    from easyvlm.workers.hybrid import HybridWorker
    from easyvlm.workers.ref import RefWorker

    batch = make_rl_batch(tiny_model_path, PROMPTS, RESPONSE_LENGTHS)
    overrides = ["worker.actor.model.freeze_vision_tower=true", "worker.actor.micro_batch_size_per_device_for_experience=1",
                 "worker.actor.dynamic_batching=false", "algorithm.use_kl_loss=true"]
    plan = plan_for(tiny_model_path, *overrides)
    hybrid = HybridWorker(plan.actor, plan.ref, rollout=None)
    assert hybrid.ref.setup.vision_cache is hybrid.actor.vision.cache
    hybrid.compute_logprobs(batch)
    hybrid.actor.vision.cache.take_counts()
    shared = hybrid.compute_ref_logprobs(batch)["ref_logprobs"]
    assert hybrid.actor.vision.cache.take_counts() == (16, 0)  # 8 forwards x (image + video), none encoded
    plain = RefWorker(plan_for(tiny_model_path, *overrides, "worker.actor.vision_cache_mb=0").ref, rank=0, world_size=1)
    assert torch.equal(shared, plain.compute_ref_logprobs(batch)["ref_logprobs"])

    # a tower that differs by one value, or computes in another dtype, is not the actor's
    assert same_frozen_tower(hybrid.actor.model, None, hybrid.ref.model, None)
    assert not same_frozen_tower(hybrid.actor.model, None, hybrid.ref.model, torch.bfloat16)
    with torch.no_grad():
        weight = next(hybrid.ref.model.model.visual.parameters())
        weight.to_local().view(-1)[0] += 1e-3
    assert not same_frozen_tower(hybrid.actor.model, None, hybrid.ref.model, None)
