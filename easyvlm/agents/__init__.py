"""Multi-turn rollouts with tools and environments (docs/agents.md)."""
