"""Format versions of what jetrouter stores, and the promise around them (design.md §3, §8).

Pure module: no I/O. Two things outlive the process that wrote them and are read by other
releases during a rolling upgrade or after a rollback:

* **stream messages** — one batch of events each (``eventlog.events``). A message in a format
  after 1 says so in its ``Jr-Format`` header, once per message and never per event; a message
  without the header is format 1, the batch as every release so far has written it. Format 1 is
  left unmarked on purpose: a header line costs every reader about a microsecond per message
  to parse (nats-py's header parser), and a replica reads every message of every stream.
* **snapshots** — the encoded ``RouterState``. Its format travels inside the blob (the state's
  own ``format`` field) and, so that a reader can judge a snapshot before fetching it, in the
  snapshot's object meta (``snapshots.store.SnapshotMeta.format``).

The promise: a release reads its own format and the one before it, and refuses a newer one
with :class:`NewerFormat` instead of guessing. A replica that meets a newer message stops
applying that stream where it is (its state stays exactly what its peers held at that
position), says so in its log, ``/ready``, ``/admin/state`` and metrics, and waits to be
upgraded; it never skips the message, since skipping would diverge from every replica that
applied it.

A writer marks each message with the *oldest* format that can carry it: the format that
introduced the newest event type in it (``INTRODUCED_IN``; types absent from it belong to
format 1). So during a rolling upgrade the replicas not yet upgraded keep applying everything
the new ones write, until an event only the new release knows is actually used.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from errors.root import JetrouterError
from eventlog import events as ev

FORMAT_HEADER = "Jr-Format"

# The newest event-message format this code writes and reads.
EVENT_FORMAT = 3
# The oldest it reads. Every format so far only added event types (INTRODUCED_IN), so an older
# format's messages are made of types this release still applies the same way, and most
# messages of every release are format 1. A release that changes or drops a type raises this.
OLDEST_EVENT_FORMAT = 1

# Event types added after format 1, with the format that added them. A release that adds an
# event type raises EVENT_FORMAT by one and lists the type here with the new number.
INTRODUCED_IN: dict[type, int] = {
    ev.ResponseStored: 2,  # the Responses API's stored-response affinity
    ev.TenantLimitsSet: 2,  # tenants' fleet-wide limits
    ev.TenantDeleted: 2,
    ev.ApiKeySet: 3,  # API keys managed through the admin API, as SHA-256 digests
    ev.ApiKeyRevoked: 3,
}


def event_format(event: object) -> int:
    """The format that introduced ``event``'s type (1 for the types every release reads)."""
    return INTRODUCED_IN.get(type(event), 1) if INTRODUCED_IN else 1

class NewerFormat(JetrouterError):
    """Stored data in a format newer than this release reads: stop, do not skip or guess."""

    def __init__(self, what: str, found: int, newest: int) -> None:
        super().__init__(f"{what} is in format {found}, written by a newer jetrouter release; "
                         f"this release reads formats up to {newest}: upgrade this process")
        self.what = what
        self.found = found
        self.newest = newest


class UnknownFormat(JetrouterError, ValueError):
    """A format marking that is not a version at all, or older than this release reads."""


def message_format(events: Iterable[object]) -> int:
    """The oldest format that can carry ``events`` (1 unless a later-introduced type is in it)."""
    if not INTRODUCED_IN:  # nothing added since format 1: no per-event work on the hot path
        return 1
    return max((INTRODUCED_IN.get(type(e), 1) for e in events), default=1)


def format_headers(events: Iterable[object]) -> dict[str, str] | None:
    """The header that marks a message of ``events`` with its format; None for format 1, which
    is never marked (see the module docstring)."""
    return headers_for(message_format(events))


def headers_for(fmt: int) -> dict[str, str] | None:
    """The header of a message whose format is already known (None for format 1)."""
    return None if fmt == 1 else {FORMAT_HEADER: str(fmt)}

def check_message(headers: Mapping[str, str] | None, stream: str, seq: int) -> int:
    """The format of message ``seq`` of ``stream`` from its headers. Raises
    :class:`NewerFormat` for a format this release cannot read and :class:`UnknownFormat` for a
    marking that is no version, or one older than :data:`OLDEST_EVENT_FORMAT`. Called once per
    message read: the common case is one dict lookup and one comparison."""
    value = headers.get(FORMAT_HEADER) if headers else None
    if value is None or value == "1":  # unmarked (written before formats were) or format 1
        fmt = 1
    else:
        try:
            fmt = int(value)
        except (TypeError, ValueError):
            raise UnknownFormat(f"stream {stream} seq {seq}: {FORMAT_HEADER} {value!r} is not "
                                "a version") from None
    if fmt > EVENT_FORMAT:
        raise NewerFormat(f"stream {stream} seq {seq}", fmt, EVENT_FORMAT)
    if fmt < OLDEST_EVENT_FORMAT:
        raise UnknownFormat(f"stream {stream} seq {seq}: format {fmt} is older than this "
                            f"release reads ({OLDEST_EVENT_FORMAT}..{EVENT_FORMAT})")
    return fmt
