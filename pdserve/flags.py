"""Command-line flags as a table (argparse only, cheap to import): each `Flag` says its name, type,
default and help once, and a flag that sets a field of a config dataclass takes that field's
default (`Flag.of`), so the flag and the dataclass cannot disagree. `pdserve generate`,
`worker`, `serve` and `router` declare their flags so (`engine/cli.py`, `launch/cli.py`) and
build their configs back from the same table (`config_values`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class Flag:
    """One flag. `field`: the config field it sets (`config_values`), None for one that sets no
    config field by that name."""

    name: str  # "--block-size"
    type: Callable[[str], Any] | None = None
    default: Any = None
    help: str | None = None
    field: str | None = None
    choices: tuple | None = None
    metavar: str | None = None
    action: str | None = None  # "store_true", "append"
    required: bool = False

    def __post_init__(self) -> None:
        if not self.name.startswith("--"):
            raise ValueError(f"a flag's name starts with --, got {self.name!r}")

    @classmethod
    def of(cls, config: type, field: str, help: str | None = None, **kw) -> Flag:
        """The flag `--FIELD` (or `name=`) that sets `config`'s `field`, defaulting to the
        field's default; its type is that of the default unless given."""
        (spec,) = [f for f in fields(config) if f.name == field]
        default = spec.default
        if "type" not in kw and not isinstance(default, str | bool | type(None)):
            kw["type"] = type(default)
        kw.setdefault("name", "--" + field.replace("_", "-"))
        return cls(default=default, help=help, field=field, **kw)

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")

    def add_to(self, parser) -> None:
        kw = {"type": self.type, "default": self.default, "help": self.help,
              "choices": self.choices, "metavar": self.metavar, "action": self.action}  # fmt: skip
        kw = {k: v for k, v in kw.items() if v is not None}
        if self.required:
            kw["required"] = True
        parser.add_argument(self.name, **kw)


def add_flags(parser, flags: Iterable[Flag]) -> None:
    """Add each flag to `parser` (or an argument group), in order."""
    for flag in flags:
        flag.add_to(parser)


def config_values(args: argparse.Namespace, flags: Iterable[Flag]) -> dict[str, Any]:
    """The config fields that `flags` set, from the parsed `args`."""
    return {f.field: getattr(args, f.dest) for f in flags if f.field is not None}
