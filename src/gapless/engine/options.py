"""Options: each setting's default, range and help text, written once, on its config field.

`EngineConfig`, `SchedulerConfig` and `distributed.Launch` declare their settings with
`option(...)`. From those fields alone, `gapless serve` builds its flags (`add_flags`), the
configs check their ranges on construction (`check`), and `LLM(path, **options)` takes them
by name. A new option is one field.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Option:
    help: str
    positive: bool = False  # must be > 0
    minimum: float | None = None  # must be >= this
    choices: tuple[Any, ...] | None = None
    flag: str | None = None  # when it is not --the-field-name (a bool that defaults on: --no-x)
    metavar: str | None = None
    exclusive: str | None = None  # options sharing this name are mutually exclusive flags
    section: str | None = None  # the --help section the flag is listed under
    cli: bool = True  # False: settable from Python only


def option(default: Any, help: str, **kw: Any) -> Any:
    """A config field with its default and what `Option` says of it."""
    return dataclasses.field(default=default, metadata={"option": Option(help, **kw)})


def options(config: Any) -> Iterator[tuple[dataclasses.Field, Option]]:
    """A config class's (or instance's) option fields, in declaration order."""
    for f in dataclasses.fields(config):
        if "option" in f.metadata:
            yield f, f.metadata["option"]


def check(config: Any) -> None:
    """Raises ValueError naming the first option out of its range."""
    for f, opt in options(config):
        value = getattr(config, f.name)
        if value is None:
            continue
        if opt.choices is not None and value not in opt.choices:
            listed = " or ".join(repr(c) for c in opt.choices)
            raise ValueError(f"{f.name} must be {listed}, got {value!r}")
        if opt.positive and value <= 0:
            raise ValueError(f"{f.name} must be positive, got {value!r}")
        if opt.minimum is not None and value < opt.minimum:
            raise ValueError(f"{f.name} must be >= {opt.minimum:g}, got {value!r}")


def add_flags(parser: argparse.ArgumentParser, *configs: type) -> None:
    """One flag per option of each config class, its dest the field's name."""
    sections: dict[str, Any] = {}
    exclusive: dict[str, Any] = {}
    for config in configs:
        for f, opt in options(config):
            if not opt.cli:
                continue
            where: Any = parser
            if opt.section is not None:
                if opt.section not in sections:
                    sections[opt.section] = parser.add_argument_group(opt.section)
                where = sections[opt.section]
            if opt.exclusive is not None:
                if opt.exclusive not in exclusive:
                    exclusive[opt.exclusive] = where.add_mutually_exclusive_group()
                where = exclusive[opt.exclusive]
            flag = opt.flag or "--" + f.name.replace("_", "-")
            if isinstance(f.default, bool):  # a switch: its flag sets what is not the default
                action = "store_false" if f.default else "store_true"
                where.add_argument(flag, dest=f.name, action=action, help=opt.help)
                continue
            if isinstance(f.default, tuple):  # repeated: each use of the flag adds a value
                where.add_argument(
                    flag, dest=f.name, action="append", metavar=opt.metavar, help=opt.help
                )
                continue
            kind = _scalar_type(f.type)
            shown = "" if f.default is None else " (%(default)s)"
            where.add_argument(
                flag,
                dest=f.name,
                type=kind,
                default=f.default,
                choices=opt.choices,
                metavar=opt.metavar or ("N" if kind is int else None),
                help=opt.help + shown,
            )


def _scalar_type(annotation: Any) -> type:
    """int for "int | None", float for "float", ... (annotations are strings here)."""
    name = str(annotation).split("|")[0].strip()
    return {"int": int, "float": float, "str": str}[name]


def split(options_by_name: dict[str, Any], *configs: type) -> list[dict[str, Any]]:
    """The options given by name, split by the config class each belongs to; a name no
    config has is a TypeError, as for a function's unknown keyword."""
    rest = dict(options_by_name)
    parts = []
    for config in configs:
        names = {f.name for f in dataclasses.fields(config)}
        parts.append({k: rest.pop(k) for k in list(rest) if k in names})
    if rest:
        raise TypeError(f"unknown engine option(s): {', '.join(sorted(rest))}")
    return parts
