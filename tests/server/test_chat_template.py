"""vLLM's `--chat-template` (the engine's `chat_template` option: a file or the template itself, in
place of the model's) and a request's own `chat_template` (only with
`--trust-request-chat-template`): prompts rendered as transformers renders the same template."""

from __future__ import annotations

import copy
import json
import re
import shutil

import pytest
from transformers import AutoTokenizer

from kvflow import LLM, SamplingParams
from kvflow.config import EngineConfig, ServerConfig
from kvflow.models.tokenizer import FastTokenizer, state_of

from server_utils import LiveServer, post, post_ok

pytestmark = pytest.mark.server

OTHER = (
    "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is Paris?"}]


def hf_ids(path: str, template: str | None) -> list[int]:
    """The prompt's token ids as transformers renders and tokenizes it (special tokens as text)."""
    tok = AutoTokenizer.from_pretrained(path)
    kw = {"chat_template": template} if template is not None else {}
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kw)
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "other.jinja"
    path.write_text(OTHER)
    return str(path)


@pytest.fixture(scope="module")
def untemplated(tiny_llama, tmp_path_factory):
    """The tiny Llama without a chat template."""
    path = tmp_path_factory.mktemp("no-template") / "model"
    shutil.copytree(tiny_llama[0], path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    return str(path)


def test_the_option_replaces_the_models_template(tiny_llama, template_file):
    path = tiny_llama[0]
    want = hf_ids(path, OTHER)
    assert want != hf_ids(path, None)
    for given in (template_file, OTHER):  # a file, or the template itself
        with LLM(path, num_kv_blocks=64, max_model_len=128, chat_template=given) as llm:
            out = llm.chat(MESSAGES, SamplingParams(max_tokens=1), use_tqdm=False)[0]
            assert out.prompt_token_ids == want
    s = LiveServer(EngineConfig(model=path, num_kv_blocks=64, max_model_len=128, chat_template=template_file))
    try:
        body = {"messages": MESSAGES, "max_tokens": 1}
        assert post_ok(s, "/v1/chat/completions", body)["usage"]["prompt_tokens"] == len(want)
        assert post_ok(s, "/tokenize", {"messages": MESSAGES})["tokens"] == want
    finally:
        s.stop()


def test_a_model_without_a_template(untemplated, template_file):
    with LLM(untemplated, num_kv_blocks=64, max_model_len=128) as llm:
        with pytest.raises(ValueError, match="no chat template.*give chat_template"):
            llm.chat(MESSAGES, use_tqdm=False)
        out = llm.chat(MESSAGES, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=OTHER)[0]
        assert out.prompt_token_ids == hf_ids(untemplated, OTHER)
    s = LiveServer(EngineConfig(model=untemplated, num_kv_blocks=64, max_model_len=128))
    try:
        r = post(s, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
        assert r.status_code == 400 and "--chat-template" in r.json()["error"]["message"]
    finally:
        s.stop()
    with LLM(untemplated, num_kv_blocks=64, max_model_len=128, chat_template=template_file) as llm:
        out = llm.chat(MESSAGES, SamplingParams(max_tokens=1), use_tqdm=False)[0]
        assert out.prompt_token_ids == hf_ids(untemplated, OTHER)


def test_bad_templates_stop_start_up(tiny_llama):
    with pytest.raises(ValueError, match=re.escape("is neither a file nor a Jinja template")):
        EngineConfig(model=tiny_llama[0], chat_template="no-such-template.jinja")
    with pytest.raises(ValueError, match=re.escape("chat_template: the template does not compile (line 1")):
        LLM(tiny_llama[0], num_kv_blocks=16, max_model_len=32, chat_template="{% for m in messages %}{{ m }}")


def test_a_requests_own_template_needs_trust(tiny_llama):
    path = tiny_llama[0]
    body = {"messages": MESSAGES, "max_tokens": 1, "chat_template": OTHER}
    s = LiveServer(EngineConfig(model=path, num_kv_blocks=64, max_model_len=128))
    try:
        r = post(s, "/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
        assert "--trust-request-chat-template" in r.json()["error"]["message"]
    finally:
        s.stop()
    s = LiveServer(
        EngineConfig(model=path, num_kv_blocks=64, max_model_len=128),
        ServerConfig(trust_request_chat_template=True),
    )
    try:
        assert post_ok(s, "/v1/chat/completions", body)["usage"]["prompt_tokens"] == len(hf_ids(path, OTHER))
        plain = post_ok(s, "/v1/chat/completions", {**body, "chat_template": None})
        assert plain["usage"]["prompt_tokens"] == len(hf_ids(path, None))
        bad = post(s, "/v1/chat/completions", {**body, "chat_template": "{% if %}"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template"
    finally:
        s.stop()


def test_a_gguf_tokenizer_keeps_a_replaced_template(tiny_llama):
    """The tokenizer GGUF models get: a replaced template is in its state, so copies (the server's
    thread, workers) render with it too, and so does its transformers twin."""
    tok = FastTokenizer.from_state(state_of(AutoTokenizer.from_pretrained(tiny_llama[0])))
    tok.to_hf()  # (built before the change: rebuilt after it)
    tok.chat_template = OTHER
    for t in (tok, copy.deepcopy(tok)):
        assert t.chat_template == OTHER and t.state["chat_template"] == OTHER
        assert t.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == (
            "[SYSTEM] Be brief.\n[USER] Where is Paris?\n[ASSISTANT] "
        )
        assert t.to_hf().chat_template == OTHER
