"""Where a model's files are: a local directory, a hub id ``org/name`` or a registered scheme. The driver resolves
(and may build or download, :func:`resolve_model_path`); workers only find it on their machine (:func:`local_model_dir`)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable

from easyvlm.utils.cache import same_entry_here


class ModelNotFoundError(FileNotFoundError):
    """A model path that names no loadable model; the message says what was asked and what to do."""


@dataclass(frozen=True)
class ModelScheme:
    """A family of model names the project builds itself (``builtin:``)."""

    build: Callable[[str], str]
    """name (after the prefix) -> its directory, built into this machine's cache on first use."""
    known_names: Callable[[], str]


_SCHEMES: dict[str, ModelScheme] = {}
_SCHEME_RE = re.compile(r"^[a-z][a-z0-9_-]*:")


def register_model_scheme(prefix: str, scheme: ModelScheme) -> None:
    """Let ``resolve_model_path`` build names that start with ``prefix`` (e.g. ``builtin:``)."""
    assert _SCHEME_RE.match(prefix) and prefix.endswith(":"), prefix
    _SCHEMES[prefix] = scheme


def _scheme_of(path: str) -> str | None:
    match = _SCHEME_RE.match(path)
    return match.group(0) if match else None


def _known_models_hint() -> str:
    return "; ".join(scheme.known_names() for scheme in _SCHEMES.values())


def resolve_model_path(path: str) -> str:
    """A local directory for a registered scheme's name, a local directory, or a hub id ``org/name``
    (``snapshot_download``; the local cache first when ``HF_HUB_OFFLINE=1``). Raises
    ModelNotFoundError when it names nothing loadable or the hub is unreachable."""
    scheme = _scheme_of(path)
    if scheme is not None:
        if scheme not in _SCHEMES:
            raise ModelNotFoundError(f"model path {path!r}: no model scheme {scheme!r} is known; {_known_models_hint()}")
        return str(_SCHEMES[scheme].build(path[len(scheme) :]))
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        return expanded
    looks_local = path.startswith((".", "/", "~")) or os.path.exists(expanded) or path.count("/") != 1
    if looks_local:
        raise ModelNotFoundError(
            f"model path {path!r} is not a directory. Pass a local model directory (with config.json), "
            f"a hub id 'org/name', or a built-in model; {_known_models_hint()}"
        )
    return _download_from_hub(path)


def local_model_dir(planned_dir: str, model_path: str = "") -> str:
    """This machine's directory of a model the driver resolved to ``planned_dir`` from ``model_path``
    ("" = unknown): ``planned_dir`` when it exists here, else this node's builtin or Hugging Face
    cache. Raises ModelNotFoundError for a local directory missing here (use shared storage)."""
    if not model_path or os.path.isdir(planned_dir):
        return planned_dir
    import socket

    if _scheme_of(model_path) is not None:
        here = same_entry_here(planned_dir)
        if here.is_dir():
            return str(here)
        raise ModelNotFoundError(
            f"{model_path} is not built on this node ({socket.gethostname()}): looked for {here}. The driver "
            f"builds it on every node of the cluster before the workers start; to build it by hand, run "
            f"`python -m easyvlm.builtin.models {model_path.split(':', 1)[1]}` on this node with the same "
            f"EASYVLM_CACHE as its `ray start`"
        )
    if not os.path.isabs(model_path):  # a hub id
        return resolve_model_path(model_path)
    raise ModelNotFoundError(
        f"model directory {model_path} (a local path in the config) does not exist on this node "
        f"({socket.gethostname()}). Every node of a Ray cluster reads the model from its own file system: put "
        f"local model directories on storage that every node mounts at the same path (or copy them to that "
        f"path on every node), or name the model by a hub id or builtin: name, which each node resolves itself"
    )


def _download_from_hub(repo_id: str) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )

    try:
        # Weights in safetensors only: downloading .bin/.pth copies as well would double the size.
        return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model"])
    except (GatedRepoError, RepositoryNotFoundError) as err:
        raise ModelNotFoundError(
            f"model {repo_id!r}: the hub has no repository by that name or it is gated ({type(err).__name__}). "
            f"Check the spelling, log in with `huggingface-cli login` for gated models, or pass a local "
            f"directory; {_known_models_hint()}"
        ) from err
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, HfHubHTTPError, OSError) as err:
        if constants.HF_HUB_OFFLINE:
            reason, fix = "HF_HUB_OFFLINE is set", "unset HF_HUB_OFFLINE if this machine has network access"
        else:
            reason, fix = "the Hugging Face hub is unreachable", "download it on a machine with network access"
        raise ModelNotFoundError(
            f"model {repo_id!r} is not in the local Hugging Face cache and {reason}, so it cannot be "
            f"downloaded. Fix: {fix}, pass a local model directory, or use a built-in model; "
            f"{_known_models_hint()}"
        ) from err
