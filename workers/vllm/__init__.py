"""Running a real vLLM next to jetrouter: its virtual environment, a tiny offline model, and the
engine process (design.md §11: adapters for real engines live under workers/).

Nothing here imports vLLM, torch or transformers at module level: the router's own environment
never has them. `tinymodel` runs inside the vLLM environment (`python -m workers.vllm.tinymodel`).
"""
