"""The pure, deterministic core: no I/O, no clock, no randomness of its own."""
