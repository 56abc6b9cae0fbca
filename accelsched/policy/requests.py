"""One-time request ids, each bound to its handler and its content: decisions only.

Whoever acts on a request first asks the side that supposedly sent it whether it did
(:mod:`accelsched.scheduler.authority` for requests from workers; a worker's guard for the
scheduler's orders to it). The answer is yes only for an id that side has outstanding,
for the same handler and the same content, and only once: a replayed or raced id, or an
id lifted onto another handler or other figures, is refused.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Mapping
from typing import Any

__all__ = ["Outstanding", "fingerprint"]


def fingerprint(handler: str, content: Mapping[str, Any]) -> str:
    """What a request says, in a few bytes both sides compute alike (after msgpack,
    which turns tuples into lists, as JSON does)."""
    text = json.dumps([handler, dict(content)], sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


class Outstanding:
    """The requests this side sent and has not seen confirmed."""

    def __init__(self) -> None:
        self._ids: dict[str, str] = {}  # id -> fingerprint

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, request: object) -> bool:
        return request in self._ids

    def new(self, handler: str, content: Mapping[str, Any]) -> str:
        """A fresh id for a request to ``handler`` saying ``content``."""
        request = secrets.token_hex(16)
        self._ids[request] = fingerprint(handler, content)
        return request

    def confirm(self, request: Any, print_: Any) -> bool:
        """Whether ``request`` is ours with this fingerprint; it is spent if so."""
        if not isinstance(request, str) or not isinstance(print_, str):
            return False
        expected = self._ids.get(request)
        if expected is None or not secrets.compare_digest(expected, print_):
            return False
        del self._ids[request]
        return True

    def forget(self, request: str) -> None:
        """The request was answered (or failed): its id can never be confirmed now."""
        self._ids.pop(request, None)
