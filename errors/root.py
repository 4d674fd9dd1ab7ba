"""The root of every error jetrouter raises on purpose.

Every package may import ``errors`` (the bottom layer: it imports nothing of ours), so the root
lives here. Each package's errors subclass :class:`JetrouterError` and are named for what went
wrong (``AppendFailed``, ``SnapshotCorrupt``, ``NoWorkers``, ...); where callers already catch a
standard exception (``ValueError`` for bad settings, ``KeyError`` for a missing snapshot,
``RuntimeError`` for a failed tool), the class keeps that base too, so ``except JetrouterError``
catches jetrouter's own failures and nothing changes for existing handlers. Pure module: no I/O.
"""

from __future__ import annotations


class JetrouterError(Exception):
    """Something jetrouter detected and reports; the message says what, for a reader."""
