"""Create-or-update the three jetrouter streams, idempotently (design.md §2).

Every process calls :func:`ensure_streams` at start-up, possibly at the same moment: a create
with the exact same config succeeds on an existing stream, and a stream that already exists keeps
its replica count unless one is asked for explicitly. Streams use file storage, a duplicate
window (publishers set ``Nats-Msg-Id``), and no age limit: only an explicit purge after a
snapshot removes events, never a silent expiry. A size limit (``max_bytes``) is optional; with
the "discard new" policy a full stream refuses appends rather than dropping old events.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, StorageType, StreamConfig, StreamInfo
from nats.js.errors import APIError, NotFoundError

from errors.root import JetrouterError
from eventlog.names import STREAM_KINDS, Names

API_ANSWER_WAIT = 30.0
"""Seconds a stream lookup, creation or update keeps asking a cluster that does not answer: one
whose JetStream meta leader is still being elected (just started, or a member still starting)
times requests out rather than refusing them."""

log = logging.getLogger(__name__)
T = TypeVar("T")
_SAY_EVERY = 5.0

MAX_REPLICAS = 5
CLUSTER_REPLICAS_FLOOR = 3  # the fewest replicas a clustered server is guessed to take
# Per NATS connection: the replica count a guessed creation had to step down to.
_placed: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()

# JetStream API error codes (nats-server errors.json) that mean "this replica count cannot be
# placed here": single server, too few peers, not enough resources.
_ERR_NOT_CLUSTERED = 10074
_ERR_NO_PEERS = 10005
_ERR_INSUFFICIENT_RESOURCES = 10023
_PLACEMENT_ERRORS = {_ERR_NOT_CLUSTERED, _ERR_NO_PEERS, _ERR_INSUFFICIENT_RESOURCES}
_ERR_NAME_IN_USE = 10058


class StreamConfigConflict(JetrouterError, RuntimeError):
    """An existing stream has a config that cannot be updated in place (e.g. memory storage)."""


def cluster_size_hint(js: JetStreamContext) -> int:
    """How many replicas to give a new stream: 1 on a server outside a cluster, else the
    member count the server gossiped at connect time (``connect_urls``), at least 3, at most 5;
    never more than a creation on this connection could place before.

    The count is a first guess only: creation steps down when the server says it cannot be
    placed (see :func:`create_placed`). It is never below 3 on a cluster because a cluster that
    is still forming gossips fewer members than it will have (a client connected to a node that
    has a route to one peer so far hears of two), and a stream created then would stay under-
    replicated for good. A cluster with a member down at first start pays one placement wait
    per process, not one per stream: what was placed is remembered for the connection.
    """
    nc = getattr(js, "_nc", None)
    info = getattr(nc, "_server_info", None) or {}
    guess = replicas_for_server(info)
    placed = _placed.get(nc) if nc is not None else None
    return guess if placed is None else min(guess, placed)


def replicas_for_server(info: Mapping[str, object]) -> int:
    """:func:`cluster_size_hint` from a server's INFO."""
    if not info.get("cluster"):
        return 1
    urls = info.get("connect_urls")
    members = len(urls) if isinstance(urls, list) else 0
    return min(MAX_REPLICAS, max(CLUSTER_REPLICAS_FLOOR, members))


def _wanted_config(names: Names, kind: str, replicas: int, duplicate_window: float,
                   max_bytes: int | None) -> StreamConfig:
    return StreamConfig(
        name=names.stream(kind),
        subjects=[names.subjects(kind)],
        storage=StorageType.FILE,
        num_replicas=replicas,
        duplicate_window=duplicate_window,
        # A full stream refuses the append (the writer sees it) instead of silently dropping
        # its oldest events, which replicas and snapshots may still need
        # (docs/decisions/0024-stream-limits-discard-new.md).
        discard=DiscardPolicy.NEW,
        max_bytes=max_bytes if max_bytes is not None else -1,
    )


async def _create(
    js: JetStreamContext, config: StreamConfig, *, step_down: bool, placement_wait: float
) -> StreamInfo:
    """Create with ``config.num_replicas``, as :func:`create_placed` places it.

    A create nobody answers is asked again (the meta leader may not be elected yet), but the
    stream is also looked up in between: a process whose NATS identity may not create streams
    (an engine of `jetrouter up --secure`, which may only look its stream up) gets no answer at
    all — the server drops a request on a subject it may not publish to — and would otherwise
    wait out :data:`API_ANSWER_WAIT` after a replica created the stream."""
    name = config.name
    assert name is not None

    async def exists_now() -> StreamInfo | None:
        try:
            return await js.stream_info(name)
        except (NotFoundError, NatsTimeoutError):
            return None

    return await create_placed(
        js, lambda replicas: js.add_stream(config.evolve(num_replicas=replicas)),
        config.num_replicas or 1, what=f"stream {config.name}", step_down=step_down,
        placement_wait=placement_wait, exists=exists_now)


