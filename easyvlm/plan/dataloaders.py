"""The run plan's prompt loaders: its ``data`` section read with the policy's tokenizer and processor."""

from __future__ import annotations

from easyvlm.data.dataloader import PromptDataLoader, create_dataloaders
from easyvlm.plan.build import RunPlan


def plan_dataloaders(plan: RunPlan) -> tuple[PromptDataLoader, PromptDataLoader | None]:
    """The training loader and the validation loader (None without ``data.val_files``)."""
    bundle = plan.bundle
    return create_dataloaders(
        plan.data, bundle.tokenizer, bundle.processor, bundle.policy.hf_config,
        plan.driver.rounds.prompts_per_round, plan.agent.tool_schemas if plan.agent is not None else (),
    )
