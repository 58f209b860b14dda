"""Start-up: pick device and dtype, build the model from a checkpoint folder, size the KV pool.

Defaults: device "auto" is CUDA when available, else CPU. dtype "auto" is the checkpoint's dtype on
CUDA (bfloat16 if it names none) and float32 on CPU, where half-precision matmuls are slow.
"""

from __future__ import annotations

from pathlib import Path

import torch

from minivllm.config import EngineConfig
from minivllm.models import MODEL_REGISTRY
from minivllm.models.hf_config import ModelSpec
from minivllm.models.loader import load_weights

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={config.device!r} but CUDA is not available; use device='cpu'")
    return device


def resolve_dtype(config: EngineConfig, spec: ModelSpec, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return _TORCH_DTYPES[config.dtype]
    if device.type == "cpu":
        return torch.float32
    return _TORCH_DTYPES.get(str(spec.dtype).removeprefix("torch."), torch.bfloat16)


def build_model(spec: ModelSpec, model_dir: str | Path, device: torch.device, dtype: torch.dtype,
                max_position: int) -> torch.nn.Module:
    """Create the model without initialising weights (meta device), then fill it from disk."""
    with torch.device("meta"):
        model = MODEL_REGISTRY[spec.architecture](spec)
    model = model.to_empty(device=device).to(dtype)
    load_weights(model, spec, model_dir)
    model.init_rotary(max_position, device)
    return model.eval()