async def answered(call: Callable[[], Awaitable[T]], *, what: str,
                   wait: float = API_ANSWER_WAIT,
                   meanwhile: Callable[[], Awaitable[T | None]] | None = None) -> T:
    """``call()``, an idempotent JetStream API request, asked again while the cluster does not
    answer it, for up to ``wait`` seconds. No pause in between: each unanswered attempt has
    already waited out the request's own timeout. ``meanwhile()``, after each unanswered
    attempt, may find the request's result another way (not None: it is returned)."""
    start = time.monotonic()
    deadline = start + wait
    said = 0.0  # when the last warning was logged: one every _SAY_EVERY seconds, not per attempt
    while True:
        try:
            return await call()
        except NatsTimeoutError:
            if meanwhile is not None:
                found = await meanwhile()
                if found is not None:
                    return found
            now = time.monotonic()
            if now >= deadline:
                raise
            if not said or now - said >= _SAY_EVERY:
                said = now
                log.warning("%s: no answer from JetStream for %.1f s (meta leader not elected "
                            "yet?); asking again for up to %.0f s", what, now - start, wait)


async def lookup_stream(js: JetStreamContext, name: str) -> StreamInfo:
    """``js.stream_info(name)``, :func:`answered`: NotFoundError when it does not exist."""
    return await answered(lambda: js.stream_info(name), what=f"lookup of stream {name}")


async def create_placed(
    js: JetStreamContext, create: Callable[[int], Awaitable[T]], wanted: int, *, what: str,
    step_down: bool, placement_wait: float = 5.0,
    exists: Callable[[], Awaitable[T | None]] | None = None,
) -> T:
    """``create(replicas)`` with ``wanted`` replicas (a stream, or a key-value bucket's). A
    cluster that cannot place that many yet (peers still joining) is given ``placement_wait``
    seconds; after that, and only when the count was our guess (``step_down``), one replica
    fewer is tried, down to 1, and the count placed caps :func:`cluster_size_hint` for ``js``'s
    connection from then on. ``exists()``: what was to be created, if it exists by now (looked
    up whenever a create goes unanswered)."""
    replicas = wanted
    # The wait starts at the first refusal to place, not at the first attempt: attempts that
    # went unanswered (no meta leader yet) are not time the cluster had to place anything, and a
    # cluster whose members join one by one once a quorum forms would otherwise get a stream one
    # replica short, for good.
    deadline: float | None = None
    delay = 0.05
    while True:
        try:
            # Creating an identical stream again is a no-op, so an unanswered create is repeated.
            created = await answered(lambda n=replicas: create(n), what=f"creation of {what}",
                                     meanwhile=exists)
        except APIError as exc:
            if exc.err_code not in _PLACEMENT_ERRORS or replicas == 1:
                raise
            if deadline is None:
                deadline = time.monotonic() + placement_wait
            if exc.err_code == _ERR_NOT_CLUSTERED and step_down:
                replicas = 1
            elif time.monotonic() < deadline:
                await asyncio.sleep(delay)  # backoff between API calls, not synchronisation
                delay = min(delay * 2, 0.5)
            elif step_down:
                replicas -= 1
                deadline = time.monotonic() + placement_wait
            else:
                raise
            continue
        if replicas != wanted:
            log.warning("%s created with %d replicas (%d could not be placed)", what, replicas,
                        wanted)
            nc = getattr(js, "_nc", None)
            if nc is not None:
                _placed[nc] = replicas
        return created


def _differences(have: StreamConfig, want: StreamConfig, check_replicas: bool,
                 check_max_bytes: bool = False) -> list[str]:
    diffs = []
    if have.discard != DiscardPolicy.NEW:
        diffs.append(f"discard {have.discard} -> {DiscardPolicy.NEW}")
    if check_max_bytes and (have.max_bytes or -1) != want.max_bytes:
        diffs.append(f"max_bytes {have.max_bytes} -> {want.max_bytes}")
    if sorted(have.subjects or []) != sorted(want.subjects or []):
        diffs.append(f"subjects {have.subjects} -> {want.subjects}")
    if abs((have.duplicate_window or 0.0) - (want.duplicate_window or 0.0)) > 1e-6:
        diffs.append(f"duplicate_window {have.duplicate_window} -> {want.duplicate_window}")
    if check_replicas and (have.num_replicas or 1) != want.num_replicas:
        diffs.append(f"replicas {have.num_replicas} -> {want.num_replicas}")
    return diffs


