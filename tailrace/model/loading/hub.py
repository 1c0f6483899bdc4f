"""Where a model comes from: a local directory, a GGUF file, or a Hugging Face hub id.

A hub id resolves to its snapshot directory in the local hub cache (huggingface_hub honours
HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE); when the cache lacks it, it is downloaded as `vllm serve`
does. Everything after this module sees a local path.
"""

from __future__ import annotations

import os

# What serving needs from a hub repository: weights, configs, tokenizer, chat template.
_DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.jinja"]


def is_gguf(path: str) -> bool:
    return path.endswith(".gguf") and os.path.isfile(path)


def resolve_model(model: str, revision: str | None = None, cache_dir: str | None = None) -> str:
    """The local directory or GGUF file for `model`: a path as it is, else a hub id through the
    cache first and the network second; ValueError naming the id and the cache when neither has it."""
    if is_gguf(model):
        return model
    if os.path.isdir(model):
        return _model_directory(model, model)
    if os.path.exists(model) or not _looks_like_hub_id(model):
        raise ValueError(f"model not found: {model} is neither a model directory, a .gguf file nor a "
                         "Hugging Face model id (ORG/NAME)")
    return _model_directory(_snapshot(model, revision, cache_dir), model)


def served_name(model: str) -> str:
    """The name clients send by default: a hub id as given (as vLLM does), else the directory's or
    file's name."""
    if not os.path.exists(model) and _looks_like_hub_id(model):
        return model
    return os.path.basename(os.path.normpath(model))


def _model_directory(path: str, model: str) -> str:
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    ggufs = sorted(name for name in os.listdir(path) if name.endswith(".gguf"))
    hint = f"; serve one of its GGUF files by its path: {', '.join(ggufs)}" if ggufs else ""
    raise ValueError(f"model {model}: {path} has no config.json, so it is no Hugging Face model directory{hint}")


def _looks_like_hub_id(model: str) -> bool:
    parts = model.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not model.startswith((".", "~")) and not model.endswith(".gguf")


def _snapshot(repo_id: str, revision: str | None, cache_dir: str | None) -> str:
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = cache_dir or constants.HF_HUB_CACHE
    try:
        return huggingface_hub.snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                                 local_files_only=True)
    except HFValidationError as exc:
        raise ValueError(f"model {repo_id!r} is not a valid Hugging Face model id: {exc}") from exc
    except LocalEntryNotFoundError:
        pass
    shown = repo_id + (f" at revision {revision}" if revision else "")
    if constants.HF_HUB_OFFLINE:
        raise ValueError(f"model {shown} is not in the Hugging Face cache {cache}, and HF_HUB_OFFLINE is set")
    try:
        return huggingface_hub.snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                                 allow_patterns=_DOWNLOAD_PATTERNS)
    except Exception as exc:  # network, auth, missing repo or revision: all end the same way for the user
        raise ValueError(f"model {shown} is not in the Hugging Face cache {cache}, and downloading it "
                         f"failed: {exc}") from exc
