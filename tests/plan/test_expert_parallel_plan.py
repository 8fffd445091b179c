"""The expert keys reach the roles' plan slices: ``worker.actor.expert_parallel_size`` (the reference
model and an MoE teacher follow it), ``worker.critic.expert_parallel_size``, and
``model.experts_implementation`` of the actor and the critic; refusals that need the model files."""

from __future__ import annotations

import pytest
from plan_testing import plan_for

from easyvlm.config.errors import ConfigError

TWO_RANKS = ("trainer.n_gpus_per_node=2",)
GAE = ("algorithm.adv_estimator=gae",)


@pytest.fixture(scope="module")
def moe_model(easyvlm_cache_dir) -> str:
    from easyvlm.builtin.models import materialize_model

    return str(materialize_model("tiny-qwen3-vl-moe", cache_dir=easyvlm_cache_dir))


def test_expert_keys_reach_every_role(moe_model):
    default = plan_for(moe_model, *TWO_RANKS, *GAE)
    assert default.actor.forward.settings.expert_parallel_size == default.critic.forward.settings.expert_parallel_size == 1
    assert default.actor.model.experts_implementation is None
    plan = plan_for(moe_model, *TWO_RANKS, *GAE, "worker.actor.expert_parallel_size=2",
                    "worker.critic.expert_parallel_size=2", "worker.actor.model.experts_implementation=grouped_mm",
                    "worker.critic.model.experts_implementation=grouped_mm", "worker.teacher.enable=true",
                    f"worker.teacher.model.model_path={moe_model}", "algorithm.distill_coef=0.5")
    # the reference model and the (MoE) teacher run the actor's forward settings, expert parallelism included
    assert plan.actor.forward.settings.expert_parallel_size == plan.ref.forward.settings.expert_parallel_size == 2
    assert plan.teacher.forward.settings.expert_parallel_size == 2
    assert plan.critic.forward.settings.expert_parallel_size == 2
    assert plan.actor.model.experts_implementation == plan.ref.model.experts_implementation == "grouped_mm"
    assert plan.critic.model.experts_implementation == "grouped_mm"
    eager = plan_for(moe_model, *GAE, "worker.actor.model.experts_implementation=eager",
                     "worker.critic.model.experts_implementation=eager")
    assert eager.actor.model.experts_implementation == eager.critic.model.experts_implementation == "eager"


def test_the_critics_expert_count_is_checked_before_start(moe_model):
    """tiny-qwen3-vl-moe has 4 experts per layer: 8 ranks cannot split them."""
    with pytest.raises(ConfigError) as err:
        plan_for(moe_model, *GAE, "trainer.n_gpus_per_node=8", "worker.critic.expert_parallel_size=8",
                 "data.rollout_batch_size=8", "worker.actor.global_batch_size=8", "worker.critic.global_batch_size=8",
                 "worker.actor.micro_batch_size_per_device_for_update=1", "worker.critic.micro_batch_size_per_device_for_update=1")
    assert [(p.key, p.message) for p in err.value.problems] == [(
        "worker.critic.expert_parallel_size",
        "(8) must divide the 4 experts of each MoE layer of 'qwen3_vl_moe' (each rank holds an equal share)")]
