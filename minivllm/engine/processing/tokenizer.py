"""The engine's tokenizer: transformers' `AutoTokenizer`, with the class it picks remembered.

`AutoTokenizer.from_pretrained(folder)` first decides which tokenizer class the checkpoint needs, and
to decide it loads the model's configuration class through `AutoConfig` (model_type, the tokenizer
class the config names). On transformers 5 that import pulls in transformers' model-loading stack
(torch.distributed.tensor, sympy): ~1.8 s of a ~2 s load on 2 cores, for a choice that is the same
every time for the same files. So the first load asks `AutoTokenizer`, then writes down the class it
chose; later loads call that class's `from_pretrained` directly, which is what `AutoTokenizer` itself
ends by doing (the same files, the same arguments), so the tokenizer is the same object either way.

    $MINIVLLM_CACHE/tuning/tokenizers/<digest>.json
        {"module": ..., "qualname": ...}                 the class AutoTokenizer chose,
         "added_tokens_decoder": {id: {"content": ...}}  for some folders the added tokens (below)

The note also keeps the added tokens of a folder whose tokenizer_config.json does not list them (what
transformers 5's own `save_pretrained` writes, the default model's converted folder included): without
them the class's `from_pretrained` parses the whole tokenizer.json (3.5 MB for SmolLM2) in Python to read
that list, before the Rust tokenizer parses it again, ~35 % of a load. Passed back as `added_tokens_decoder`,
tokenizer_config.json's own field, they take transformers' ordinary path. They are kept only where that is
the same tokenizer: no special_tokens_map.json or added_tokens.json (which the other path reads too), and
the list as read from tokenizer.json equal, field by field, to what the loaded tokenizer reports.

(beside the tuner's choices, cpu/tuning_cache.py: what a start remembers so the next one is
quicker; MINIVLLM_TUNING_CACHE moves both, as the tests do)

The digest covers everything the note's contents depend on: the folder's path (AutoTokenizer matches it
against model-id patterns), the bytes (or absence) of config.json, tokenizer_config.json, tokenizer.json,
special_tokens_map.json and added_tokens.json, and transformers' version. Change any of them and the next
load asks `AutoTokenizer` again. Only transformers' own classes are remembered (never a checkpoint's
custom code), and a note that cannot be read is ignored (and rewritten).
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

LEGACY_INPUTS = ("special_tokens_map.json", "added_tokens.json")  # read when tokenizer_config lists no added tokens
CHOICE_INPUTS = ("config.json", "tokenizer_config.json", "tokenizer.json", *LEGACY_INPUTS)  # what the note depends on
ADDED_TOKEN_FIELDS = {"content": str, "single_word": bool, "lstrip": bool, "rstrip": bool, "normalized": bool,
                      "special": bool}  # tokenizers' AddedToken, as tokenizer.json and tokenizer_config.json write it
AddedTokens = dict[str, dict[str, str | bool]]  # token id (a JSON key) -> ADDED_TOKEN_FIELDS
log = logging.getLogger("minivllm")


def get_tokenizer(source: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer `AutoTokenizer.from_pretrained(source)` returns, loaded without its class lookup when
    this folder's choice is remembered. A `source` that is not a local folder goes to AutoTokenizer as is."""
    folder = Path(source)
    if not folder.is_dir():
        return _auto_tokenizer(source)
    note = tuning_folder() / "tokenizers" / f"{_choice_key(folder)}.json"
    remembered = _remembered(note)
    if remembered is not None:
        cls, added = remembered
        return cls.from_pretrained(str(folder), **({} if added is None else {"added_tokens_decoder": added}))
    tokenizer = _auto_tokenizer(str(folder))
    cls = type(tokenizer)
    if cls.__module__.startswith("transformers."):  # never a checkpoint's own (remote) code
        content: dict[str, object] = {"module": cls.__module__, "qualname": cls.__qualname__}
        added = _unlisted_added_tokens(folder, tokenizer)
        if added is not None:
            content["added_tokens_decoder"] = added
        _write_atomically(note, content)
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


def _unlisted_added_tokens(folder: Path, tokenizer: PreTrainedTokenizerBase) -> AddedTokens | None:
    """tokenizer.json's added tokens, where tokenizer_config.json does not list them and passing them back
    gives the same tokenizer (see the module docstring); else None. Read once, when the note is written."""
    try:
        if any((folder / name).exists() for name in LEGACY_INPUTS):
            return None
        if "added_tokens_decoder" in json.loads((folder / "tokenizer_config.json").read_text()):
            return None  # listed already: transformers reads them from there
        listed = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
        added = {str(t["id"]): {k: t[k] for k in ADDED_TOKEN_FIELDS} for t in listed}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    loaded = {str(i): {k: getattr(t, k) for k in ADDED_TOKEN_FIELDS}
              for i, t in tokenizer.added_tokens_decoder.items()}
    return added if added == loaded and _valid_added_tokens(added) else None


def _valid_added_tokens(added: object) -> bool:
    return isinstance(added, dict) and all(
        isinstance(i, str) and i.isdigit() and isinstance(t, dict) and t.keys() == ADDED_TOKEN_FIELDS.keys()
        and all(isinstance(t[k], kind) for k, kind in ADDED_TOKEN_FIELDS.items()) for i, t in added.items())


def _remembered(note: Path) -> tuple[type[PreTrainedTokenizerBase], AddedTokens | None] | None:
    """The class (and added tokens, if kept) a note names; None if there is no usable note."""
    try:
        found = json.loads(note.read_text())
        module, qualname, added = found["module"], found["qualname"], found.get("added_tokens_decoder")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        log.warning("ignoring the unreadable tokenizer note %s (%s); asking AutoTokenizer", note, error)
        return None
    if not (isinstance(module, str) and module.startswith("transformers.")):
        log.warning("ignoring the tokenizer note %s: %r is not a transformers module", note, module)
        return None
    if added is not None and not _valid_added_tokens(added):
        log.warning("ignoring the tokenizer note %s: its added tokens are malformed", note)
        return None
    try:
        cls = getattr(importlib.import_module(module), qualname)
    except (ImportError, AttributeError):  # a transformers that no longer has it: ask again
        return None
    return (cls, added) if isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase) else None


def _write_atomically(note: Path, content: dict[str, object]) -> None:
    """Write to a temporary file beside `note`, then move it into place: a reader sees all of it or none.
    A cache folder that cannot be written costs the next start its 2 s, nothing else."""
    try:
        note.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=note.parent, suffix=".tmp", delete=False) as f:
            json.dump(content, f)
        os.replace(f.name, note)
    except OSError as error:
        log.warning("could not write the tokenizer note %s (%s)", note, error)
