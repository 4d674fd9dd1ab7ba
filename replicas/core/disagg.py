"""Disaggregated prefill/decode serving: which engines take which phase, and how each of the two
routing decisions sees a candidate (Dynamo's router guide, "Disaggregated Serving").

Pure: no clock, no I/O, no randomness. When a model has engines registered with role
``prefill``, a request is routed twice:

- the **prefill decision** picks the engine that computes the prompt. It is KV-aware and does
  not track active blocks (a prefill engine hands its blocks over and decodes nothing), so a
  candidate's decode terms are zero and the cost is the prefill term alone: queued prefill plus
  the prompt's blocks the engine does not hold;
- the **decode decision** picks the engine that receives the blocks and generates. It is
  load-aware: the decode blocks dominate, and the prompt's blocks count as the blocks to be
  transferred. The engine's cached prefix lowers that transfer (and shares active blocks) only
  when decode engines reuse transferred blocks they already hold (``assume_kv_reuse``, Dynamo's
  ``--no-router-assume-kv-reuse`` turns it off): then overlap is zero and every block of the
  request is its own, so the choice is by load alone.

An engine registered as ``both`` serves either phase and aggregated requests. Aggregated
requests (and the fallback when no prefill engine can take one) never go to a ``prefill`` engine.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import replace

import xxhash

from eventlog.events import Phase, Role
from replicas.core.selection import Candidate

__all__ = ["AGGREGATED", "DECODE", "DECODE_TRANSFER_WEIGHT", "PHASES", "PREFILL", "ROLES", "Phase",
           "Role", "decode_candidate", "is_disaggregated", "prefill_candidate", "serves",
           "unique_block_hashes"]

ROLES = tuple(Role)
PHASES = tuple(Phase)
# Module globals, not Role.X / Phase.X on the hot path: a member read off its class is a
# descriptor call on Python 3.11.
AGGREGATED, PREFILL, DECODE = Phase.AGGREGATED, Phase.PREFILL, Phase.DECODE
_ROLE_PREFILL, _ROLE_DECODE, _ROLE_BOTH = Role.PREFILL, Role.DECODE, Role.BOTH

_MASK64 = (1 << 64) - 1
# Weight of the blocks a decode engine must receive, in the decode decision's cost (in place of
# the overlap score weight, which prices prefill: a transferred block costs far less than a
# computed one, and counts once more as a block held while decoding).
DECODE_TRANSFER_WEIGHT = 1.0


def serves(role: str, phase: str) -> bool:
    """Whether an engine of ``role`` takes decisions of ``phase`` ("" = aggregated)."""
    if role == _ROLE_BOTH:
        return True
    if phase == PREFILL:
        return role == _ROLE_PREFILL
    return role == _ROLE_DECODE  # decode decisions and aggregated serving both generate


def is_disaggregated(roles: Sequence[str]) -> bool:
    """A model is served disaggregated when at least one of its engines is a prefill engine."""
    return _ROLE_PREFILL in roles


def prefill_candidate(c: Candidate) -> Candidate:
    """The prefill decision's view: active-block tracking off (no decode terms)."""
    return replace(c, active_decode_blocks=0, new_request_blocks=0)


def decode_candidate(c: Candidate, prompt_blocks: int, assume_kv_reuse: bool) -> Candidate:
    """The decode decision's view: a decode engine prefills nothing of its own, so its own
    term is the blocks it must receive; without KV reuse it holds none of them already."""
    if assume_kv_reuse:
        return c
    return replace(c, overlap_blocks=0, tree_size=0, new_request_blocks=prompt_blocks)


def unique_block_hashes(request_id: str, n: int) -> list[int]:
    """Block hashes no other request shares: a decode decision's blocks without KV reuse.
    Derived from the request id (not drawn at random) so every replica computes the same."""
    raw = request_id.encode()
    return [xxhash.xxh3_64_intdigest(struct.pack("<I", i) + raw, seed=0x5EED) & _MASK64
            for i in range(n)]
