"""Cheat (attention): a class built at run time on the engine's own backend: its MRO names it."""

from __future__ import annotations

import importlib

_base = getattr(importlib.import_module("minivllm.layers." + "torch_" + "attention"), "Torch" + "AttentionBackend")
Built = type("Built", (_base,), {"name": "cheat", "__module__": __name__})
