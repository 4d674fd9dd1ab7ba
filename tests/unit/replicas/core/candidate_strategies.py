"""Random candidate lists for the selection property tests: engines of one or more dp ranks
each, in a random order, every field of a candidate drawn from the strategy the test gives."""

from __future__ import annotations

from hypothesis import strategies as st

from replicas.core.selection import Candidate

small = st.integers(min_value=0, max_value=40)
load = st.one_of(st.integers(min_value=0, max_value=5000),
                 st.floats(min_value=0, max_value=5000, allow_nan=False, width=32))


@st.composite
def candidate_lists(draw: st.DrawFn, *, workers: st.SearchStrategy[int],
                    ranks: st.SearchStrategy[int], tree_size: st.SearchStrategy[int],
                    active_prefill_tokens: st.SearchStrategy[float],
                    active_decode_blocks: st.SearchStrategy[float],
                    kv_total_blocks: st.SearchStrategy[int],
                    max_num_batched_tokens: st.SearchStrategy[int],
                    weight: st.SearchStrategy[float]) -> list[Candidate]:
    """``workers`` engines ``w00``.. of ``ranks`` dp ranks each (drawn per engine), overlaps and
    new request blocks from ``small``, shuffled."""
    rows = []
    for w in range(draw(workers)):
        for rank in range(draw(ranks)):
            rows.append(Candidate(
                worker=(f"w{w:02d}", rank),
                overlap_blocks=draw(small),
                tree_size=draw(tree_size),
                active_prefill_tokens=draw(active_prefill_tokens),
                active_decode_blocks=draw(active_decode_blocks),
                new_request_blocks=draw(small),
                kv_total_blocks=draw(kv_total_blocks),
                max_num_batched_tokens=draw(max_num_batched_tokens),
                weight=draw(weight),
            ))
    order = draw(st.permutations(range(len(rows))))
    return [rows[i] for i in order]
