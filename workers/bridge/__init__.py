"""Adapters for real engines: `jetrouter bridge` turns a vLLM or SGLang engine's ZMQ KV events
into jetrouter's ``JR_KV`` events (design.md §11). Imports only ``eventlog`` (and ``workers``)."""
