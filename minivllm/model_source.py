"""Where the weights come from: `resolve_model(model)` turns what the user typed into a local folder.

  None                       the default model, SmolLM2-135M-Instruct (see `default_model.py`)
  path/to/folder             a Hugging Face checkpoint folder, used as is
  path/to/file.gguf          converted once into the cache (see `models/gguf.py`)
  org/name                   a Hugging Face hub id, downloaded through `huggingface_hub` when online

The cache lives in $MINIVLLM_CACHE, else ~/.cache/minivllm (see `model_cache.py`); delete that folder
to clear it. Every failure is a `ModelUnavailableError`, re-exported here beside `resolve_model`, which
raises it.
"""

from __future__ import annotations

import os
from pathlib import Path

from minivllm.model_cache import ModelUnavailableError, cache_root

__all__ = ["ModelUnavailableError", "resolve_model"]


def resolve_model(model: str | None, *, verbose: bool = True) -> str:
    if model is None:
        # Imported here, not at the top: the default model's code is needed only when no model is given.
        from minivllm.default_model import default_model_dir

        return str(default_model_dir(verbose=verbose))
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        from minivllm.models.gguf import convert_gguf

        return str(convert_gguf(path, cache_root(), verbose=verbose))
    if path.is_dir() or path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        return str(path)  # a local path (a missing one is reported by the engine)
    return _from_hub(model)


def _from_hub(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"])
    except Exception as e:  # offline, unknown repo, gated model ...
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        raise ModelUnavailableError(
            f"cannot fetch {repo_id!r} from the Hugging Face hub"
            f"{' (HF_HUB_OFFLINE=1 is set)' if offline else ''}: {type(e).__name__}. "
            "Pass a local checkpoint folder or a .gguf file, or connect and retry.") from e
