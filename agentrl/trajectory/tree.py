"""Per-session message tree: which earlier turn (if any) a new prompt continues.

Each node is one message reached by a path of messages from the root. Response nodes remember the turns
that produced them. A new prompt continues the turn whose response is the *last recorded response* on its
message path; a prompt whose path ends in context only, or rewinds / branches off a response that a later
turn already continued, starts a new sample.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def message_key(message: Mapping[str, Any]) -> tuple:
    """A hashable, order-insensitive key for one chat message (dict-like, JSON-ish values)."""
    if not isinstance(message, Mapping):
        raise TypeError(
            f"a chat message must be a mapping (e.g. {{'role': ..., 'content': ...}}), got {type(message).__name__}"
        )
    return tuple(sorted((str(k), _freeze(v)) for k, v in message.items()))


def _freeze(value: Any) -> Any:
    # Strings stay strings: Python caches their hash, so re-walking a long history each turn stays cheap.
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, Mapping):
        return ("{}", tuple(sorted((str(k), _freeze(v)) for k, v in value.items())))
    if isinstance(value, Sequence) and not isinstance(value, bytes | bytearray):
        return ("[]", tuple(_freeze(v) for v in value))
    return ("repr", repr(value))


class MessageNode:
    __slots__ = ("children", "turns")

    def __init__(self) -> None:
        self.children: dict[tuple, MessageNode] = {}
        self.turns: list[int] = []  # turns whose response_message is this node


class MessageTree:
    """Message paths of one session."""

    __slots__ = ("root",)

    def __init__(self) -> None:
        self.root = MessageNode()

    @staticmethod
    def keys(messages: Sequence[Mapping[str, Any]]) -> list[tuple]:
        if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
            raise TypeError(f"prompt_messages must be a list of chat messages, got {type(messages).__name__}")
        return [message_key(m) for m in messages]

    def last_response_on_path(self, keys: Sequence[tuple]) -> list[int]:
        """Turns that produced the deepest recorded response on the path (empty if none), without mutating."""
        node = self.root
        found: list[int] = []
        for key in keys:
            node = node.children.get(key)
            if node is None:
                break
            if node.turns:
                found = node.turns
        return found

    def add(self, keys: Sequence[tuple], response_key: tuple, turn: int) -> None:
        """Insert the path ``keys + [response_key]`` and record ``turn`` as the producer of its last node."""
        node = self.root
        for key in (*keys, response_key):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = MessageNode()
            node = child
        node.turns.append(turn)
