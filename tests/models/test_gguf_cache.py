"""The GGUF metadata cache and the transformers-free tokenizer: a second load reads the cache (no
parse, no transformers) and gives the same weights and tokens; a changed file or a torn entry is
rebuilt; FastTokenizer renders chat templates and encodes as transformers does."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from kvflow.models import gguf_cache, gguf_loader
from kvflow.models.gguf_loader import load_gguf
from kvflow.models.tokenizer import FastTokenizer
from kvflow.quantization.gguf_blocks import BlockQuantized

from gguf_files import MESSAGES, TEXTS, write_tiny


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "kvcache"
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(d))
    return d


@pytest.fixture
def parses(monkeypatch):
    """Counts how often the GGUF's metadata is parsed."""
    calls = []
    real = gguf_loader._open

    def counting(path):
        calls.append(path)
        return real(path)

    monkeypatch.setattr(gguf_loader, "_open", counting)
    return calls


def _assert_same_checkpoint(a, b) -> None:
    assert a.hf_config == b.hf_config and a.name == b.name
    assert list(a.tensors) == list(b.tensors)
    for name, x in a.tensors.items():
        y = b.tensors[name]
        if isinstance(x, BlockQuantized):
            assert isinstance(y, BlockQuantized) and x.format == y.format, name
            assert torch.equal(x.data, y.data), name
        else:
            assert x.dtype == y.dtype and torch.equal(x, y), name
    assert a.tokenizer.state == b.tokenizer.state
    for text in TEXTS:
        ids = a.tokenizer(text)["input_ids"]
        assert b.tokenizer(text)["input_ids"] == ids
        assert b.tokenizer.decode(ids) == a.tokenizer.decode(ids)


@pytest.mark.parametrize("keep_blocks", [False, True])
def test_second_load_reads_the_cache(tmp_path, cache_dir, parses, keep_blocks):
    path = tmp_path / "tiny.gguf"
    write_tiny(path, tied=False)
    first = load_gguf(path, keep_blocks=keep_blocks)
    assert len(parses) == 1
    assert gguf_cache.entry_path(str(path)).is_file()
    second = load_gguf(path, keep_blocks=keep_blocks)
    assert len(parses) == 1, "the second load parsed the file again"
    _assert_same_checkpoint(first, second)
    assert isinstance(second.tokenizer, FastTokenizer)


@pytest.mark.server
def test_second_load_does_not_import_transformers(tmp_path, cache_dir):
    path = tmp_path / "tiny.gguf"
    write_tiny(path, tied=True)
    load_gguf(path)  # fills the cache (builds the tokenizer with transformers)
    code = (
        "import sys; from kvflow.models.gguf_loader import load_gguf; "
        f"ck = load_gguf({str(path)!r}); ck.tokenizer.apply_chat_template([{{'role': 'user', 'content': 'hi'}}], "
        "tokenize=False, add_generation_prompt=True); ck.tokenizer.decode(ck.tokenizer('hi')['input_ids']); "
        "print('transformers' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "KVFLOW_CACHE_DIR": str(cache_dir)},
    )
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_changed_file_invalidates(tmp_path, cache_dir, parses):
    path = tmp_path / "tiny.gguf"
    write_tiny(path, tied=True, add_bos=False)
    old = load_gguf(path)
    old_entry = gguf_cache.entry_path(str(path))
    write_tiny(path, tied=True, add_bos=True)  # another tokenizer setting, so other ids
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a new mtime even on coarse clocks
    new = load_gguf(path)
    assert len(parses) == 2
    assert gguf_cache.entry_path(str(path)) != old_entry
    assert old.tokenizer("hi")["input_ids"][0] != 1 and new.tokenizer("hi")["input_ids"][0] == 1
    assert new.tokenizer.add_bos_token is True


