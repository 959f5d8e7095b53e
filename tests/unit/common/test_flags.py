"""The configuration tree: every command's flags come from its config's fields (each listed once
in --help, with its default), and a config survives the JSON trip `folio serve` gives it to a
child unchanged."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest

from common.config import (
    EngineServiceConfig,
    GatewayConfig,
    GatewayServerConfig,
    TokenizerServiceConfig,
)
from common.flags import command_line, from_args, from_json, to_json
from folio.cli import build_parser
from services.supervisor import ServeConfig

ROOT = Path(__file__).resolve().parents[3]
# Every command, `bench NAME` ones included: each of their flags is a config field.
COMMANDS = (
    "prepare-model",
    "chat",
    "tokenizer",
    "engine",
    "engine-worker",
    "gateway",
    "serve",
    "bench offline",
    "bench serve",
    "bench profile",
    "bench routing",
    "bench goodput",
)


def command_parser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for word in name.split():
        [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = commands.choices[word]
    return parser


@pytest.mark.parametrize("name", COMMANDS)
def test_help_lists_every_flag_once_with_its_default(name):
    parser = command_parser(name)
    # One line per flag: its name, then its whole help.
    parser.formatter_class = lambda prog: argparse.HelpFormatter(
        prog, max_help_position=100, width=100_000
    )
    text = parser.format_help()
    shown = [a for a in parser._actions if a.help != argparse.SUPPRESS and a.dest != "help"]
    assert shown
    for action in shown:
        label = action.option_strings[0] if action.option_strings else action.dest
        lines = [
            line for line in text.splitlines() if re.match(rf"\s+{re.escape(label)}(?=[ ,])", line)
        ]
        assert len(lines) == 1, (label, lines)
        # The default in words: a value, what no value means, or that there is none.
        assert re.search(r"default|\(required\)", lines[0]), lines[0]
        if action.default not in (None, argparse.SUPPRESS) and not action.required:
            assert "(default: " in lines[0], lines[0]


def test_serve_has_every_engine_and_gateway_flag():
    serve = set(command_parser("serve")._option_string_actions)
    for command in ("engine", "gateway"):
        flags = {
            a.option_strings[0]
            for a in command_parser(command)._actions
            if a.help != argparse.SUPPRESS and a.option_strings and a.dest != "help"
        }
        # serve sets them (its engines' Generate sockets on free ports)
        flags -= {"--engine-address", "--tokenizer-address", "--workers", "--generate-socket-port"}
        flags -= {"--simulate", "--replicas", "--step-cost"}  # `folio engine` alone
        assert flags <= serve, flags - serve


# Flags whose value has a form of its own: a valid one that is not the default. The LoRA
# flags stay at theirs (LoRA is refused with tensor parallelism, which changed() turns on), and
# so do the TLS files (they must exist, and come as a pair).
FORMED = {
    "speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}',
    "chat_template": "{{ messages[0].content }}",
    "generation_config": "folio",
    "override_generation_config": '{"temperature": 0.5}',
    "allowed_origins": ("https://app.example.com", "http://localhost:3000"),
}
KEPT = {"lora_modules", "lora_root", "ssl_keyfile", "ssl_certfile"}


def changed(config_type):
    """A config whose every flag without choices differs from its default (recursively)."""
    values = {}
    hints = typing.get_type_hints(config_type)
    for f in dataclasses.fields(config_type):
        hint = hints[f.name]
        if f.name in KEPT:
            continue
        if f.name in FORMED:
            values[f.name] = FORMED[f.name]
        elif dataclasses.is_dataclass(hint):
            values[f.name] = changed(hint)
        elif "folio_flag" in f.metadata and not f.metadata["folio_flag"].choices:
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            optional = isinstance(hint, types.UnionType)
            [kind] = (
                [a for a in typing.get_args(hint) if a is not type(None)] if optional else [hint]
            )
            if kind is bool:
                values[f.name] = not default
            else:
                values[f.name] = {int: 4, float: 2.5, str: "x", Path: Path("/tmp/cost.json")}.get(
                    typing.get_origin(kind) or kind, ("a:1", "b:2")
                )
    return config_type(**values)


SERVICES = {
    "engine": changed(EngineServiceConfig),
    "tokenizer": changed(TokenizerServiceConfig),
    "gateway": changed(GatewayServerConfig),
}


@pytest.mark.parametrize(
    "config", [*SERVICES.values(), changed(ServeConfig)], ids=lambda c: type(c).__name__
)
def test_a_config_survives_the_json_trip(config):
    assert config != type(config)()
    assert from_json(type(config), to_json(config)) == config


@pytest.mark.parametrize("command", SERVICES)
def test_a_service_reads_its_config_from_config_json(command):
    config = SERVICES[command]
    args = command_parser(command).parse_args(["--config-json", to_json(config)])
    assert from_args(type(config), args) == config


def test_secrets_never_travel():
    config = GatewayServerConfig()
    config.front.policy = GatewayConfig(api_keys=("sk-secret",))
    assert "sk-secret" not in to_json(config)
    assert from_json(GatewayServerConfig, to_json(config)).front.policy.api_keys == ()


def test_repeated_flags_replace_their_default():
    parser = command_parser("gateway")
    assert from_args(GatewayServerConfig, parser.parse_args([])).engine_address == (
        "127.0.0.1:50051",
    )
    args = parser.parse_args(["--engine-address", "a:1", "--engine-address", "b:2"])
    assert from_args(GatewayServerConfig, args).engine_address == ("a:1", "b:2")
    # vLLM's form (several values after one flag), and both forms together.
    args = parser.parse_args(["--engine-address", "a:1", "b:2", "--engine-address", "c:3"])
    assert from_args(GatewayServerConfig, args).engine_address == ("a:1", "b:2", "c:3")


def test_a_value_not_among_the_choices_is_named():
    with pytest.raises(ValueError, match=r"routing_policy must be one of .*got 'nearest'"):
        GatewayConfig(routing_policy="nearest")


def test_environment_defaults_reach_the_help_and_the_engine_child():
    script = (
        "from common.flags import from_args\n"
        "from common.config import EngineServiceConfig\n"
        "from folio.cli import build_parser\n"
        "from services.supervisor import ServeConfig, Supervisor\n"
        "args = build_parser().parse_args(['serve'])\n"
        "engine = Supervisor(from_args(ServeConfig, args)).engine\n"
        "config = from_args(EngineServiceConfig, build_parser().parse_args(engine.args))\n"
        "print(config.engine.enforce_eager)\n"
    )
    env = {**os.environ, "FOLIO_ENFORCE_EAGER": "1", "COLUMNS": "1000"}
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert run.stdout.strip() == "True", run.stderr
    help_text = subprocess.run(
        [sys.executable, "-m", "folio.cli", "serve", "--help"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout
    assert "(default: --enforce-eager)" in help_text


@pytest.mark.parametrize("command", [*SERVICES, "serve"])
def test_a_config_survives_its_command_line(command):
    """`folio bench routing` starts each process with its config's flags, as a user would."""
    config = SERVICES.get(command) or changed(ServeConfig)
    args = command_parser(command).parse_args(command_line(config))
    assert from_args(type(config), args) == config
