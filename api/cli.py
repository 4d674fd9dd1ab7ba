"""`jetrouter` command line: one verb per module, flags named as in the seeds (design.md §10).

Each verb lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
this file only wires them up. Every ``--some-flag`` is also settable as ``JETROUTER_SOME_FLAG``
in the environment (flags on the command line win): the process verbs (`serve`, `worker`,
`bridge`, `up`) declare their options once in settings/flags.py terms, the tooling verbs get
the same treatment from :func:`apply_env_defaults`. Every user error — a bad flag, a bad
variable, a :class:`CliError` raised by a verb — is one line ``jetrouter VERB: error: ...`` on
stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from settings.flags import TRUE_WORDS, CliError, OneLineParser, env_name

__all__ = ["VERBS", "CliError", "build_parser", "env_name", "main"]

# verb -> (module, help). Modules are imported lazily so `jetrouter worker` never loads FastAPI
# routing code it does not need, and a broken verb cannot break the others.
VERBS: dict[str, tuple[str, str]] = {
    "serve": ("api.serve", "run one router replica"),
    "worker": ("workers.cli", "run one simulated inference engine"),
    "bridge": ("workers.bridge.cli", "put one real engine (vLLM, SGLang) behind jetrouter"),
    "up": ("cluster.up", "run a whole local cluster (nats-server, replicas, workers)"),
    "bench": ("bench.cli", "benchmarks: `bench core` (state machine) or a trace replay"),
    "demo": ("bench.demo",
             "start a local cluster, replay a trace slice in kv and round-robin mode"),
    "admin": ("cluster.admin_cli", "admin API client"),
    "check-config": ("cluster.checkconfig.cli", "check compose.yaml and deploy/ for consistency"),
    "chaos": ("cluster.chaos", "run the chaos scenarios against a local cluster"),
}


def apply_env_defaults(parser: argparse.ArgumentParser) -> None:
    """Let JETROUTER_<FLAG> set the default of each long option of a tooling verb (`bench`,
    `admin`, ...); the process verbs' options come from settings/flags.py, which did it already."""
    for action in parser._actions:
        long_opts = [o for o in action.option_strings if o.startswith("--")]
        if not long_opts or action.dest == "help" or hasattr(action, "registry_option"):
            continue
        for opt in long_opts:
            raw = os.environ.get(env_name(opt))
            if raw is None:
                continue
            if isinstance(action, argparse._StoreTrueAction):
                value: object = raw.strip().lower() in TRUE_WORDS
            elif isinstance(action, argparse._StoreFalseAction):
                value = raw.strip().lower() not in TRUE_WORDS
            elif action.type is not None:
                try:
                    value = action.type(raw)  # type: ignore[misc]
                except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
                    raise CliError(f"environment variable {env_name(opt)}={raw!r}: {exc}") from None
            else:
                value = raw
            if action.choices is not None and value not in action.choices:
                raise CliError(f"environment variable {env_name(opt)}={raw!r}: not one of "
                               f"{', '.join(map(str, action.choices))}")
            action.default = value
            action.required = False
            break


def build_parser(verbs: Sequence[str] | None = None) -> argparse.ArgumentParser:
    parser = OneLineParser(prog="jetrouter", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=OneLineParser)
    sub.required = True
    for verb in verbs or VERBS:
        module_name, help_text = VERBS[verb]
        p = sub.add_parser(verb, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(p)
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    apply_env_defaults(child)
        apply_env_defaults(p)
        p.set_defaults(_module=module_name, _parser=p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Import only the module of the verb asked for (fast start, isolated failures).
    verb = next((a for a in argv if not a.startswith("-")), None)
    try:
        parser = build_parser([verb] if verb in VERBS else None)
    except CliError as exc:  # a bad JETROUTER_* value, found while building the parser
        print(f"jetrouter{' ' + verb if verb in VERBS else ''}: error: {exc}", file=sys.stderr)
        return 2
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # reported by the verb's parser, so the line names the verb
        args._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args) or 0)
    except CliError as exc:
        print(f"jetrouter {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    # Run the importable module's main, so exceptions raised by verb modules (which import
    # `api.cli`) are the same classes the frame catches.
    from api.cli import main as _main

    sys.exit(_main())
