"""The rollout viewer: what the policy sampled, next to its images, as static HTML pages
(docs/viewer.md): ``records`` captures, ``pages`` writes, ``writer`` runs in the background."""
