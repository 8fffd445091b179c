"""The run plan: what the driver resolves once from a validated config, sliced per consumer.

``build.py`` builds a `RunPlan` from a `PPOConfig` in the driver: the model's files loaded once
(``models.py``), each role's slice (``roles.py``; the slices live with their consumers, in the
``specs`` modules of ``models``, ``rollout``, ``agents``, ``rewards`` and ``workers``), the
driver's own (``driver.py``, its slice in ``specs.py``) and the checks that need the model or the
device (``checks.py``). Workers receive their slice, and their components their own settings
objects, and never read the config.
"""
