"""Static check of compose.yaml and the deploy/ files it mounts: ``python -m cluster.checkconfig``.

Also `jetrouter check-config`. One line per problem on stdout, a summary on stderr.
"""

from __future__ import annotations

import argparse
import sys

from cluster.checkconfig.checker import check_compose, required_variables
from cluster.checkconfig.compose import YamlUnavailable


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of a `jetrouter check-config` verb (api/cli.py VERBS entry, if the lead adds one)."""
    parser.add_argument("compose", nargs="?", default="compose.yaml",
                        help="compose file; deploy/ files are found through its mounts")
    parser.add_argument("overrides", nargs="*", default=[],
                        help="override files merged over it, as `docker compose -f A -f B` "
                             "(e.g. compose.secure.yaml)")


def run(args: argparse.Namespace) -> int:
    """Print one line per problem; exit status 1 if any, 0 if consistent or PyYAML is missing."""
    try:
        problems = check_compose(args.compose, overrides=tuple(args.overrides))
    except YamlUnavailable as exc:
        print(f"checkconfig: skipped, {exc}")
        return 0
    for line in problems:
        print(line)
    required = required_variables(args.compose)
    print(f"checkconfig: {' + '.join([args.compose, *args.overrides])}: "
          + (f"{len(problems)} problem(s)" if problems else "ok")
          + (f" (to start it, set {', '.join(required)})" if required else ""), file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.checkconfig",
                                     description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
