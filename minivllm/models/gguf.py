"""GGUF checkpoints (llama.cpp's format), converted once into a folder the engine loads quickly.

    file.gguf ──(transformers + gguf: dequantize, undo llama.cpp's Q/K row permutation)──> HF model
              ──(safetensors, config.json, tokenizer files)──> cache folder ──> the normal loader

llama.cpp stores Llama's q_proj/k_proj rows permuted for its own RoPE kernel; transformers' GGUF
reader reverses that while dequantizing, so what we save is an ordinary HF checkpoint. The folder is
keyed by the GGUF file's path, size and modification time (and `_FORMAT`), so an edited file is
converted again.

The weights are saved dequantized in fp32 (exact: a Q4_1 weight is d * q + m with fp16 d and m), but
config.json names the precision the file holds (`source_dtype`): float32 for an F32 file, float16 for
F16, bfloat16 for BF16 and for every quantized type. A quantized weight carries at most 8.5 bits, far
less than bf16's rounding keeps, so a 16-bit engine loses nothing the file had, and dtype "auto" can
run the default model (SmolLM2, released in bf16, shipped as Q4_1) in bf16 where the CPU computes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

_DONE = "minivllm-converted.json"
_FORMAT = 2  # bumped when the converted folder changes: 2 = config.json names the GGUF's source dtype


def converted_dir_for(gguf_path: Path, cache_root: Path) -> Path:
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{_FORMAT}".encode()).hexdigest()[:16]
    return cache_root / "models" / f"{gguf_path.stem}-{key}"


def convert_gguf(gguf_path: str | Path, cache_root: Path, *, verbose: bool = True) -> Path:
    """Return a safetensors folder for `gguf_path`, converting it the first time."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    out = converted_dir_for(gguf_path, cache_root)
    if (out / _DONE).is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if verbose:
        print(f"minivllm: converting {gguf_path.name} to safetensors (once) into {out} "
              "(the cache; delete the folder to clear it)", file=sys.stderr, flush=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        folder, name = str(gguf_path.parent), gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]
        config.pop("torch_dtype", None)
        config["dtype"] = source_dtype(gguf_path)
        state = {k: v.contiguous() for k, v in model.state_dict().items()
                 if not (k == "lm_head.weight" and config.get("tie_word_embeddings"))}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _DONE).write_text(json.dumps({"source": str(gguf_path.resolve())}))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def source_dtype(gguf_path: Path) -> str:
    """The precision the GGUF file holds, as a config.json dtype (see the module docstring)."""
    from gguf import GGUFReader, LlamaFileType

    field = GGUFReader(gguf_path).fields.get("general.file_type")
    if field is None:  # not recorded: claim no less precision than fp32
        return "float32"
    file_type = int(field.contents())
    return {LlamaFileType.ALL_F32: "float32", LlamaFileType.MOSTLY_F16: "float16"}.get(file_type, "bfloat16")
