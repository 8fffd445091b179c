"""The rollout service (``rollout_service``), its asynchronous producers (``producers``) and a step's
generation rounds with online filtering (``rounds``). Above ``pipeline``, below ``trainer``; docs/rollout.md."""