async def _reconcile(
    js: JetStreamContext, info: StreamInfo, want: StreamConfig, check_replicas: bool,
    check_max_bytes: bool = False,
) -> StreamInfo:
    """Update an existing stream to ``want`` where it differs; a no-op when it already matches."""
    have = info.config
    if have.storage not in (None, StorageType.FILE):
        raise StreamConfigConflict(
            f"stream {have.name} uses {have.storage} storage, jetrouter needs file storage: "
            "delete it (losing its events) or use another --namespace"
        )
    diffs = _differences(have, want, check_replicas, check_max_bytes)
    if not diffs:
        return info
    log.info("updating stream %s: %s", have.name, "; ".join(diffs))
    updated = have.evolve(
        subjects=want.subjects,
        duplicate_window=want.duplicate_window,
        num_replicas=want.num_replicas if check_replicas else have.num_replicas,
        discard=DiscardPolicy.NEW,
        max_bytes=want.max_bytes if check_max_bytes else have.max_bytes,
    )
    return await answered(lambda: js.update_stream(updated), what=f"update of stream {have.name}")


async def ensure_stream(
    js: JetStreamContext,
    config: StreamConfig,
    *,
    replicas_given: bool,
    placement_wait: float = 5.0,
    max_bytes_given: bool = False,
) -> StreamInfo:
    """Create ``config.name`` or bring the existing stream in line with ``config``."""
    name = config.name
    assert name is not None
    try:
        info = await lookup_stream(js, name)
    except NotFoundError:
        try:
            return await _create(
                js, config, step_down=not replicas_given, placement_wait=placement_wait
            )
        except APIError as exc:
            if exc.err_code != _ERR_NAME_IN_USE:
                raise
            # Another process created it between our lookup and our create: reconcile with it.
            info = await lookup_stream(js, name)
    return await _reconcile(js, info, config, replicas_given, max_bytes_given)


async def ensure_streams(
    js: JetStreamContext,
    names: Names,
    *,
    replicas: int | None = None,
    duplicate_window: float = 120.0,
    max_bytes: int | None = None,
    kinds: tuple[str, ...] = STREAM_KINDS,
) -> dict[str, StreamInfo]:
    """Create or update the KV, router and control streams (or only ``kinds``: an engine needs
    just the KV stream, and its NATS identity may see no other); returns ``{stream name: info}``.

    ``replicas`` defaults to the JetStream cluster size (1 on a single server, 3 on three,
    at most 5); an existing stream keeps its replica count unless ``replicas`` is given.
    ``max_bytes`` (per stream; -1 unlimited) likewise: an existing stream keeps its limit unless
    one is given, so processes started without the flag never undo it. Every stream discards
    *new* messages when a limit is reached: the append fails and its writer knows.
    """
    if replicas is not None and not 1 <= replicas <= MAX_REPLICAS:
        raise ValueError(f"replicas must be between 1 and {MAX_REPLICAS}, got {replicas}")
    count = replicas if replicas is not None else cluster_size_hint(js)
    result: dict[str, StreamInfo] = {}
    for kind in kinds:
        config = _wanted_config(names, kind, count, duplicate_window, max_bytes)
        info = await ensure_stream(js, config, replicas_given=replicas is not None,
                                   max_bytes_given=max_bytes is not None)
        result[names.stream(kind)] = info
    return result


async def recreate_stream(js: JetStreamContext, names: Names, kind: str, first_seq: int, *,
                          duplicate_window: float = 120.0, max_bytes: int | None = None
                          ) -> tuple[StreamInfo, bool]:
    """Create stream ``kind`` again after NATS lost it (its storage gone), numbering from
    ``first_seq``: a replica that applied sequences up to ``first_seq - 1`` of the lost stream
    must never see those numbers reused for other events. Returns ``(info, created here)``;
    when another process created it first, its info as it is (its first sequence may differ)."""
    config = _wanted_config(names, kind, cluster_size_hint(js), duplicate_window, max_bytes)
    try:
        info = await _create(js, config.evolve(first_seq=first_seq), step_down=True,
                             placement_wait=5.0)
        return info, True
    except APIError as exc:
        if exc.err_code != _ERR_NAME_IN_USE:
            raise
    return await lookup_stream(js, names.stream(kind)), False


async def stream_bounds(js: JetStreamContext, stream: str) -> tuple[int, int]:
    """``(first_seq, last_seq)`` of ``stream``; an empty stream has ``first_seq == last_seq + 1``
    once it has held messages, and ``(0, 0)`` before that."""
    state = (await js.stream_info(stream)).state
    return state.first_seq, state.last_seq
