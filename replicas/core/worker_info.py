"""What the router knows of one registered engine (a ``WorkerRegistered``), as the state keeps it.

Its own module so that the state (``state.py``) and its snapshot codec (``state_codec.py``) both
use it without importing each other. Pure data.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class WorkerInfo:
    worker_id: str
    url: str
    model: str
    block_size: int
    kv_total_blocks: int
    max_num_batched_tokens: int
    dp_size: int
    registered_ts: float
    loras: list[str] = field(default_factory=list)  # LoRA adapters served besides `model`
    role: str = "both"  # "prefill" | "decode" | "both" (replicas/core/disagg.py)
    engine_kind: str = "jetrouter"  # an EngineKind: the hand-off protocol it speaks
    # An SGLang prefill engine's bootstrap port (0: not given). Not in the digest and not in
    # the worker's snapshot entry (see state_codec.worker_doc): only the hand-off's bytes use it.
    bootstrap_port: int = 0
