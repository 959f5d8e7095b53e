"""Command-line flags generated from dataclass fields, and configs carried whole to a child.

A config is a dataclass whose fields are flags (declared with `flag`: help, default, choices) or
nested configs, whose flags join the parent's: a flag several commands share (--host, the engine's
knobs) is declared once, in the config that owns it, and nested wherever it is needed.
`add_flags` turns a config type into argparse flags named after its fields (each help ends with
the default), `from_args` builds the config from what argparse parsed. `to_json` / `from_json`
carry a config to a child process whole (`folio serve` to its children, through the hidden
--config-json flag `add_flags` adds), so no config is rebuilt into a command line to be parsed
again. Only flag fields travel: a field that is not a flag (API keys) never leaves its process.
This module holds no knob of its own and imports nothing of Folio's.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

CONFIG_JSON_FLAG = "--config-json"
_FLAG = "folio_flag"  # the metadata key of a flag's field

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class _Spec:
    help: str
    choices: tuple[Any, ...] | None
    hidden: bool
    positional: bool


def flag(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    factory: Callable[[], Any] | None = None,
    choices: Sequence[Any] | None = None,
    hidden: bool = False,
    positional: bool = False,
) -> Any:
    """A config field that is a command-line flag too (--field-name). With neither a default
    nor a factory the flag is required; `hidden` keeps it out of --help (set by a parent
    process, not by users); `positional` makes it an argument without a flag name."""
    spec = _Spec(help, tuple(choices) if choices else None, hidden, positional)
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={_FLAG: spec})
    return dataclasses.field(default=default, metadata={_FLAG: spec})


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One flag of a config tree, with its value in one instance of the tree (or its default)."""

    name: str
    spec: _Spec
    kind: type  # what one value parses to: str, int, float, bool, Path
    repeated: bool  # a tuple of values, one per use of the flag
    value: Any  # dataclasses.MISSING for a required flag
    owner: type  # the config that declares it


@functools.cache
def _hints(config_type: type) -> dict[str, Any]:
    return typing.get_type_hints(config_type)


def _kind(hint: Any) -> tuple[type, bool]:
    """The type of one value of a field of type `hint`, and whether the field repeats."""
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        [hint] = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0], True
    return hint, False


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _leaves(config_type: type, instance: Any = None) -> Iterator[_Leaf]:
    """The flags of `config_type` and of the configs nested in it, depth first, with their
    values in `instance` (None: their defaults)."""
    for f in dataclasses.fields(config_type):
        hint = _hints(config_type)[f.name]
        value = _default(f) if instance is None else getattr(instance, f.name)
        if dataclasses.is_dataclass(hint):
            yield from _leaves(typing.cast(type, hint), value)
        elif _FLAG in f.metadata:
            yield _Leaf(f.name, f.metadata[_FLAG], *_kind(hint), value, config_type)


def _shown(leaf: _Leaf) -> str:
    """How --help writes the leaf's default."""
    if leaf.kind is bool:
        return f"--{_dashed(leaf.name)}" if leaf.value else f"--no-{_dashed(leaf.name)}"
    if leaf.repeated:
        return ", ".join(map(str, leaf.value)) or "none"
    return str(leaf.value)


def _help(leaf: _Leaf) -> str:
    if leaf.spec.hidden:
        return argparse.SUPPRESS
    if leaf.value is dataclasses.MISSING:
        text = f"{leaf.spec.help} (required)"
    elif leaf.value is None:
        text = leaf.spec.help  # says itself what no value means
    else:
        text = f"{leaf.spec.help} (default: {_shown(leaf)})"
    return text.replace("%", "%%")  # argparse formats help with %


def _dashed(name: str) -> str:
    return name.replace("_", "-")


