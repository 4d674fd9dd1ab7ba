"""Lean HTTP serving pieces shared by the router replica (``api``) and the simulated engine
(``workers``): a short way through the ASGI stack for the inference routes and a streaming
response without Starlette's per-chunk wrappers (``hotpath``), a response's head written with its
body (``head_with_body``), and the event loop runner for processes that own their loop
(``loop``). It imports nothing of ours, so both may use it."""
