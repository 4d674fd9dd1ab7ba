"""What one forward pass of the simulated engine costs (pure: no clock, no I/O).

The engine's scheduler (:mod:`workers.scheduler`) plans a step, then asks :func:`step_ms` how
long it takes; the driver (:mod:`workers.engine`) makes wall-clock time follow it, divided by
``--speedup-ratio``. Two models, chosen by ``--perf-model``:

``polynomial`` (default) is the cost model of NVIDIA Dynamo's mocker engine, its default
"polynomial" performance model (``lib/mocker`` in the Dynamo repository, read for its formulas;
they are fits the mocker's authors made to a real engine's prefill and decode times). With it our
engine at ``--speedup-ratio 1`` spends what the mocker spends at speedup 1, so a router
comparison against Dynamo-with-mocker compares routers, not engine models:

* **prefill**: a step that computes ``T`` uncached prompt tokens (every prefill chunk of the step
  together: the GPU processes them as one batch) costs
  ``PREFILL_A·T² + PREFILL_B·T + PREFILL_C`` ms = ``4.209989e-7·T² + 1.518344e-2·T + 16.50142``
  ms, 0 when ``T = 0``. Cached prefix tokens are never scheduled, so they cost nothing. A
  768-token prompt costs 28.4 ms, a full 8,192-token chunk 169 ms (≈ 48k tokens/s).
* **decode**: a step in which at least one request emits a token costs
  ``max(1, DECODE_A·u² + DECODE_B·u + DECODE_C)`` ms = ``max(1, -25.74·u² + 54.01·u + 5.74)`` ms,
  where ``u = min(1, active KV tokens / KV capacity in tokens)``: the share of the cache pinned
  by running requests (distinct blocks times block size), not the batch size. 5.7 ms on an empty
  cache, 11 ms at 10 %, 34 ms full.
* a step that does both pays the sum (the mocker runs a prefill phase, then a decode phase in
  which every request whose prompt is complete, including one whose prefill ended in this step,
  emits a token); a step that only computes a prefill chunk pays no decode.

``linear`` is this engine's earlier model, kept for the routing simulations and notes measured
with it: every step costs ``decode_ms_base`` (8 ms) + ``decode_ms_per_seq`` (0.05 ms) per
decoding request + ``prefill_ms_per_token`` (0.05 ms: 20k tokens/s) per uncached prompt token.
Its prefill is 3.3x slower per token than the polynomial's and every step pays the 8 ms base,
so on prefill-heavy traces (the Mooncake conversations) queues, and TTFT tails, grow faster.
"""

from __future__ import annotations

POLYNOMIAL = "polynomial"
LINEAR = "linear"
PERF_MODELS = (POLYNOMIAL, LINEAR)

# Dynamo mocker's polynomial model (milliseconds).
PREFILL_A = 4.209989e-07
PREFILL_B = 1.518344e-02
PREFILL_C = 1.650142e01
DECODE_A = -25.74
DECODE_B = 54.01
DECODE_C = 5.74
DECODE_MIN_MS = 1.0


def polynomial_prefill_ms(tokens: int) -> float:
    """Prefill of ``tokens`` uncached prompt tokens in one step, in milliseconds."""
    if tokens <= 0:
        return 0.0
    return PREFILL_A * tokens * tokens + PREFILL_B * tokens + PREFILL_C


def polynomial_decode_ms(active_tokens: int, capacity_tokens: int) -> float:
    """One decode pass with ``active_tokens`` of ``capacity_tokens`` KV tokens pinned, in ms."""
    usage = min(1.0, active_tokens / capacity_tokens) if capacity_tokens > 0 else 1.0
    return max(DECODE_MIN_MS, DECODE_A * usage * usage + DECODE_B * usage + DECODE_C)


def linear_step_ms(prefill_tokens: int, decode_seqs: int, *, prefill_ms_per_token: float,
                   decode_ms_base: float, decode_ms_per_seq: float) -> float:
    """The linear model's step: a base every step, plus per decoding request and per token."""
    return decode_ms_base + decode_ms_per_seq * decode_seqs + prefill_ms_per_token * prefill_tokens
