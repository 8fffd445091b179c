"""Generate -> score -> capture: the one pipeline behind the trainer's validation and
``python -m easyvlm.eval``, so that what evaluation reports is what validation would.

- ``scoring``: a rollout batch into reward inputs (the reward model's scores and the judge's
  verdicts included) and the reward functions run on them, in a Ray actor or in this process;
- ``model_scorers``: the reward model's worker group and the judge's engines, started from the plan;
- ``generate_and_score``: prompt batches through an engine and the scorer into per-answer scores,
  generations, trajectories and rollout captures, and their ``val/`` metrics.
"""
