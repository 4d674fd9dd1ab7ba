"""Static check of compose.yaml and the deploy/ files it mounts: ``python -m cluster.checkconfig``.

No Docker engine runs in CI, so instead of starting the stack this finds what would break it:
every ``jetrouter <verb> ...`` command line goes through the real CLI parser (with the service's
``JETROUTER_*`` environment, as the container would see it); health checks, published ports, the
HAProxy backends, Prometheus targets and NATS routes must name services and the ports those
services listen on; ``depends_on`` targets and conditions, named volumes and bind-mounted files
must exist; the Dockerfile's ENTRYPOINT must be ``jetrouter``. ``check_compose`` returns one line
per problem (empty = consistent). PyYAML is needed to read the file; without it the CLI skips.

The package, by what each module checks: ``compose.py`` (loading, merging, interpolation, the
services), ``dockerfile.py``, ``haproxy.py``, ``nats.py``, ``jetrouter_services.py`` (the
`jetrouter` command lines), ``stack.py`` (across services: health, ports, volumes, balancer,
monitoring), ``checker.py`` (all of them in order) and ``cli.py``.
"""
