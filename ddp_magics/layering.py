"""Columns for the nodes of a directed graph with weighted edges: each node's is the longest
weighted path that reaches it (how a trace's steps are laid out in time)."""

from __future__ import annotations


def longest_path(nodes: set, edges: list[tuple[object, object, int]]) -> dict | None:
    """Column of each node: the longest weighted path reaching it; None if the graph has a cycle."""
    incoming = {node: 0 for node in nodes}
    outgoing: dict[object, list[tuple[object, int]]] = {node: [] for node in nodes}
    for source, target, weight in edges:
        if source != target:
            outgoing[source].append((target, weight))
            incoming[target] += 1
    column = {node: 0 for node in nodes}
    ready = [node for node, count in incoming.items() if count == 0]
    placed = 0
    while ready:
        node = ready.pop()
        placed += 1
        for target, weight in outgoing[node]:
            column[target] = max(column[target], column[node] + weight)
            incoming[target] -= 1
            if incoming[target] == 0:
                ready.append(target)
    return column if placed == len(nodes) else None