class _Repeat(argparse.Action):
    """A flag of several values, given as vLLM takes them (`--flag a b`), by repeating it
    (`--flag a --flag b`), or both: the first use replaces the default (or what --config-json
    gave, both tuples), later uses add to the list the first one started."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given = getattr(namespace, self.dest)
        setattr(namespace, self.dest, [*([] if isinstance(given, tuple) else given), *values])


class _SerializedConfig(argparse.Action):
    """--config-json JSON: every flag of the command at once, as the parent serialized its
    config. Flags given after it win (a gateway worker's own, after the group's config)."""

    def __init__(self, *args: Any, config_type: type, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.config_type = config_type

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        for leaf in _leaves(self.config_type, from_json(self.config_type, values)):
            setattr(namespace, leaf.name, leaf.value)


def add_flags(parser: argparse.ArgumentParser, config_type: type, serialized: bool = False) -> None:
    """A flag per leaf field of `config_type`: its own flags first, then a group per nested
    config (titled by its docstring's first line); `serialized` adds the hidden --config-json that
    takes the whole config as `to_json` wrote it."""
    groups: dict[type, argparse._ActionsContainer] = {config_type: parser}
    for leaf in _leaves(config_type):
        if leaf.owner not in groups:
            title = (leaf.owner.__doc__ or "").strip().splitlines()[0].rstrip(".")
            groups[leaf.owner] = parser.add_argument_group(title)
        group = groups[leaf.owner]
        if leaf.spec.positional:
            group.add_argument(leaf.name, type=leaf.kind, help=_help(leaf))
            continue
        name = f"--{_dashed(leaf.name)}"
        if leaf.kind is bool:
            action = group.add_argument(
                name, action=argparse.BooleanOptionalAction, default=leaf.value
            )
            # Set afterwards: given to it, Python 3.11's BooleanOptionalAction appends its
            # own "(default: True)" to the help.
            action.help = _help(leaf)
        elif leaf.value is dataclasses.MISSING:
            group.add_argument(name, type=leaf.kind, required=True, help=_help(leaf))
        else:
            group.add_argument(
                name,
                type=leaf.kind,
                default=leaf.value,
                choices=leaf.spec.choices,
                action=_Repeat if leaf.repeated else "store",
                nargs="+" if leaf.repeated else None,
                help=_help(leaf),
            )
    if serialized:
        parser.add_argument(
            CONFIG_JSON_FLAG,
            action=_SerializedConfig,
            config_type=config_type,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )


def from_args(config_type: type[T], args: argparse.Namespace) -> T:
    """The config the flags parsed into `args` describe (add_flags' inverse)."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(typing.cast(Any, config_type)):
        hint = _hints(typing.cast(type, config_type))[f.name]
        if dataclasses.is_dataclass(hint):
            values[f.name] = from_args(typing.cast(type, hint), args)
        elif _FLAG in f.metadata:
            value = getattr(args, f.name)
            values[f.name] = tuple(value) if isinstance(value, list) else value
    return config_type(**values)


def to_json(config: Any) -> str:
    """The config's flags (nested configs included) as JSON, for `from_json` in a child."""
    return json.dumps(_plain(config))


def _plain(config: Any) -> dict[str, Any]:
    plain: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            plain[f.name] = _plain(value)
        elif _FLAG in f.metadata:
            plain[f.name] = _plain_value(value)
    return plain


def _plain_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain_value(v) for v in value]
    return str(value) if isinstance(value, Path) else value


def from_json(config_type: type[T], text: str) -> T:
    """The config `to_json` wrote; fields that are not flags take their defaults."""
    return _from_plain(config_type, json.loads(text))


def _from_plain(config_type: type[T], plain: dict[str, Any]) -> T:
    values: dict[str, Any] = {}
    for name, value in plain.items():
        hint = _hints(typing.cast(type, config_type))[name]
        if dataclasses.is_dataclass(hint):
            values[name] = _from_plain(typing.cast(type, hint), value)
            continue
        kind, repeated = _kind(hint)
        if repeated:
            values[name] = tuple(kind(v) for v in value)
        else:
            values[name] = None if value is None else kind(value)
    return config_type(**values)


def command_line(config: Any) -> list[str]:
    """Flags that parse back into `config` (one without positional arguments), for a command
    started as a user would start it."""
    args: list[str] = []
    for leaf in _leaves(type(config), config):
        name = f"--{_dashed(leaf.name)}"
        if leaf.kind is bool:
            args.append(name if leaf.value else f"--no-{_dashed(leaf.name)}")
        elif leaf.repeated:
            args += [a for value in leaf.value for a in (name, str(value))]
        elif leaf.value is not None:
            args += [name, str(leaf.value)]
    return args


def check_choices(config: Any) -> None:
    """ValueError naming the first of the config's own flags whose value is not a choice."""
    for f in dataclasses.fields(config):
        spec = f.metadata.get(_FLAG)
        value = getattr(config, f.name)
        if spec is not None and spec.choices and value is not None and value not in spec.choices:
            raise ValueError(
                f"{f.name} must be one of {', '.join(map(str, spec.choices))}, got {value!r}"
            )
