"""engine/tokenizer.py: the tokenizer class AutoTokenizer picks is remembered, and loading it directly gives
the same tokenizer (class, ids, chat template, decoding) without AutoTokenizer's ~2 s class lookup."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import transformers
from minivllm.engine import tokenizer as tokenizer_module
from minivllm.engine.tokenizer import get_tokenizer
from minivllm.cpu.tuning_cache import tuning_folder

TEXTS = ["Hello world", "  two  spaces and ünïcödé 🙂", "<|im_start|>user\nhi<|im_end|>", ""]


def _notes() -> list[Path]:
    return sorted((tuning_folder() / "tokenizers").glob("*.json"))


def _forbid_auto(monkeypatch) -> None:
    def refuse(source):
        raise AssertionError("AutoTokenizer was asked again")

    monkeypatch.setattr(tokenizer_module, "_auto_tokenizer", refuse)


def _same_tokenizer(a, b) -> None:
    assert type(a) is type(b)
    for text in TEXTS:
        assert a(text)["input_ids"] == b(text)["input_ids"]
        assert a(text, add_special_tokens=False)["input_ids"] == b(text, add_special_tokens=False)["input_ids"]
    ids = a(TEXTS[1] + TEXTS[2])["input_ids"]
    assert a.decode(ids, skip_special_tokens=True) == b.decode(ids, skip_special_tokens=True)
    assert (a.eos_token_id, a.bos_token_id, a.pad_token_id) == (b.eos_token_id, b.bos_token_id, b.pad_token_id)
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    assert (a.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == b.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


@pytest.mark.parametrize("variant", ["qwen3", "llama"])
def test_the_remembered_class_loads_the_same_tokenizer_as_auto(model_factory, monkeypatch, variant):
    folder = model_factory(variant)
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    first = get_tokenizer(folder)  # asks AutoTokenizer and writes the note
    assert len(_notes()) == 1
    note = json.loads(_notes()[0].read_text())
    assert note == {"module": type(reference).__module__, "qualname": type(reference).__qualname__}
    _forbid_auto(monkeypatch)
    second = get_tokenizer(folder)  # the note: the class directly
    _same_tokenizer(reference, first)
    _same_tokenizer(reference, second)


def test_a_changed_tokenizer_config_asks_auto_again(model_factory, tmp_path, monkeypatch):
    folder = tmp_path / "copy"
    shutil.copytree(model_factory("qwen3"), folder)
    get_tokenizer(folder)
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_max_length": 1234}))
    asked = []
    real = tokenizer_module._auto_tokenizer
    monkeypatch.setattr(tokenizer_module, "_auto_tokenizer", lambda source: asked.append(source) or real(source))
    assert get_tokenizer(folder).model_max_length == 1234
    assert asked == [str(folder)] and len(_notes()) == 2  # another key, another note


def test_an_unreadable_or_foreign_note_is_ignored_and_rewritten(model_factory, monkeypatch, caplog):
    folder = model_factory("qwen3")
    get_tokenizer(folder)
    [note] = _notes()
    for bad in ("{not json", json.dumps({"module": "os", "qualname": "system"}),
                json.dumps({"module": "transformers", "qualname": "NoSuchTokenizer"})):
        note.write_text(bad)
        with caplog.at_level(logging.WARNING, logger="minivllm"):
            tokenizer = get_tokenizer(folder)  # AutoTokenizer again, never the foreign name
        assert type(tokenizer).__module__.startswith("transformers.")
        assert json.loads(note.read_text())["qualname"] == type(tokenizer).__qualname__
    assert "unreadable tokenizer note" in caplog.text and "is not a transformers module" in caplog.text


def test_a_source_that_is_not_a_folder_goes_to_auto_as_it_is(monkeypatch):
    asked = []
    monkeypatch.setattr(tokenizer_module, "_auto_tokenizer", lambda source: asked.append(source) or "tok")
    assert get_tokenizer("some-org/some-model") == "tok" and asked == ["some-org/some-model"]
    assert _notes() == []
