"""Per-session message tree: which earlier turn (if any) a new prompt continues.

Each node is one message reached by a path of messages from the root. Response nodes remember the turns
that produced them. A new prompt continues the turn whose response is the *last recorded response* on its
message path; a prompt whose path ends in context only, or rewinds / branches off a response that a later
turn already continued, starts a new sample.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import methodcaller
from typing import Any

_CONTENT = methodcaller("get", "content")


def message_key(message: Mapping[str, Any]) -> tuple:
    """A hashable, order-insensitive key for one chat message (dict-like, JSON-ish values)."""
    if type(message) is not dict and not isinstance(message, Mapping):
        raise TypeError(
            f"a chat message must be a mapping (e.g. {{'role': ..., 'content': ...}}), got {type(message).__name__}"
        )
    items = tuple(message.items())
    # Fast path for the common flat message ({"role": str, "content": str | None}).
    if all(type(k) is str and (v is None or type(v) is str) for k, v in items):
        return tuple(sorted(items))
    return tuple(sorted((str(k), _freeze(v)) for k, v in items))


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


class MessagePath:
    """A located message path: its keys and the nodes that already exist along it."""

    __slots__ = ("messages", "contents", "keys", "nodes", "producers")

    def __init__(
        self,
        messages: list,
        contents: list,
        keys: list[tuple],
        nodes: list[MessageNode],
        producers: list[int],
    ) -> None:
        self.messages = messages
        self.contents = contents  # each message's content object, to notice a replaced content later
        self.keys = keys
        self.nodes = nodes  # nodes[i] is the node of messages[i], for the prefix that exists in the tree
        self.producers = producers  # turns that produced the deepest recorded response on the path


class MessageTree:
    """Message paths of one session.

    An agent loop sends the same growing history every turn, so the tree remembers the last path it
    added and reuses its keys and nodes for the leading messages that are the very same objects with an
    unchanged ``content``; only new messages are keyed. Messages are expected not to be edited in
    place after they were sent (if one is, the token guard still decides every extension).
    """

    __slots__ = ("root", "_last")

    def __init__(self) -> None:
        self.root = MessageNode()
        self._last: tuple[list, list, list[tuple], list[MessageNode]] = ([], [], [], [])

    def locate(self, messages: Sequence[Mapping[str, Any]]) -> MessagePath:
        """Validate and key ``messages`` and find how much of the path exists, without mutating the tree."""
        if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
            raise TypeError(f"prompt_messages must be a list of chat messages, got {type(messages).__name__}")
        messages = list(messages)
        last_messages, last_contents, last_keys, last_nodes = self._last
        limit = min(len(messages), len(last_nodes))
        head = messages[:limit]
        # The very same objects were validated when they were first keyed. Common case first, in C:
        # the whole shared head is the same objects with the same contents.
        if (
            list(map(id, head)) == list(map(id, last_messages[:limit]))
            and list(map(_CONTENT, head)) == last_contents[:limit]
        ):
            reuse = limit
        else:
            reuse = 0
            while (
                reuse < limit
                and messages[reuse] is last_messages[reuse]
                and messages[reuse].get("content") == last_contents[reuse]
            ):
                reuse += 1
        keys = last_keys[:reuse] + [message_key(m) for m in messages[reuse:]]  # message_key validates
        nodes = last_nodes[:reuse]
        node = nodes[-1] if nodes else self.root
        for key in keys[reuse:]:
            node = node.children.get(key)
            if node is None:
                break
            nodes.append(node)
        producers: list[int] = []
        for node in reversed(nodes):
            if node.turns:
                producers = node.turns
                break
        contents = last_contents[:reuse] + [m.get("content") for m in messages[reuse:]]
        return MessagePath(messages, contents, keys, nodes, producers)

    def add(self, path: MessagePath, response: Mapping[str, Any], response_key: tuple, turn: int) -> None:
        """Insert ``path + [response]`` and record ``turn`` as the producer of its last node."""
        nodes = list(path.nodes)
        node = nodes[-1] if nodes else self.root
        for key in (*path.keys[len(nodes) :], response_key):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = MessageNode()
            node = child
            nodes.append(node)
        node.turns.append(turn)
        self._last = (
            [*path.messages, response],
            [*path.contents, response.get("content")],
            [*path.keys, response_key],
            nodes,
        )
