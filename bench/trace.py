"""Mooncake-format workloads: load a trace, generate one, and turn records into token-id prompts.

A Mooncake record is one request: ``timestamp`` (ms since the trace start), ``input_length`` and
``output_length`` (tokens) and ``hash_ids`` — one id per 512-token block of the prompt, equal ids
meaning equal (reusable) prefix blocks. The traces carry no text, so a replay invents tokens: each
hash id maps to a deterministic run of ``block_tokens`` token ids, which keeps the one property
that matters — requests with equal leading hash ids get equal leading tokens — while shrinking a
512-token block to something a simulated fleet can serve quickly.
"""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import xxhash

# Block size of the Mooncake traces (README of the release): one hash id per 512 prompt tokens.
TRACE_BLOCK_SIZE = 512
DEFAULT_BLOCK_TOKENS = 32
DEFAULT_VOCAB_SIZE = 256
# Relative to the repository root: the shared traces live next to the repo, never inside it.
SHARED_CONVERSATION_TRACE = Path("../shared/traces/mooncake/conversation_trace.jsonl")
_REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request of a Mooncake-format trace (``session``/``turn`` only for generated ones)."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session: int | None = None
    turn: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"timestamp": self.timestamp_ms, "input_length": self.input_length,
                "output_length": self.output_length, "hash_ids": list(self.hash_ids)}


def parse_record(obj: Any) -> TraceRecord:
    if not isinstance(obj, dict):
        raise ValueError("a record must be a JSON object")
    try:
        hash_ids = tuple(int(h) for h in obj["hash_ids"])
        record = TraceRecord(timestamp_ms=float(obj["timestamp"]),
                             input_length=int(obj["input_length"]),
                             output_length=int(obj["output_length"]), hash_ids=hash_ids)
    except KeyError as exc:
        raise ValueError(f"missing field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad field value: {exc}") from None
    if record.input_length < 0 or record.output_length < 0 or record.timestamp_ms < 0:
        raise ValueError("timestamp, input_length and output_length must be >= 0")
    return record


def load_jsonl(path: Path | str) -> list[TraceRecord]:
    """Read a Mooncake JSONL trace; raises ValueError naming the first bad line."""
    records: list[TraceRecord] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                records.append(parse_record(json.loads(line)))
            except ValueError as exc:  # json.JSONDecodeError is a ValueError too
                raise ValueError(f"{path}:{lineno}: {exc}") from None
    # Replay is by arrival time; a stable sort keeps the file order of equal timestamps.
    records.sort(key=lambda r: r.timestamp_ms)
    return records


def default_trace_path(repo_root: Path = _REPO_ROOT) -> Path | None:
    """The shared conversation trace if this checkout sits next to ``shared/``, else None."""
    path = (repo_root / SHARED_CONVERSATION_TRACE).resolve()
    return path if path.is_file() else None


@dataclass(frozen=True, slots=True)
class GeneratorParams:
    """A multi-turn chat workload: sessions pick one of a few system prompts, then each turn
    resends the whole conversation so far plus new blocks (the previous answer and the new user
    message), so the context grows turn by turn and shares prefixes within and across sessions."""

    sessions: int = 64
    turns: int = 4                 # turns per session
    system_prompts: int = 4        # distinct shared system prompts
    system_blocks: int = 6         # 512-token blocks per system prompt
    turn_blocks_min: int = 1       # full blocks a turn adds to the context
    turn_blocks_max: int = 4
    output_min: int = 32           # output_length range, tokens
    output_max: int = 256
    rate: float = 4.0              # mean request arrivals per second (Poisson)
    think_s: float = 4.0           # mean gap between a session's turns (exponential)
    seed: int = 0

    def describe(self) -> dict[str, Any]:
        return asdict(self)


def generate(params: GeneratorParams) -> list[TraceRecord]:
    """Deterministic (by ``seed``) Mooncake-format records, sorted by timestamp."""
    if params.sessions < 0 or params.turns < 1 or params.system_prompts < 1:
        raise ValueError("need sessions >= 0, turns >= 1, system_prompts >= 1")
    if not 1 <= params.turn_blocks_min <= params.turn_blocks_max:
        raise ValueError("need 1 <= turn_blocks_min <= turn_blocks_max")
    if not 0 <= params.output_min <= params.output_max or params.rate <= 0:
        raise ValueError("need 0 <= output_min <= output_max and rate > 0")
    rng = random.Random(params.seed)
    # Ids 0.. are the system prompts' blocks; every other block gets a fresh id from the counter.
    next_id = params.system_prompts * params.system_blocks
    # Sessions start as a Poisson process whose rate makes the overall request rate ``rate``.
    session_rate = params.rate / params.turns
    start = 0.0
    records: list[TraceRecord] = []
    for session in range(params.sessions):
        start += rng.expovariate(session_rate)
        prompt = rng.randrange(params.system_prompts)
        full = list(range(prompt * params.system_blocks, (prompt + 1) * params.system_blocks))
        at = start
        for turn in range(params.turns):
            added = rng.randint(params.turn_blocks_min, params.turn_blocks_max)
            full.extend(range(next_id, next_id + added))
            next_id += added
            # The tail is a partial block unique to this request; the next turn completes it
            # into a full block with new content, i.e. a new id (as in the real traces).
            tail, next_id = next_id, next_id + 1
            tail_tokens = rng.randint(1, TRACE_BLOCK_SIZE - 1)
            records.append(TraceRecord(
                timestamp_ms=float(round(at * 1000.0)),
                input_length=len(full) * TRACE_BLOCK_SIZE + tail_tokens,
                output_length=rng.randint(params.output_min, params.output_max),
                hash_ids=(*full, tail), session=session, turn=turn))
            at += rng.expovariate(1.0 / params.think_s) if params.think_s > 0 else 0.0
    records.sort(key=lambda r: r.timestamp_ms)
    return records


