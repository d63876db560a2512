"""vLLM's request extras on the HTTP server, each against a reference outside the feature: a run
without it (stop strings, prompt truncation), the unconstrained run's own logprobs (allowed token
ids), transformers' rendering of the template (continue_final_message); and the extras kvflow does
not implement are 400s naming them whenever they ask for something, never silently ignored."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

from kvflow.config import EngineConfig

from server_utils import LiveServer, post_ok

pytestmark = pytest.mark.server  # starts servers or worker processes: not in `make test-fast`

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def server(tiny_llama):
    s = LiveServer(EngineConfig(model=tiny_llama[0], num_kv_blocks=256, max_model_len=MAX_MODEL_LEN))
    s.hf_tokenizer = AutoTokenizer.from_pretrained(tiny_llama[0])
    yield s
    s.stop()


def complete(server, **body) -> dict:
    return post_ok(server, "/v1/completions", {"max_tokens": 24, "temperature": 0, "ignore_eos": True, **body})


def test_include_stop_str_in_output(server):
    plain = complete(server, prompt="The weather today")["choices"][0]["text"]
    at = len(plain) // 2
    stop = plain[at : at + 3]
    idx = plain.find(stop)  # (its first occurrence, where the output stops)
    assert idx > 0 and stop.strip(), plain
    cut = complete(server, prompt="The weather today", stop=[stop])["choices"][0]
    assert (cut["text"], cut["finish_reason"], cut["stop_reason"]) == (plain[:idx], "stop", stop)
    kept = complete(server, prompt="The weather today", stop=[stop], include_stop_str_in_output=True)["choices"][0]
    assert (kept["text"], kept["finish_reason"]) == (plain[: idx + len(stop)], "stop")
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json={
            "prompt": "The weather today",
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
            "stop": [stop],
            "include_stop_str_in_output": True,
            "stream": True,
        },
        timeout=60,
    ) as r:
        streamed = "".join(
            json.loads(line[6:])["choices"][0]["text"]
            for line in r.iter_lines()
            if line.startswith("data: {") and json.loads(line[6:])["choices"]
        )
    assert streamed == kept["text"]


def test_allowed_token_ids(server):
    first = complete(server, prompt="Once upon a time", max_tokens=1, logprobs=20)["choices"][0]["logprobs"]
    ranked = sorted(first["top_logprobs"][0].items(), key=lambda kv: -kv[1])
    # the allowed set: the unconstrained step's 6th to 12th most likely tokens, as ids
    tok = server.hf_tokenizer
    allowed = []
    for text, _ in ranked[5:12]:
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) == 1 and tok.decode(ids) == text:
            allowed.append(ids[0])
    assert len(allowed) >= 3, ranked
    best = max(allowed, key=lambda t: first["top_logprobs"][0][tok.decode([t])])
    out = complete(server, prompt="Once upon a time", allowed_token_ids=allowed, max_tokens=1)
    assert out["choices"][0]["text"] == tok.decode([best])
    for seed in range(3):
        body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": seed, "ignore_eos": True}
        r = post_ok(server, "/v1/completions", {**body, "allowed_token_ids": allowed, "logprobs": 0})
        generated = r["choices"][0]["logprobs"]["tokens"]
        assert all(tok.convert_tokens_to_string([t]) in {tok.decode([a]) for a in allowed} for t in generated), (
            generated
        )
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "allowed_token_ids": [10**6]}, timeout=30)
    assert r.status_code == 400 and "allowed_token_ids: token id 1000000 is out of range" in r.text, r.text


def test_truncate_prompt_tokens(server):
    ids = server.hf_tokenizer.encode("one two three four five six seven eight nine ten " * 4, add_special_tokens=False)
    assert len(ids) > 20
    cut = complete(server, prompt=ids, truncate_prompt_tokens=12)
    alone = complete(server, prompt=ids[-12:])
    assert cut["usage"]["prompt_tokens"] == 12
    assert cut["choices"][0]["text"] == alone["choices"][0]["text"]
    echoed = complete(server, prompt=ids, truncate_prompt_tokens=12, echo=True)["choices"][0]["text"]
    assert echoed == server.hf_tokenizer.decode(ids[-12:]) + alone["choices"][0]["text"]
    long = ids * (MAX_MODEL_LEN // len(ids) + 1)
    fits = complete(server, prompt=long, truncate_prompt_tokens=MAX_MODEL_LEN - 24)
    assert fits["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 24
    for bad, fragment in ((MAX_MODEL_LEN + 1, "greater than max_model_len"), (0, "a positive integer, or -1")):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": ids, "truncate_prompt_tokens": bad}, timeout=30)
        assert r.status_code == 400 and fragment in r.text, r.text


def test_continue_final_message(server):
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]
    tok = server.hf_tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.rstrip().endswith("My favourite is")
    chat = post_ok(
        server,
        "/v1/chat/completions",
        {
            "messages": messages,
            "add_generation_prompt": False,
            "continue_final_message": True,
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    reference = complete(server, prompt=text, add_special_tokens=False, max_tokens=12)
    assert chat["usage"]["prompt_tokens"] == reference["usage"]["prompt_tokens"]
    assert chat["choices"][0]["message"]["content"] == reference["choices"][0]["text"]
    for body, fragment in (
        ({"messages": messages, "continue_final_message": True}, "cannot both be true"),
        ({"messages": messages[:1], "continue_final_message": True, "add_generation_prompt": False}, "assistant"),
    ):
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and fragment in r.text, r.text


def stream_chunks(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_return_token_ids(server):
    # the ids are the engine's: the prompt's as /tokenize gives them, the output's decode to the text
    tok = server.hf_tokenizer
    body = {"prompt": "The weather today", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    c = post_ok(server, "/v1/completions", {**body, "return_token_ids": True})["choices"][0]
    assert c["prompt_token_ids"] == post_ok(server, "/tokenize", {"prompt": "The weather today"})["tokens"]
    # (a character cut by the last token: transformers decodes it as U+FFFD, the server leaves it out)
    assert len(c["token_ids"]) == 12 and tok.decode(c["token_ids"]).rstrip("\ufffd") == c["text"].rstrip("\ufffd")
    chunks = stream_chunks(server, "/v1/completions", {**body, "return_token_ids": True})
    assert [t for ch in chunks for t in ch["choices"][0]["token_ids"]] == c["token_ids"]
    assert [ch["choices"][0].get("prompt_token_ids") for ch in chunks if "prompt_token_ids" in ch["choices"][0]] == [
        c["prompt_token_ids"]
    ]
    assert "token_ids" not in post_ok(server, "/v1/completions", body)["choices"][0]
    messages = [{"role": "user", "content": "Say something."}]
    chat_body = {"messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    r = post_ok(server, "/v1/chat/completions", chat_body)
    assert r["prompt_token_ids"] == post_ok(server, "/tokenize", {"messages": messages})["tokens"]
    ids = r["choices"][0]["token_ids"]
    assert len(ids) == r["usage"]["completion_tokens"] == 12
    chunks = stream_chunks(server, "/v1/chat/completions", chat_body)
    assert [t for ch in chunks if ch["choices"] for t in ch["choices"][0].get("token_ids", [])] == ids
    assert [ch["prompt_token_ids"] for ch in chunks if "prompt_token_ids" in ch] == [r["prompt_token_ids"]]


def test_return_tokens_as_token_ids(server):
    body = {"prompt": "The weather today", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 3}
    c = post_ok(server, "/v1/completions", {**body, "return_token_ids": True, "return_tokens_as_token_ids": True})
    c = c["choices"][0]
    assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
    assert all(k.startswith("token_id:") for top in c["logprobs"]["top_logprobs"] for k in top)
    plain = post_ok(server, "/v1/completions", body)["choices"][0]["logprobs"]
    assert plain["token_logprobs"] == c["logprobs"]["token_logprobs"]
    chat = post_ok(
        server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 2,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        },
    )["choices"][0]
    content = chat["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in chat["token_ids"]]
    assert all(t["token"].startswith("token_id:") for e in content for t in e["top_logprobs"])


def test_bad_words(server):
    # a word the plain greedy output writes as one token is never written under the ban
    body = {"prompt": "The weather today", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    plain = post_ok(server, "/v1/completions", {**body, "return_token_ids": True})["choices"][0]["token_ids"]
    tok = server.hf_tokenizer
    word = next(
        w
        for t in plain[2:]
        if (w := tok.decode([t]).strip()).isalpha()
        and [t] in (tok.encode(w, add_special_tokens=False), tok.encode(" " + w, add_special_tokens=False))
    )
    banned = {ids[0] for ids in (tok.encode(v, add_special_tokens=False) for v in (word, " " + word)) if len(ids) == 1}
    out = post_ok(server, "/v1/completions", {**body, "bad_words": [word], "return_token_ids": True})["choices"][0]
    assert banned & set(plain) and not banned & set(out["token_ids"]), (word, plain, out["token_ids"])


def prefix_hits(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("kvflow:prefix_cache_hits_total")
    )


def test_cache_salt_separates_prefix_cache_hits(server):
    ids = list(range(100, 160))  # three full blocks of 16 and some
    before = prefix_hits(server)
    first = complete(server, prompt=ids, cache_salt="tenant-a", max_tokens=4)
    server.wait_engine_idle()
    assert prefix_hits(server) == before
    other = complete(server, prompt=ids, cache_salt="tenant-b", max_tokens=4)
    server.wait_engine_idle()
    assert prefix_hits(server) == before  # another salt: nothing shared
    same = complete(server, prompt=ids, cache_salt="tenant-a", max_tokens=4)
    server.wait_engine_idle()
    assert prefix_hits(server) > before  # the same salt: its blocks again
    assert first["choices"][0]["text"] == other["choices"][0]["text"] == same["choices"][0]["text"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "cache_salt": ""}, timeout=30)
    assert r.status_code == 400 and "cache_salt must be a non-empty string" in r.text, r.text
    assert r.json()["error"]["param"] == "cache_salt"


def test_chat_echo(server):
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]
    body = {
        "messages": messages,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    answer = post_ok(server, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    echoed = post_ok(server, "/v1/chat/completions", {**body, "echo": True})["choices"][0]["message"]["content"]
    assert echoed == "My favourite is" + answer
    chunks = stream_chunks(server, "/v1/chat/completions", {**body, "echo": True})
    assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"]) == echoed
    # the last message is the user's: nothing to echo
    user_only = {"messages": messages[:1], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    plain = post_ok(server, "/v1/chat/completions", user_only)["choices"][0]["message"]["content"]
    assert (
        post_ok(server, "/v1/chat/completions", {**user_only, "echo": True})["choices"][0]["message"]["content"]
        == plain
    )


RAG_TEMPLATE = (
    "{% if documents %}Documents:\n{% for d in documents %}[{{ d['title'] }}] {{ d['text'] }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def rag_server(tiny_llama, tmp_path_factory):
    import shutil

    path = tmp_path_factory.mktemp("rag-model")
    shutil.copytree(tiny_llama[0], path, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = RAG_TEMPLATE
    tok.save_pretrained(path)
    s = LiveServer(EngineConfig(model=str(path), num_kv_blocks=256, max_model_len=MAX_MODEL_LEN))
    s.hf_tokenizer = tok
    yield s
    s.stop()


def test_chat_documents_reach_the_template(rag_server):
    messages = [{"role": "user", "content": "What colour is the sky?"}]
    docs = [{"title": "Sky", "text": "The sky is blue."}, {"title": "Grass", "text": "Grass is green."}]
    text = rag_server.hf_tokenizer.apply_chat_template(
        messages, documents=docs, tokenize=False, add_generation_prompt=True
    )
    assert "[Grass] Grass is green." in text
    greedy = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    chat = post_ok(rag_server, "/v1/chat/completions", {"messages": messages, "documents": docs, **greedy})
    ref = post_ok(rag_server, "/v1/completions", {"prompt": text, "add_special_tokens": False, **greedy})
    assert chat["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
    assert chat["choices"][0]["message"]["content"] == ref["choices"][0]["text"]
    plain = post_ok(rag_server, "/v1/chat/completions", {"messages": messages, **greedy})
    assert plain["usage"]["prompt_tokens"] < chat["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    "path,field,asks,idle",
    [
        ("/v1/completions", "mm_processor_kwargs", {"fps": 1}, {}),
        ("/v1/chat/completions", "logits_processors", ["my.Processor"], []),
        ("/v1/chat/completions", "vllm_xargs", {"a": 1}, {}),
    ],
)
def test_unimplemented_extras_are_refused_when_they_ask_for_something(server, path, field, asks, idle):
    body = {"max_tokens": 2}
    body.update({"prompt": "hi"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]})
    r = httpx.post(server.url + path, json={**body, field: asks}, timeout=30)
    assert r.status_code == 400, r.text
    assert f"{field} is not supported" in r.json()["error"]["message"], r.text
    assert httpx.post(server.url + path, json={**body, field: idle}, timeout=30).status_code == 200


def _chunks(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_cached_tokens_and_continuous_usage(server):
    """usage.prompt_tokens_details.cached_tokens (OpenAI's) counts the prompt's tokens found in the
    prefix cache: none the first time, every whole 16-token block but the last token's the second;
    vLLM's continuous_usage_stats puts the usage so far on every chunk."""
    prompt = [7 + (i * 37) % 480 for i in range(70)]  # 70 tokens: 4 whole blocks before the last token
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    first = post_ok(server, "/v1/completions", body)["usage"]
    again = post_ok(server, "/v1/completions", body)["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again["prompt_tokens_details"] == {"cached_tokens": (70 - 1) // 16 * 16}
    messages = [{"role": "user", "content": "Tell me about the weather in Paris today, in detail. " * 4}]
    chat = {"messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    post_ok(server, "/v1/chat/completions", chat)
    used = post_ok(server, "/v1/chat/completions", chat)["usage"]
    assert used["prompt_tokens_details"]["cached_tokens"] == (used["prompt_tokens"] - 1) // 16 * 16 > 0

    options = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    for path, request in (("/v1/completions", body), ("/v1/chat/completions", chat)):
        chunks = _chunks(server, path, {**request, **options})
        with_choices = [c for c in chunks if c["choices"]]
        counts = [c["usage"]["completion_tokens"] for c in with_choices if c["usage"] is not None]
        assert counts == sorted(counts) and counts[-1] == 5, counts
        # every chunk but chat's first (the role, before any token) carries the usage so far
        assert len(counts) == len(with_choices) - (path == "/v1/chat/completions")
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
        assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        plain = _chunks(server, path, {**request, "stream_options": {"include_usage": True}})
        assert all(c["usage"] is None for c in plain if c["choices"])  # (without it: null until the end)


def test_spaces_between_special_tokens(server):
    """Fast tokenizers (the only kind kvflow loads) decode special tokens the same with or without
    spaces between them: the text is the tokenizer's own decode either way."""
    tok = server.hf_tokenizer
    body = {"prompt": "<|im_start|>user", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    body.update(skip_special_tokens=False, return_token_ids=True, logit_bias={"0": 100, "2": 100, "3": 100})
    for spaces in (True, False):
        out = post_ok(server, "/v1/completions", {**body, "spaces_between_special_tokens": spaces})["choices"][0]
        assert set(out["token_ids"]) <= {0, 2, 3} and len(out["token_ids"]) == 12
        want = tok.decode(out["token_ids"], skip_special_tokens=False, spaces_between_special_tokens=spaces)
        assert out["text"] == want