@pytest.mark.parametrize("damage", ["truncated", "garbage", "other_file", "old_version"])
def test_damaged_entry_is_ignored_and_rebuilt(tmp_path, cache_dir, parses, damage):
    path = tmp_path / "tiny.gguf"
    write_tiny(path, tied=True)
    good = load_gguf(path)
    entry = gguf_cache.entry_path(str(path))
    raw = entry.read_bytes()
    if damage == "truncated":
        entry.write_bytes(raw[: len(raw) // 2])
    elif damage == "garbage":
        entry.write_bytes(b"\x00\xff" * 100)
    else:
        data = json.loads(raw)
        if damage == "other_file":
            data["source"]["size"] += 1
        else:
            data["version"] = gguf_cache.FORMAT_VERSION + 1
        entry.write_text(json.dumps(data))
    again = load_gguf(path)
    assert len(parses) == 2, "a damaged entry was used"
    _assert_same_checkpoint(good, again)
    json.loads(entry.read_bytes())  # rewritten whole
    load_gguf(path)
    assert len(parses) == 2


def test_entry_without_tokenizer_is_completed(tmp_path, cache_dir, parses):
    path = tmp_path / "tiny.gguf"
    write_tiny(path, tied=True)
    assert load_gguf(path, with_tokenizer=False).tokenizer is None  # a tensor-parallel worker's load
    assert load_gguf(path).tokenizer is not None
    assert len(parses) == 2
    load_gguf(path)
    assert len(parses) == 2


def test_unwritable_cache_still_loads(tmp_path, monkeypatch, parses):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(blocker))
    path = tmp_path / "tiny.gguf"
    write_tiny(path, tied=True)
    assert load_gguf(path).tokenizer("hi")["input_ids"]
    load_gguf(path)
    assert len(parses) == 2


# ---- FastTokenizer against transformers ----------------------------------------------------------------

TOOL_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\nTools:' }}{% for t in tools %}{{ '\\n' + (t | tojson) }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m.reasoning_content is defined %}{{ '<think>' + m.reasoning_content + '</think>' }}{% endif %}"
    "{%- if m.content is defined %}{{ m['content'] }}{% else %}(none){% endif %}"
    "{%- if m.tool_calls is defined %}{% for c in m.tool_calls %}{{ c.function | tojson }}{% endfor %}{% endif %}"
    "{% generation %}{{ '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}{% endfor %}"
    "{%- set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant ' + bos_token + ' ' + (ns.n | string) }}"
    "{% if greeting is defined %}{{ greeting }}{% endif %}{{ '\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(FastTokenizer, the transformers tokenizer it came from) of a tiny GGUF."""
    d = tmp_path_factory.mktemp("pair")
    write_tiny(d / "tiny.gguf", tied=True)
    hf = gguf_loader._build_tokenizer(str(d / "tiny.gguf"), _meta(d / "tiny.gguf"))
    ours = FastTokenizer.from_state(gguf_loader.state_of(hf))
    return ours, hf


def _meta(path):
    reader = gguf_loader._open(str(path))
    return {name: field.contents() for name, field in reader.fields.items()}


def test_fast_tokenizer_chat_template_matches_transformers(pair):
    ours, hf = pair
    ours.chat_template = hf.chat_template = TOOL_TEMPLATE
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": 'Wetter für <Ort> & "Zeit"',
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    conversations = [
        MESSAGES,
        [
            {"role": "user", "content": "hi", "name": None},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "think first",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "東京"}}}
                ],
            },
            {"role": "tool", "content": "sunny"},
        ],
        [{"role": "assistant", "thinking": "old-style reasoning", "content": "ok"}],
    ]
    try:
        for conv in conversations:
            for gen in (True, False):
                for kw in ({}, {"tools": tools}, {"greeting": "hello"}, {"tools": tools, "bos_token": "<override>"}):
                    a = ours.apply_chat_template(copy.deepcopy(conv), tokenize=False, add_generation_prompt=gen, **kw)
                    b = hf.apply_chat_template(copy.deepcopy(conv), tokenize=False, add_generation_prompt=gen, **kw)
                    assert a == b, (conv, gen, kw)
        # Not rendered here (token ids: a BatchEncoding in transformers): the same result from transformers.
        assert ours.apply_chat_template(MESSAGES)["input_ids"] == hf.apply_chat_template(MESSAGES)["input_ids"]
        with pytest.raises(Exception, match="nope"):
            ours.apply_chat_template(
                [{"role": "user", "content": "{{ raise_exception('nope') }}"}],
                tokenize=False,
                chat_template="{{ raise_exception('nope') }}",
            )
    finally:
        ours.chat_template = hf.chat_template = ours.state["chat_template"]


def test_fast_tokenizer_matches_transformers(pair):
    ours, hf = pair
    for text in TEXTS:
        for special in (True, False):
            assert (
                ours(text, add_special_tokens=special)["input_ids"] == hf(text, add_special_tokens=special)["input_ids"]
            )
        ids = hf(text)["input_ids"]
        assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
        assert ours.convert_ids_to_tokens(ids, skip_special_tokens=True) == hf.convert_ids_to_tokens(
            ids, skip_special_tokens=True
        )
    batch = TEXTS[:4]
    assert ours(batch)["input_ids"] == hf(batch)["input_ids"]
    assert ours.get_vocab() == hf.get_vocab()
    assert ours.all_special_ids == hf.all_special_ids
    assert ours.special_tokens_map == hf.special_tokens_map
    assert {i: t.content for i, t in ours.added_tokens_decoder.items()} == {
        i: t.content for i, t in hf.added_tokens_decoder.items()
    }
    assert ours.convert_tokens_to_ids(["<|im_end|>", "no-such-token"]) == hf.convert_tokens_to_ids(
        ["<|im_end|>", "no-such-token"]
    )
    assert ours.decode(5) == hf.decode(5)


def test_fast_tokenizer_copy_shares_the_backend(pair):
    ours, _ = pair
    twin = copy.deepcopy(ours)
    assert twin is not ours and twin.backend_tokenizer is ours.backend_tokenizer
    assert twin("hi there")["input_ids"] == ours("hi there")["input_ids"]