def select(records: Sequence[TraceRecord], *, start_offset_s: float = 0.0,
           max_requests: int | None = None) -> list[TraceRecord]:
    """Skip records before ``start_offset_s`` of trace time, rebase timestamps to start at 0 and
    keep at most ``max_requests``."""
    start_ms = start_offset_s * 1000.0
    kept = [r for r in records if r.timestamp_ms >= start_ms]
    if max_requests is not None:
        kept = kept[:max(0, max_requests)]
    if not kept:
        return []
    base = kept[0].timestamp_ms
    return [replace(r, timestamp_ms=r.timestamp_ms - base) for r in kept]


def describe_records(records: Sequence[TraceRecord]) -> dict[str, Any]:
    """Shape of a workload, printed and stored with every report."""
    if not records:
        return {"requests": 0}
    n = len(records)
    return {
        "requests": n,
        "duration_s": (records[-1].timestamp_ms - records[0].timestamp_ms) / 1000.0,
        "mean_input_length": sum(r.input_length for r in records) / n,
        "mean_output_length": sum(r.output_length for r in records) / n,
        "mean_blocks": sum(len(r.hash_ids) for r in records) / n,
        "unique_blocks": len({h for r in records for h in r.hash_ids}),
    }


class PromptBuilder:
    """Maps trace records to token-id prompts; equal hash-id prefixes give equal token prefixes.

    Hash id ``h`` becomes ``block_tokens`` ids drawn from xxh3 of ``(seed, h)``, so the mapping is
    stable across runs, processes and machines. A partial last block (``input_length`` not a
    multiple of 512) keeps the proportional prefix of its id's run; prompt tokens beyond the last
    hash id's block (not in Mooncake's own traces) become filler unique to the request.
    """

    def __init__(self, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 0) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        if not 2 <= vocab_size <= 2**32:
            raise ValueError("vocab_size must be in 2..2^32")
        self.block_tokens = block_tokens
        self.vocab_size = vocab_size
        self.seed = seed
        self._cache: dict[int, tuple[int, ...]] = {}
        # Bytes per token id: as few as the vocabulary needs (a 256-id vocab uses one byte each).
        self._width, self._fmt = (1, "B") if vocab_size <= 2**8 else (
            (2, "H") if vocab_size <= 2**16 else (4, "I"))

    def _draw(self, key: bytes, count: int) -> list[int]:
        need = count * self._width
        chunks, counter = [], 0
        while need > 0:
            chunks.append(xxhash.xxh3_128_digest(key + counter.to_bytes(4, "little"),
                                                 seed=self.seed))
            need -= 16
            counter += 1
        raw = b"".join(chunks)[:count * self._width]
        return [v % self.vocab_size for v in struct.unpack(f"<{count}{self._fmt}", raw)]

    def block(self, hash_id: int) -> tuple[int, ...]:
        """The token run of one hash id (cached: traces reuse ids heavily)."""
        run = self._cache.get(hash_id)
        if run is None:
            key = b"blk" + hash_id.to_bytes(16, "little", signed=True)
            run = tuple(self._draw(key, self.block_tokens))
            self._cache[hash_id] = run
        return run

    def scaled(self, trace_tokens: int) -> int:
        """Tokens that stand for ``trace_tokens`` trace tokens (rounded up, so never 0 for >0)."""
        return -(-trace_tokens * self.block_tokens // TRACE_BLOCK_SIZE)

    def prompt(self, record: TraceRecord, filler_key: int = 0) -> list[int]:
        ids: list[int] = []
        n = len(record.hash_ids)
        for i, hash_id in enumerate(record.hash_ids):
            if i < n - 1:
                ids.extend(self.block(hash_id))
            else:
                tail = min(max(record.input_length - (n - 1) * TRACE_BLOCK_SIZE, 1),
                           TRACE_BLOCK_SIZE)
                ids.extend(self.block(hash_id)[:self.scaled(tail)])
        excess = record.input_length - n * TRACE_BLOCK_SIZE
        if excess > 0 or not ids:
            key = b"fill" + filler_key.to_bytes(8, "little", signed=True) + struct.pack(
                "<d", record.timestamp_ms)
            ids.extend(self._draw(key, max(self.scaled(excess), 1)))
        return ids


# Ids are drawn this wide for text prompts, then mapped onto the word list (every word used).
TEXT_ID_SPACE = 2**16


def words_of(ids: Sequence[int], words: Sequence[str]) -> str:
    """A text prompt standing for ``ids``: one word per id, space-separated. Equal id prefixes
    give equal text prefixes, so the token ids a real tokenizer makes of them share a prefix too
    (up to the last word boundary)."""
    n = len(words)
    return " ".join(words[i % n] for i in ids)


def iter_jsonl(records: Iterable[TraceRecord]) -> Iterable[str]:
    """Records as JSONL lines (for writing a generated workload to a file)."""
    for r in records:
        yield json.dumps(r.to_json())
