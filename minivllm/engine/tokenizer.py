"""The engine's tokenizer: transformers' `AutoTokenizer`, with the class it picks remembered.

`AutoTokenizer.from_pretrained(folder)` first decides which tokenizer class the checkpoint needs, and
to decide it loads the model's configuration class through `AutoConfig` (model_type, the tokenizer
class the config names). On transformers 5 that import pulls in transformers' model-loading stack
(torch.distributed.tensor, sympy): ~1.8 s of a ~2 s load on 2 cores, for a choice that is the same
every time for the same files. So the first load asks `AutoTokenizer`, then writes down the class it
chose; later loads call that class's `from_pretrained` directly, which is what `AutoTokenizer` itself
ends by doing (the same files, the same arguments), so the tokenizer is the same object either way.

    $MINIVLLM_CACHE/tuning/tokenizers/<digest>.json     {"module": ..., "qualname": ...}

(beside the tuner's choices, cpu/tuning_cache.py: what a start remembers so the next one is
quicker; MINIVLLM_TUNING_CACHE moves both, as the tests do)

The digest covers everything the choice reads: the folder's path (AutoTokenizer matches it against
model-id patterns), the bytes of config.json, tokenizer_config.json and tokenizer.json, and
transformers' version. Change any of them and the next load asks `AutoTokenizer` again. Only
transformers' own classes are remembered (never a checkpoint's custom code), and a note that cannot
be read is ignored (and rewritten).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import tempfile
from pathlib import Path

import transformers
from transformers import PreTrainedTokenizerBase

from minivllm.cpu.tuning_cache import tuning_folder

CHOICE_INPUTS = ("config.json", "tokenizer_config.json", "tokenizer.json")  # what AutoTokenizer reads to choose
log = logging.getLogger("minivllm")


def get_tokenizer(source: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer `AutoTokenizer.from_pretrained(source)` returns, loaded without its class lookup when
    this folder's choice is remembered. A `source` that is not a local folder goes to AutoTokenizer as is."""
    folder = Path(source)
    if not folder.is_dir():
        return _auto_tokenizer(source)
    note = tuning_folder() / "tokenizers" / f"{_choice_key(folder)}.json"
    remembered = _remembered_class(note)
    if remembered is not None:
        return remembered.from_pretrained(str(folder))
    tokenizer = _auto_tokenizer(str(folder))
    cls = type(tokenizer)
    if cls.__module__.startswith("transformers."):  # never a checkpoint's own (remote) code
        _write_atomically(note, {"module": cls.__module__, "qualname": cls.__qualname__})
    return tokenizer


def _auto_tokenizer(source: str | Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer  # imported only when needed: ~0.4 s on 2 cores

    return AutoTokenizer.from_pretrained(source)


def _choice_key(folder: Path) -> str:
    digest = hashlib.sha256(f"{folder.resolve()}|transformers {transformers.__version__}".encode())
    for name in CHOICE_INPUTS:
        path = folder / name
        digest.update(f"|{name}:".encode() + (path.read_bytes() if path.is_file() else b"<absent>"))
    return digest.hexdigest()[:24]


def _remembered_class(note: Path) -> type[PreTrainedTokenizerBase] | None:
    try:
        found = json.loads(note.read_text())
        module, qualname = found["module"], found["qualname"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as error:
        log.warning("ignoring the unreadable tokenizer note %s (%s); asking AutoTokenizer", note, error)
        return None
    if not (isinstance(module, str) and module.startswith("transformers.")):
        log.warning("ignoring the tokenizer note %s: %r is not a transformers module", note, module)
        return None
    try:
        cls = getattr(importlib.import_module(module), qualname)
    except (ImportError, AttributeError):  # a transformers that no longer has it: ask again
        return None
    return cls if isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase) else None


def _write_atomically(note: Path, content: dict[str, str]) -> None:
    """Write to a temporary file beside `note`, then move it into place: a reader sees all of it or none.
    A cache folder that cannot be written costs the next start its 2 s, nothing else."""
    try:
        note.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=note.parent, suffix=".tmp", delete=False) as f:
            json.dump(content, f)
        os.replace(f.name, note)
    except OSError as error:
        log.warning("could not write the tokenizer note %s (%s)", note, error)
