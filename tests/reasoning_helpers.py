"""A tiny thinking Qwen3 for the reasoning-parser tests: the tiny random Qwen3's weights, a tokenizer whose
last two ids are <think> and </think> (added tokens, not special, as Qwen3's own), and a Qwen3-style chat
template (enable_thinking=False writes an empty "<think>\n\n</think>\n\n" into the prompt)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken

from minivllm.teaching.checkpoints import make_tiny_model, make_tokenizer

QWEN3_THINKING_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def make_thinking_qwen3(path: str | Path, vocab_size: int = 384) -> tuple[str, int, int]:
    """(model folder, <think> id, </think> id)."""
    path = make_tiny_model(path, "qwen3", vocab_size=vocab_size)
    tok = make_tokenizer(vocab_size - 2)
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                    AddedToken("</think>", special=False, normalized=False)])
    tok.chat_template = QWEN3_THINKING_TEMPLATE
    assert len(tok) == vocab_size
    tok.save_pretrained(path)
    start, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    return str(path), start, end
