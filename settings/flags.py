"""Command-line options declared once: argparse, environment variables and typed configs from it.

Every process verb (`serve`, `worker`, `bridge`, `up`) declares its options as :class:`Option`
values in its package's ``config`` module (``api/config.py``, ``workers/config.py``,
``workers/bridge/config.py``; the NATS connection options shared by all of them are in
``eventlog/connect.py``). From that one declaration come:

- the argparse flag (:func:`add_options`), with its type, range or choices, default and help;
- the environment variable ``JETROUTER_<NAME>`` that sets the default (the command line wins); a
  bad value is refused with a :class:`CliError` that names the variable;
- the help line, which shows the default and the variable;
- typed config objects (:func:`build` fills a dataclass whose fields are named like the options;
  :func:`defaults` gives every option's value without a command line, e.g. for benchmarks);
- what `jetrouter up` forwards to its children (:func:`forward_argv`).

Adding an option is one line in the owning ``config`` module, in the group it belongs to::

    Option("stream-idle-timeout", float, 30.0, "seconds without a token before ...", above=0),

Adding an alias is one argument of the option's line: ``aliases=("--http-port",)``; the alias
sets the same value (``dest``) and its environment variable is the option's.

Every command-line error a user can make ends as one line ``jetrouter <verb>: error: ...`` on
stderr and exit status 2: argparse errors through :class:`OneLineParser`, everything a verb finds
later by raising :class:`CliError` (``api/cli.py`` prints it).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

from errors.root import JetrouterError

ENV_PREFIX = "JETROUTER_"
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")

T = TypeVar("T")


class CliError(JetrouterError, ValueError):
    """A user-facing command-line error: printed as one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (``PROG: error: ...``) and exit 2,
    instead of the usage block followed by the message."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def env_name(flag: str) -> str:
    """``--stream-idle-timeout`` -> ``JETROUTER_STREAM_IDLE_TIMEOUT``."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


@dataclass(frozen=True, slots=True)
class Option:
    """One command-line option. ``name`` is the flag without its dashes. ``type`` is ``str``,
    ``int``, ``float``, ``bool`` (a switch; default True makes it a ``--no-...`` switch that
    stores False) or any ``str -> value`` callable that raises ``ValueError`` on bad input.
    ``above`` / ``at_least`` / ``at_most`` bound numbers; ``choices`` lists the allowed values.
    ``repeat``: the flag may be given several times (a list; its variable is split like a
    shell line). ``env=False``: no environment variable (rare: the value must be explicit)."""

    name: str
    type: Callable[[str], Any] = str
    default: Any = None
    help: str = ""
    choices: tuple[Any, ...] | None = None
    above: float | None = None
    at_least: float | None = None
    at_most: float | None = None
    aliases: tuple[str, ...] = ()
    dest: str | None = None
    required: bool = False
    repeat: bool = False
    metavar: str | None = None
    hidden: bool = False
    env: bool = True

    def __post_init__(self) -> None:
        if self.type is bool and self.default is None:
            object.__setattr__(self, "default", False)  # a switch is off unless given

    @property
    def flag(self) -> str:
        return "--" + self.name

    @property
    def key(self) -> str:
        """The attribute name on the parsed namespace and on config objects."""
        return self.dest or self.name.replace("-", "_")

    @property
    def env_var(self) -> str | None:
        return env_name(self.name) if self.env else None

    @property
    def switch(self) -> bool:
        return self.type is bool

    def bounds(self) -> str:
        if self.above == 0 and self.at_most is None:
            return "positive"
        parts = [f"> {self.above}" if self.above is not None else "",
                 f">= {self.at_least}" if self.at_least is not None else "",
                 f"<= {self.at_most}" if self.at_most is not None else ""]
        return " and ".join(p for p in parts if p)

    def parse(self, raw: str) -> Any:
        """One value from text, checked against the type, range and choices."""
        if self.switch:
            word = raw.strip().lower()
            if word not in TRUE_WORDS + FALSE_WORDS:
                raise ValueError(f"not a boolean (use one of {', '.join(TRUE_WORDS)} "
                                 f"or {', '.join(FALSE_WORDS[:-1])})")
            return word in TRUE_WORDS
        kind = getattr(self.type, "__name__", "value")
        try:
            value = self.type(raw)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            if self.type in (int, float):
                raise ValueError(f"not a valid {kind}: {raw!r}") from None
            raise ValueError(str(exc)) from None
        if ((self.above is not None and not value > self.above)
                or (self.at_least is not None and not value >= self.at_least)
                or (self.at_most is not None and not value <= self.at_most)):
            raise ValueError(f"must be {self.bounds()}, got {raw}")
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"not one of {', '.join(map(str, self.choices))}")
        return value

    def from_env(self, environ: Mapping[str, str]) -> tuple[bool, Any]:
        """(found, value) of this option's environment variable; a bad value is a CliError
        naming the variable."""
        var = self.env_var
        raw = environ.get(var) if var else None
        if raw is None:
            return False, None
        try:
            if self.repeat:
                return True, [self.parse(part) for part in shlex.split(raw)]
            value = self.parse(raw)
        except ValueError as exc:
            raise CliError(f"environment variable {var}={raw!r}: {exc}") from None
        if self.switch and self.default is True:
            # A `--no-...` switch: JETROUTER_NO_X=1 means the switch was given.
            value = not value
        return True, value

    def value(self, environ: Mapping[str, str] | None = None) -> Any:
        """This option's value without a command line: its variable, else its default."""
        found, value = self.from_env(os.environ if environ is None else environ)
        return value if found else self.default

    def help_text(self) -> str:
        if self.hidden:
            return argparse.SUPPRESS
        bits = [self.help.rstrip()] if self.help else []
        if not self.switch and self.default not in (None, "", [], ()):
            bits.append(f"(default {self.default})")
        if self.env_var:
            bits.append(f"[env {self.env_var}]")
        return " ".join(bits).replace("%", "%%")

    def argparse_type(self) -> Callable[[str], Any]:
        def convert(raw: str) -> Any:
            try:
                return self.parse(raw)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None

        convert.__name__ = getattr(self.type, "__name__", "value")
        return convert


