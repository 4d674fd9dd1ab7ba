"""Where a bridge is, kept in the headers of the messages it appends: exactly-once across
bridge restarts without local state.

Every message the bridge appends to ``<ns>.kv.<worker_id>`` carries headers saying where it is:
``Jr-Bridge-Gen`` (a token naming one run of one engine), ``Jr-Engine-Seq`` (the engine's ZMQ
sequence number of the batch it holds), ``Jr-Event-Id`` (the last ``event_id`` in it),
``Jr-Block-Size`` and ``Jr-Engine-Start`` (the engine's ``process_start_time_seconds``, when
``/metrics`` reports it). The message id is ``<worker_id>.<gen>.<first seq>-<last seq>`` for the
engine batches it carries. A (re)started bridge reads the *last* message on its subject
(JetStream get-last-by-subject):

* same engine (same start time, or none reported) and not a retirement -> it resumes: the next
  ``event_id`` follows the header's, and the engine's replay socket is asked for every batch after
  ``seq``. A batch that was appended but whose ack was lost is re-sent with the same events and
  ``event_id``s (translation is deterministic): the stream's duplicate window drops an identical
  message, and replicas/core/state.py drops events whose ``event_id`` it has already applied.
* otherwise (nothing yet, a retirement, another engine run) -> a new ``gen``, a fresh
  ``WorkerRegistered`` (which empties the worker's index on every replica), and a replay from
  seq 0 to learn what the engine cached before the bridge started.

``event_id`` keeps increasing across bridge restarts (it resumes from the header), so a restart is
neither a gap nor a duplicate for replicas/core/state.py.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from eventlog.events import MalformedMessage, WorkerRetired, decode_batch

H_GEN = "Jr-Bridge-Gen"
H_SEQ = "Jr-Engine-Seq"
H_EVENT_ID = "Jr-Event-Id"
H_BLOCK_SIZE = "Jr-Block-Size"
H_START = "Jr-Engine-Start"


@dataclass(frozen=True, slots=True)
class ResumePoint:
    gen: str
    seq: int
    event_id: int
    block_size: int
    engine_start: float | None


def resume_point(headers: dict[str, str] | None, data: bytes) -> ResumePoint | None:
    """Where a previous bridge left off, from the last message on the subject (None: start
    afresh — nothing there, not a bridge message, or the worker was retired)."""
    if not headers or H_GEN not in headers:
        return None
    try:
        events = decode_batch(data)
    except MalformedMessage:
        return None
    if any(isinstance(e, WorkerRetired) for e in events):
        return None
    try:
        start = headers.get(H_START) or ""
        return ResumePoint(gen=headers[H_GEN], seq=int(headers[H_SEQ]),
                           event_id=int(headers[H_EVENT_ID]),
                           block_size=int(headers[H_BLOCK_SIZE]),
                           engine_start=float(start) if start else None)
    except (KeyError, ValueError):
        return None


def new_gen() -> str:
    """A token naming one run of one engine as this bridge sees it."""
    return uuid.uuid4().hex[:12]


def position_headers(gen: str, seq: int, event_id: int, block_size: int,
                     engine_start: float | None) -> dict[str, str]:
    """The headers of a message whose last batch is engine ``seq`` and last event ``event_id``."""
    return {H_GEN: gen, H_SEQ: str(seq), H_EVENT_ID: str(event_id),
            H_BLOCK_SIZE: str(block_size), H_START: "" if engine_start is None
            else repr(engine_start)}
