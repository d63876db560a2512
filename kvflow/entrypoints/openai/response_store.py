"""The responses kept for `previous_response_id` and `GET /v1/responses/{id}`: in memory, least
recently used dropped first past a count limit (`--responses-store-size`).

Each entry holds the response body and the conversation it ends (earlier inputs and outputs, as
Responses items). A continued conversation shares its items with the entry it continues (tuples of
the same dicts), so a long chain costs one reference per item per entry, not a copy of the text.
Used from the server's event loop only, so no lock.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

from kvflow.entrypoints.openai.utils import APIError


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object, as returned
    items: tuple[dict[str, Any], ...]  # the conversation through this response's output


class ResponseStore:
    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()
        # ids of responses made with store: false (only the ids, as many): an error can then say why
        # such an id cannot be continued instead of calling it unknown
        self._unstored: collections.OrderedDict[str, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, body: dict[str, Any], items: tuple[dict[str, Any], ...]) -> None:
        if self.max_entries <= 0:
            return
        self._entries[response_id] = StoredResponse(body, items)
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def not_stored(self, response_id: str) -> None:
        self._unstored[response_id] = None
        while len(self._unstored) > max(self.max_entries, 1024):
            self._unstored.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None

    def previous(self, response_id: str) -> StoredResponse:
        """The response a request continues; a 400 naming previous_response_id when it is not kept."""
        entry = self.get(response_id)
        if entry is not None:
            return entry
        if response_id in self._unstored:
            why = "it was created with store: false, so it was not kept; send the conversation in input instead"
        elif self.max_entries <= 0:
            why = "this server keeps no responses (--responses-store-size 0); send the conversation in input"
        else:
            why = (
                f"no such response is kept (unknown, deleted, or dropped: the server keeps the last "
                f"{self.max_entries} responses)"
            )
        raise APIError(
            400,
            f"previous_response_id {response_id[:80]!r}: {why}",
            param="previous_response_id",
            code="previous_response_not_found",
        )
