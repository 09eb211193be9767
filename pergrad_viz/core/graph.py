"""Walks of the autograd graph (``t.grad_fn``, ``node.next_functions``) by node identity.

A node's Python object lives only while something references it in some PyTorch versions: 2.11 makes a new one at
each access once the last was let go, 2.14 keeps one with the node. Where it is let go, the next node's object can
take its address, and so its ``id``: a walk that keeps ``id(node)`` of objects it drops confuses nodes (on 2.11 four
layer outputs' nodes read as one, so book-keeping asked autograd for one layer output of four and gave the others
zero norms). Every walk here holds each node it keeps an id of, for as long as it keeps the id.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

V = TypeVar("V")


class NodeMap(Generic[V]):
    """{node: value} by the node's identity, holding each node (so that no other node can take its id)."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[object, V]] = {}

    def __contains__(self, node: object) -> bool:
        return id(node) in self._items

    def __getitem__(self, node: object) -> V:
        return self._items[id(node)][1]

    def __setitem__(self, node: object, value: V) -> None:
        self._items[id(node)] = (node, value)

    def __len__(self) -> int:
        return len(self._items)


class Nodes(NodeMap[None]):
    """A set of autograd nodes by identity, holding each (``None`` is never a member)."""

    def __init__(self, nodes: Iterable[object] = ()) -> None:
        super().__init__()
        for node in nodes:
            self.add(node)

    def add(self, node: object) -> None:
        if node is not None:
            self[node] = None


def walk(roots: Iterable[object], stops: Iterable[object] = ()) -> Iterator[object]:
    """Every node reached from ``roots`` (grad_fns; None skipped) through ``next_functions``, each once, depth
    first, without entering ``stops`` (nodes). The roots themselves come first."""
    stop, seen = Nodes(stops), Nodes()
    stack = [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen or node in stop:
            continue
        seen.add(node)
        yield node
        stack.extend(child for child, _ in node.next_functions)


def children(node: object) -> list[object]:
    """The nodes ``node``'s backward hands gradients to (None skipped)."""
    return [child for child, _ in node.next_functions if child is not None]
