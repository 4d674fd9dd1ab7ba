"""Operator tooling: local clusters (`up`, `demo`), chaos, config checks, the admin CLI."""
