"""What the cache-aware policy remembers about each replica: an approximate, bounded radix tree of
the prompt text the router sent it, and how a request body becomes that text.

Approximate on purpose: the router never sees an engine's real prefix cache (blocks, hashes,
evictions). It remembers what it sent each replica, character by character, and forgets the least
recently used leaves once a replica's tree holds more than `max_chars` characters. A replica that
matches a long prefix of a new prompt most likely still holds that prefix's KV blocks.

Every operation is O(prompt length) (plus a log factor where an edge splits and for the LRU heap).
"""

from __future__ import annotations

import heapq
import json
from itertools import count
from typing import Any

from kvflow.router.pd import CHAT_PATH, EMBEDDINGS_PATH, MESSAGES_PATH, RESPONSES_PATH
from kvflow.utils.validation import is_int


class _Node:
    __slots__ = ("children", "label", "last_access", "parent")

    def __init__(self, label: str, parent: _Node | None, last_access: int) -> None:
        self.label = label  # the edge from the parent: the characters this node adds
        self.parent = parent  # None: the root, or a node evicted from the tree
        self.children: dict[str, _Node] = {}  # by the first character of the child's label
        self.last_access = last_access


class PrefixTree:
    """A character-level radix tree of the texts inserted, bounded to `max_chars` characters of
    edge labels (what the tree stores) by evicting the least recently inserted-through leaves.

    `match(text)` says how many leading characters of `text` the tree holds (read-only: a replica
    that was only asked about a prefix did not compute it); `insert(text)` adds the text and marks
    its whole path as just used."""

    def __init__(self, max_chars: int) -> None:
        if max_chars < 1:
            raise ValueError(f"max_chars must be >= 1, got {max_chars}")
        self.max_chars = max_chars
        self.size = 0  # characters in the tree (sum of the edge labels)
        self.num_nodes = 0  # root excluded
        self._clock = 0  # logical time of the last insert (LRU order without a wall clock)
        self._root = _Node("", None, 0)
        # Leaves by last access, lazily invalidated: an entry is stale once its node was evicted,
        # got children, or was used again (it then has a newer entry).
        self._heap: list[tuple[int, int, _Node]] = []
        self._seq = count()

    def __len__(self) -> int:
        return self.size

    def clear(self) -> None:
        self.__init__(self.max_chars)  # type: ignore[misc]

    # ---- lookups ---------------------------------------------------------------------------------
    def match(self, text: str) -> int:
        """Characters of the longest prefix of `text` stored in the tree."""
        node, i, n = self._root, 0, len(text)
        while i < n:
            child = node.children.get(text[i])
            if child is None:
                break
            label = child.label
            if text.startswith(label, i):
                i += len(label)
                node = child
                continue
            return i + _common_prefix(label, text, i)
        return i

    # ---- updates ---------------------------------------------------------------------------------
    def insert(self, text: str) -> None:
        """Add `text` (at most its first `max_chars` characters: more could never be kept) and mark
        its path as the most recently used, then evict down to `max_chars`."""
        text = text[: self.max_chars]
        self._clock += 1
        now = self._clock
        node, i, n = self._root, 0, len(text)
        while i < n:
            node.last_access = now
            child = node.children.get(text[i])
            if child is None:
                leaf = _Node(text[i:], node, now)
                node.children[text[i]] = leaf
                self.size += n - i
                self.num_nodes += 1
                node = leaf
                break
            label = child.label
            if text.startswith(label, i):
                i += len(label)
                node = child
                continue
            # Split the edge where text and label part: parent -> mid (shared part) -> child.
            k = _common_prefix(label, text, i)
            mid = _Node(label[:k], node, now)
            node.children[text[i]] = mid
            child.label = label[k:]
            child.parent = mid
            mid.children[child.label[0]] = child
            self.num_nodes += 1
            i += k
            node = mid
        node.last_access = now
        if node is not self._root and not node.children:
            self._push(node)
        self._evict()

    def _push(self, node: _Node) -> None:
        heapq.heappush(self._heap, (node.last_access, next(self._seq), node))
        if len(self._heap) > 2 * self.num_nodes + 64:
            # Mostly stale entries (a tree under its bound never pops them): rebuild from the leaves.
            self._heap = [(x.last_access, next(self._seq), x) for x in self._leaves()]
            heapq.heapify(self._heap)

    def _leaves(self) -> list[_Node]:
        out, stack = [], list(self._root.children.values())
        while stack:
            x = stack.pop()
            if x.children:
                stack.extend(x.children.values())
            else:
                out.append(x)
        return out

    def _evict(self) -> None:
        while self.size > self.max_chars and self._heap:
            t, _, node = heapq.heappop(self._heap)
            parent = node.parent
            if parent is None or node.children or node.last_access != t:
                continue  # stale entry
            del parent.children[node.label[0]]
            node.parent = None
            self.size -= len(node.label)
            self.num_nodes -= 1
            if parent is not self._root and not parent.children:
                self._push(parent)  # now a leaf itself, as old as its last use


