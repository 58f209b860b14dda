"""Planted cheat (speed, the rule on the engine's kernel): its names built at run time, so no import or string in
the source names it; the watch on the calls sees its Python code run (teaching/submission_rules.py)."""

from __future__ import annotations

import importlib

import torch

_k = importlib.import_module("minivllm." + "kern" + "els.sk" + "inny_gemm")
getattr(importlib.import_module("minivllm." + "kern" + "els.cpu_build"), "load_cpu_" + "ker" + "nels")()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return getattr(_k, "pack_" + "sk" + "inny_weight")(weight)


def few_row_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return getattr(_k, "sk" + "inny_gemm")(x, packed, out_features)
