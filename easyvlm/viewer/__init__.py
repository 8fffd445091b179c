"""The rollout viewer: what the policy sampled, next to its images, as static HTML pages.

``records`` captures a step's rollouts and turns them into ``RolloutSample`` rows; ``pages``
writes the JSONL and HTML files; ``writer`` does it in a background thread of the driver, off the
training step's path.
"""
