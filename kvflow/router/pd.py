"""The prefill/decode protocol as the router speaks it: which requests take the prefill step, what
the prefill engine is sent, and what the decode engine is sent after it.

The prefill engine (a kv_producer) computes the prompt, samples one token nobody sees, and holds
the prompt's KV blocks; its response's `kv_transfer_params` say where the decode engine (a
kv_consumer) fetches them. The router treats those params as opaque.
"""

from __future__ import annotations

import json
from typing import Any

from kvflow.utils.validation import is_int

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
# Routed like the two above (policy, retry), but always computed whole by one engine: the
# prefill/decode protocol (kv_transfer_params) belongs to the completions endpoints.
RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH = "/v1/messages"  # Anthropic's Messages API
EMBEDDINGS_PATH = "/v1/embeddings"
# vLLM's score and rerank APIs: embeddings too (no output tokens), routed by load alone
SCORE_PATHS = ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank")
ROUTED_PATHS = (COMPLETIONS_PATH, CHAT_PATH, RESPONSES_PATH, MESSAGES_PATH, EMBEDDINGS_PATH, *SCORE_PATHS)

# What asks a producer engine to keep the prompt's KV for a decode engine (vLLM's field).
REMOTE_DECODE = {"do_remote_decode": True}


def takes_prefill_step(path: str, body: dict[str, Any]) -> bool:
    """Whether this request goes through a prefill engine before its decode engine."""
    if path not in (CHAT_PATH, COMPLETIONS_PATH):
        return False  # responses, messages, embeddings: the decode engine computes them whole
    n = body.get("n", 1)
    if is_int(n) and n > 1:
        # One transfer feeds one sequence (kv_transfer_params needs n == 1): the decode engine
        # computes the prompt itself and forks its n sequences from it, as a plain server does.
        return False
    if path == COMPLETIONS_PATH and _prompt_count(body.get("prompt")) > 1:
        # Several prompts would need a transfer each; kvflow refuses kv_transfer_params with more
        # than one prompt, so such a request is the decode engine's alone too.
        return False
    return True


def prefill_body(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The client's body turned into a prefill-only request: one token, not streamed, one sequence,
    the KV held for a decode engine. Everything that shapes the prompt (messages, tools, template
    options, the prompt itself) stays exactly as sent, so the KV matches what the decode engine
    would have computed."""
    out = dict(body)
    out["max_tokens"] = 1
    if path == CHAT_PATH and "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1  # it wins over max_tokens in chat
    out["stream"] = False
    out.pop("stream_options", None)  # only allowed with stream: true
    # min_tokens > 1 would make max_tokens = 1 a 400; the decode engine enforces the client's.
    out.pop("min_tokens", None)
    out["n"] = 1
    out["kv_transfer_params"] = dict(REMOTE_DECODE)
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> bytes:
    """The client's body, plus where its prompt's KV waits."""
    return encode_body({**body, "kv_transfer_params": kv_transfer_params})


def encode_body(body: dict[str, Any]) -> bytes:
    # ASCII escapes: a lone surrogate the client sent ("\ud800") stays an escape, for the engine
    # to refuse with its 400, instead of failing to encode here.
    return json.dumps(body, separators=(",", ":")).encode()


def _prompt_count(prompt: Any) -> int:
    """Prompts in a /v1/completions `prompt`: a string or a token-id list is one; a list of those
    is as many as it holds (a malformed one counts as one: the prefill engine answers its 400)."""
    if isinstance(prompt, list) and prompt and not all(is_int(t) for t in prompt):
        return len(prompt)
    return 1
