"""The engine's command-line flags, generated from `EngineConfig`'s fields (mini-sglang's args.py).

    EngineConfig.max_num_seqs: int = 128           -->  --max-num-seqs N          (default: 128)
    EngineConfig.enable_prefix_caching: bool        -->  --enable-prefix-caching / --no-enable-prefix-caching
    EngineConfig.max_model_len: int | None          -->  --max-model-len N         (an int; default None)
    EngineConfig.speculative_config: dict | None    -->  --speculative-config JSON
    EngineConfig.attention_backend: str | AttentionBackend  -->  --attention-backend NAME (an instance: Python only)
    EngineConfig.block_allocator: BlockAllocator | None     -->  --block-allocator, which refuses any value

Every field but `model` becomes a flag. A flag left out is not passed at all, so `EngineConfig`
applies its own default: defaults live in the dataclass only (--help reads them from there), and
the values are checked by `EngineConfig.__post_init__`, whose messages say what to change.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import json
import re
import types
import typing
from typing import Any

from minivllm.config import EngineConfig

# One line per field for --help. A field missing here is described by the comment above it in
# EngineConfig's source (max_admission_skips, max_logprobs, ...); tests/test_cli.py checks that
# every field has a description from one or the other.
HELP: dict[str, str] = {
    "dtype": "weights and activations: auto (the checkpoint's; on CPU bfloat16 for a 16-bit checkpoint where the "
             "CPU computes bf16 natively, else float32), float32, float16 or bfloat16",
    "quantization": "int8: the decoder's linear layers in int8 with per-token dynamic int8 activations (CPU only; "
                    "~4 % higher perplexity on SmolLM2); none by default",
    "device": "auto, cpu, cuda or cuda:N",
    "block_size": "tokens per KV-cache block",
    "max_num_seqs": "most sequences in one step's batch",
    "max_num_batched_tokens": "most tokens computed in one step (prefill chunks and decodes together)",
    "max_model_len": "longest prompt + output in tokens (None: the model's max_position_embeddings)",
    "num_kv_blocks": "KV-cache blocks in the pool (None: sized from --gpu-memory-utilization or "
                     "--cpu-kv-cache-bytes)",
    "enable_prefix_caching": "reuse the KV blocks of prompt prefixes already computed (hybrid models: with state "
                             "snapshots)",
    "state_cache_stride": "hybrid models' prefix caching: keep the linear-attention state every this many prompt "
                          "tokens (a multiple of block_size; None: from state_cache_bytes and max_model_len)",
    "state_cache_bytes": "hybrid models' prefix caching: memory for the state snapshots, in bytes",
    "enable_chunked_prefill": "split long prompts into chunks that share steps with decodes",
    "attention_backend": "auto, torch or triton (an AttentionBackend of your own: from Python, LLM(...))",
    "seed": "the engine's seed: a request without a seed gets one derived from it (reproducible runs)",
    "gpu_memory_utilization": "share of the GPU's free memory after the weights that goes to the KV cache "
                              "(less a tenth kept for activations)",
    "cpu_kv_cache_bytes": "the KV cache's size on CPU, in bytes",
    "speculative_config": "speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": 3}' "
                          "or '{\"model\": \"path/to/draft\", \"num_speculative_tokens\": 3}'",
    "compile_sizes": "token counts that get a compiled graph, comma-separated (e.g. 1,2,4,8); a step is padded up "
                     "to the next one, larger steps run eagerly",
    "scheduling_policy": "fcfs (first come, first served) or priority (a lower request `priority` first, "
                         "as in vLLM); a SchedulingPolicy of your own: from Python, LLM(...)",
    "sampling_filter": "a SamplingFilter object, so from Python only: LLM(model, sampling_filter=...); "
                       "None: top-k, top-p, min-p",
    "tuning": "the CPU kernels' choices: cached (measure once per machine, dtype and shapes, then reuse; in "
              "$MINIVLLM_CACHE/tuning), remeasure (time again and save) or off (fixed rules, nothing timed)",
    "reasoning_parser": "qwen3 or deepseek_r1: a thinking model's <think>...</think> is returned as "
                        "reasoning_content, apart from the content, and structured outputs apply after it (the "
                        "tokenizer must have <think> and </think>); none by default",
    "block_allocator": "a BlockAllocator object, so from Python only: LLM(model, block_allocator=...); "
                       "None: least recently freed first",
}
# Older spellings, still accepted (not shown in --help).
ALIASES = {"--no-prefix-caching": "enable_prefix_caching", "--no-chunked-prefill": "enable_chunked_prefill"}


def engine_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(EngineConfig) if f.name != "model"]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add a flag for every `EngineConfig` field (but `model`) to `parser`."""
    group = parser.add_argument_group("engine options (EngineConfig; see `minivllm.config`)")
    hints = typing.get_type_hints(EngineConfig)
    for f in engine_fields():
        flag = "--" + f.name.replace("_", "-")
        kind = _value_type(hints[f.name])
        text = f"{describe(f.name)} (default: {f.default})".replace("%", "%%")  # argparse formats help with %
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=text)
        else:  # a field that only takes an object (a class, not a name) gets a flag that says so when used
            parse = _PARSERS.get(kind) or functools.partial(_python_only, f.name, kind.__name__)
            group.add_argument(flag, type=parse, default=argparse.SUPPRESS, help=text,
                               metavar="JSON" if kind is dict else None)
    for alias, name in ALIASES.items():
        group.add_argument(alias, dest=name, action="store_false", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags given on the command line, as `EngineConfig` keyword arguments."""
    names = {f.name for f in engine_fields()}
    return {k: v for k, v in vars(args).items() if k in names}


def describe(name: str) -> str:
    """A field's --help line: HELP's, else the comment above the field in EngineConfig."""
    return HELP.get(name) or _field_comments().get(name, "")


@functools.cache
def _field_comments() -> dict[str, str]:
    try:
        source = inspect.getsource(EngineConfig)
    except OSError:  # no source shipped: HELP alone
        return {}
    comments, block = {}, []
    for line in source.splitlines():
        line = line.strip()
        if line.startswith("#"):
            block.append(line.lstrip("# "))
            continue
        field = re.match(r"(\w+): ", line)
        if field and block:
            comments[field.group(1)] = " ".join(block)
        block = []
    return comments


def _value_type(hint: Any) -> Any:
    """int for `int` and `int | None`; dict for `dict | None`; str for `str | AttentionBackend` (the
    first of a union); a class for `SamplingFilter | None` (an object: no parser, `_python_only`)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is typing.Literal:  # a few names (tuning): a string, checked by EngineConfig
        return str
    return typing.get_origin(hint) or hint


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object ({{...}}), got {text!r}")
    return value


def _int_tuple(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers (e.g. 1,2,4,8), got {text!r}") from None


def _python_only(name: str, kind: str, text: str) -> object:
    raise argparse.ArgumentTypeError(f"{name} takes a {kind} object, which a command line cannot give: create "
                                     f"the engine from Python, LLM(model, {name}=...)")


_PARSERS = {int: int, float: float, str: str, dict: _json_object, tuple: _int_tuple}
