"""engine/processing/tokenizer.py: the tokenizer class AutoTokenizer picks is remembered, and loading it directly gives
the same tokenizer (class, ids, chat template, decoding) without AutoTokenizer's ~2 s class lookup."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import transformers
from minivllm.cpu.tuning_cache import tuning_folder
from minivllm.engine.processing import tokenizer as tokenizer_module
from minivllm.engine.processing.tokenizer import get_tokenizer

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
    assert (note["module"], note["qualname"]) == (type(reference).__module__, type(reference).__qualname__)
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


def _json_files_read(monkeypatch) -> list[str]:
    """The files Python's json module parses from now on (transformers calls `json.load(handle)`)."""
    read: list[str] = []
    real = json.load
    monkeypatch.setattr(json, "load", lambda f, **kw: read.append(Path(f.name).name) or real(f, **kw))
    return read


def test_added_tokens_are_remembered_so_a_load_parses_no_tokenizer_json_in_python(model_factory, monkeypatch):
    # transformers 5's save_pretrained (the tiny models', the default model's converted folder) lists no added
    # tokens in tokenizer_config.json: from_pretrained then parses all of tokenizer.json in Python to find them.
    folder = model_factory("qwen3")
    assert "added_tokens_decoder" not in json.loads((Path(folder) / "tokenizer_config.json").read_text())
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    get_tokenizer(folder)
    note = json.loads(_notes()[0].read_text())
    listed = json.loads((Path(folder) / "tokenizer.json").read_text())["added_tokens"]
    assert note["added_tokens_decoder"] == {str(t.pop("id")): t for t in listed}
    read = _json_files_read(monkeypatch)
    _forbid_auto(monkeypatch)
    second = get_tokenizer(folder)
    assert "tokenizer.json" not in read and "tokenizer_config.json" in read
    assert second.added_tokens_decoder == reference.added_tokens_decoder
    assert second.all_special_tokens == reference.all_special_tokens
    assert second.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    _same_tokenizer(reference, second)


def test_added_tokens_are_not_remembered_where_another_file_also_names_special_tokens(model_factory, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(model_factory("qwen3"), folder)
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|endoftext|>"}))
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    get_tokenizer(folder)
    assert "added_tokens_decoder" not in json.loads(_notes()[0].read_text())
    second = get_tokenizer(folder)
    assert second.bos_token == reference.bos_token == "<|endoftext|>"
    _same_tokenizer(reference, second)


def test_a_note_with_malformed_added_tokens_is_ignored(model_factory, monkeypatch, caplog):
    folder = model_factory("qwen3")
    get_tokenizer(folder)
    [note] = _notes()
    good = json.loads(note.read_text())
    note.write_text(json.dumps({**good, "added_tokens_decoder": {"0": {"content": "x", "surprise": 1}}}))
    asked = []
    real = tokenizer_module._auto_tokenizer
    monkeypatch.setattr(tokenizer_module, "_auto_tokenizer", lambda source: asked.append(source) or real(source))
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        get_tokenizer(folder)
    assert asked == [folder] and "added tokens are malformed" in caplog.text
    assert json.loads(note.read_text()) == good  # rewritten as it was