@dataclass(frozen=True, slots=True)
class Group:
    """Options shown together under one heading in ``--help``."""

    title: str
    options: tuple[Option, ...]

    def __init__(self, title: str, *options: Option) -> None:
        object.__setattr__(self, "title", title)
        object.__setattr__(self, "options", options)


def options_of(groups: Iterable[Group]) -> list[Option]:
    return [o for g in groups for o in g.options]


def find(groups: Iterable[Group], name: str) -> Option:
    """The option named ``name`` (without dashes) among ``groups``."""
    for option in options_of(groups):
        if option.name == name:
            return option
    raise KeyError(name)


def add_options(parser: argparse.ArgumentParser, groups: Sequence[Group],
                environ: Mapping[str, str] | None = None) -> None:
    """Add every option of ``groups`` to ``parser``, each group under its title, with defaults
    taken from the environment where it sets them (a bad value raises :class:`CliError`)."""
    env = os.environ if environ is None else environ
    for group in groups:
        target = parser.add_argument_group(group.title)
        for option in group.options:
            found, from_env = option.from_env(env)
            default = from_env if found else option.default
            kw: dict[str, Any] = {"dest": option.key, "default": default,
                                  "help": option.help_text()}
            if option.switch:
                kw["action"] = "store_false" if option.default is True else "store_true"
            else:
                kw["type"] = option.argparse_type()
                kw["required"] = option.required and not found
                if option.repeat:
                    kw["action"] = "append"
                    kw["default"] = list(default or [])
                if option.metavar:
                    kw["metavar"] = option.metavar
                elif option.choices is not None:
                    kw["metavar"] = "{" + ",".join(map(str, option.choices)) + "}"
            action = target.add_argument(option.flag, *option.aliases, **kw)
            action.registry_option = option  # type: ignore[attr-defined]  # see api/cli.py


def defaults(groups: Sequence[Group], environ: Mapping[str, str] | None = None
             ) -> argparse.Namespace:
    """Every option's value without a command line (environment, else default)."""
    return argparse.Namespace(**{o.key: o.value(environ) for o in options_of(groups)})


def build(cls: type[T], values: argparse.Namespace | Mapping[str, Any], **extra: Any) -> T:
    """An instance of dataclass ``cls`` whose fields are filled from the options named like
    them (``values``: parsed flags or :func:`defaults`), then from ``extra``."""
    source = vars(values) if isinstance(values, argparse.Namespace) else dict(values)
    kwargs = {f.name: source[f.name] for f in dataclasses.fields(cls)  # type: ignore[arg-type]
              if f.name in source and f.init}
    kwargs.update(extra)
    return cls(**kwargs)


def forward_argv(values: argparse.Namespace, options: Iterable[Option]) -> list[str]:
    """Flags that give a child process the values set here (options left at None are left to
    the child's own default)."""
    out: list[str] = []
    for option in options:
        value = getattr(values, option.key, None)
        if value is None or value == []:
            continue
        if option.switch:
            if value != option.default:
                out.append(option.flag)
        elif option.repeat:
            out += [f"{option.flag}={v}" for v in value]
        else:
            out.append(f"{option.flag}={value}")
    return out


def unset(option: Option, help: str | None = None) -> Option:
    """The same option with no default of its own (for a parent that forwards it only when it
    is given: the child keeps its default otherwise)."""
    return dataclasses.replace(option, default=None, required=False,
                               help=option.help if help is None else help)
