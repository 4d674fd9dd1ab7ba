"""Priority shedding at the door (levels from :mod:`replicas.core.shedding`).

When the fleet has lost capacity (unhealthy or missing engines) and what is left cannot carry the
current load, the lowest tiers are refused first with 503 and a Retry-After, so premium traffic
keeps being served. The level only goes down one step per cool-down (no flapping)."""

from __future__ import annotations

import time

from replicas.core.pressure_columns import PressureRowCache
from replicas.core.shedding import Degrader, decide, retry_after
from replicas.runtime.replica import Replica


class Shedder:
    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.degrader = Degrader()
        self.rows = PressureRowCache()  # at fleet size the pressure is read from columns

    @property
    def level(self) -> int:
        """The degradation level of the last check (``jetrouter_degradation_level``)."""
        return self.degrader.level

    def check(self, model: str, tier: str) -> float | None:
        """None to admit the request, else the Retry-After (seconds) of a shed."""
        t = self.replica.thresholds_for(model).active_decode_blocks_threshold
        pressure = self.rows.pressure(self.replica.state, model,
                                      block_size=self.replica.config.state.block_size,
                                      usable_fraction=t or 1.0)
        if pressure is None:
            return None  # unknown model or no workers: the routing path answers that
        level = self.degrader.update(pressure, time.time())
        return float(retry_after(level)) if decide(level, tier) else None
