"""Corrupting a replica's state on purpose, to prove divergence detection works end to end.

Not shipped in the product: a test calls :func:`inject_divergence` on a state it holds, or starts
replicas with ``LocalCluster(router_module="tests.divergence_hook")`` — this module's ``main`` is
``jetrouter`` with one more admin route, ``POST /admin/debug/inject-divergence``, handed to
``create_app`` as an extra router.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from api import cli, serve
from api.admin import require_admin
from api.app import AppConfig
from replicas.core.divergence import PARTS
from replicas.core.state import RouterState
from replicas.runtime.replica import Replica

INJECTED = "__injected__"  # worker/request id used by inject_divergence; never a real id


def inject_divergence(state: RouterState, part: str = "index",
                      *, replica_id: str = INJECTED) -> str:
    """Corrupt ``state`` *without* a stream event, so its digest differs from every peer's at
    equal positions.

    ``part`` picks what to corrupt, each invisible to routing:
    - ``index``: one block on a worker key that is never registered (candidates come from the
      registered workers, so it is never routed to);
    - ``load``: one in-flight request owned by ``replica_id`` on an unregistered worker (it stays
      until a ``StateReset``, or a ``ReplicaLost`` for ``replica_id``);
    - ``config``: a health entry for an unregistered worker.
    Each call adds a different item, so repeated injections keep changing the digest. Returns a
    short description. A ``StateReset`` (``POST /admin/reset``) heals every kind.
    """
    if part == "index":
        n = state.index.total_blocks
        block = 0x1D1E_5EED_0000 + n
        state.index.store((INJECTED, 0), None, [(block, block)])
        return f"index: block {block:#x} on unregistered worker {INJECTED}"
    if part == "load":
        request_id = f"{INJECTED}-{len(state.load)}"
        state.load.add(request_id, replica_id, (INJECTED, 0), 1, [], state.now)
        return f"load: request {request_id} owned by {replica_id}"
    if part == "config":
        key = f"{INJECTED}-{len(state.health)}"
        state.health[key] = "unhealthy"
        return f"config: health entry {key}"
    raise ValueError(f"part must be one of {', '.join(PARTS)}, got {part!r}")


def divergence_router(replica: Replica, cfg: AppConfig) -> APIRouter:
    """``POST /admin/debug/inject-divergence`` ``{"part": ...}``, behind the admin token."""
    router = APIRouter()

    @router.post("/admin/debug/inject-divergence")
    async def inject(request: Request) -> JSONResponse:
        require_admin(request, cfg.admin_token)
        body = await request.json() if await request.body() else {}
        part = body.get("part", "index") if isinstance(body, dict) else "index"
        return JSONResponse({"injected": inject_divergence(
            replica.state, part, replica_id=replica.replica_id)})

    return router


def main(argv: Sequence[str] | None = None) -> int:
    """``jetrouter serve ...`` with the divergence route added."""
    args = cli.build_parser(["serve"]).parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return serve.run(args, extra_routers=[divergence_router])
    except cli.CliError as exc:
        print(f"jetrouter {args.verb}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
