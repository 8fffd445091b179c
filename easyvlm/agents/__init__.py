"""Multi-turn rollouts with tools and environments (docs/agents.md).

- ``tools``: Python functions as tools (schemas, reserved parameters, calls with a time limit);
- ``shipped``: the tools easyvlm ships (``image_zoom``, ``calculator``);
- ``parse``: the model's tool calls in its template's format;
- ``render``: tool results and observations as chat-template tokens (images included);
- ``environment``: stateful environments (``reset`` / ``step``);
- ``gui``: a GUI-style environment drawn with Pillow (numbered widgets, ``click(N)`` / ``click(X, Y)``);
- ``loop``: the multi-turn generation around any rollout engine, and its metrics;
- ``settings``: the multi-turn settings (``worker.rollout.tools`` ... ``tool_timeout``) and the
  shipped tools' names, torch-free for the config check;
- ``specs``: the run plan's slice (``AgentSpec``: the settings and the tools' schemas);
- ``setup``: the run plan's slice made into a ``MultiTurnRollout`` in the driver.
"""