def _common_prefix(label: str, text: str, i: int) -> int:
    """Length of the common prefix of `label` and `text[i:]`, given that their first characters
    agree and `label` is not a prefix of `text[i:]` (binary search over C-speed comparisons)."""
    lo, hi = 1, min(len(label), len(text) - i)  # lo always matches; the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(label[:mid], i):
            lo = mid
        else:
            hi = mid - 1
    return lo


# ---- the text a request's prompt becomes -------------------------------------------------------------
CHARS_PER_TOKEN = 4.0  # text: about four characters per token (English under a BPE vocabulary)


def prompt_texts(path: str, body: dict[str, Any]) -> list[str]:
    """The prompt(s) of a request as text to match, one per prompt the engine will compute.

    /v1/completions: the prompt string, or a token-id list as one character per id (so matches
    count tokens); a list of prompts gives one text each. /v1/chat/completions: the tools (they are
    rendered first by chat templates) and each message as a role marker and its text, concatenated
    in order; /v1/messages and /v1/responses alike, their system prompt or instructions first;
    /v1/embeddings: its input as a completion's prompt. What cannot be read gives no text (the
    request routes by load alone)."""
    return [t for t, _ in prompt_texts_scaled(path, body)]


def prompt_texts_scaled(path: str, body: dict[str, Any]) -> list[tuple[str, float]]:
    """`prompt_texts`, each with its characters per token: 1 for a token-id prompt (one character
    per id), else `CHARS_PER_TOKEN` (an estimate: the router does not tokenize)."""
    if path == CHAT_PATH:
        return [(_chat_text(body), CHARS_PER_TOKEN)]
    if path == MESSAGES_PATH:  # Anthropic: the system prompt is a field, not a message
        system = body.get("system")
        first = [{"role": "system", "content": system}] if system else []
        messages = body.get("messages")
        return [
            (
                _chat_text({**body, "messages": first + (messages if isinstance(messages, list) else [])}),
                CHARS_PER_TOKEN,
            )
        ]
    if path == RESPONSES_PATH:  # instructions, then the input: text or a list of items
        items = body.get("input")
        if isinstance(items, str):
            items = [{"role": "user", "content": items}]
        instructions = body.get("instructions")
        first = [{"role": "system", "content": instructions}] if isinstance(instructions, str) else []
        messages = first + [i for i in (items if isinstance(items, list) else []) if isinstance(i, dict)]
        return [(_chat_text({**body, "messages": messages}), CHARS_PER_TOKEN)]
    prompt = body.get("input") if path == EMBEDDINGS_PATH else body.get("prompt")
    if isinstance(prompt, str):
        return [(prompt, CHARS_PER_TOKEN)]
    if isinstance(prompt, list) and prompt:
        if all(is_int(t) for t in prompt):
            return [(_ids_text(prompt), 1.0)]
        out = []
        for p in prompt:
            if isinstance(p, str):
                out.append((p, CHARS_PER_TOKEN))
            elif isinstance(p, list) and all(is_int(t) for t in p):
                out.append((_ids_text(p), 1.0))
        return out
    return []


def _chat_text(body: dict[str, Any]) -> str:
    parts: list[str] = []
    tools = body.get("tools")
    if tools:
        parts.append("<|tools|>" + _dumps(tools))
    messages = body.get("messages")
    if isinstance(messages, list):
        for msg in messages:
            if not isinstance(msg, dict):
                continue
            parts.append(f"<|{msg.get('role')}|>")
            content = msg.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        parts.append(part["text"])
            if msg.get("tool_calls"):
                parts.append(_dumps(msg["tool_calls"]))
            parts.append("\n")
    return "".join(parts)


def _ids_text(ids: list[int]) -> str:
    # One character per token id (Python strings hold any code point, surrogates too); ids beyond
    # Unicode's range (never seen in practice) wrap, which only makes the match approximate.
    return "".join(chr(t % 0x110000) for t in ids)


def _dumps(x: Any) -> str:
    try:
        return json.dumps(x, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError):
        return ""
