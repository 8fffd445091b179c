"""The run plan: what the driver resolves once from a validated config, sliced per consumer.

``specs.py`` holds the typed slices (plain frozen dataclasses, no torch); ``build.py`` builds a
`RunPlan` from a `PPOConfig` in the driver (resolving paths, loading the model's config, tokenizer
and processor once). Workers receive their slice and never read the config.
"""
