"""Lean HTTP serving pieces shared by the router replica (``api``) and the simulated engine
(``workers``): a short way through the ASGI stack for the inference routes and a streaming
response without Starlette's per-chunk wrappers. It imports nothing of ours, so both may use
it."""
