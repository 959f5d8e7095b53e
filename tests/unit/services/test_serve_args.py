"""`folio serve` hands each child its part of its config as JSON: what a child reads back through
the real `folio` parser is that part, every port it is given ends up with the right child,
`--gateway-workers` reaches the gateway, and each of its workers runs the group's config as one
process on the group's gRPC port. The engine flags `folio serve` passes to a command line
(bench) parse back into the same EngineConfig."""

from __future__ import annotations

import dataclasses
import json

from common.config import (
    EngineConfig,
    EngineServiceConfig,
    GatewayServerConfig,
    TokenizerServiceConfig,
    engine_args_from_config,
    engine_config_from_args,
)
from common.flags import from_args
from folio.cli import build_parser
from gateway.front.workers import WorkerGroup
from services.supervisor import ServeConfig, Supervisor


def supervisor(*flags: str) -> Supervisor:
    return Supervisor(from_args(ServeConfig, build_parser().parse_args(["serve", *flags])))


def child_config(config_type, args: list[str]):
    """The config a child started with `args` (after `folio`) runs with."""
    return from_args(config_type, build_parser().parse_args(args))


def test_engine_args_round_trip_through_the_engine_parser():
    changed = EngineConfig(
        model="/models/x",
        dtype="float32",
        block_size=32,
        num_kv_blocks=77,
        max_model_len=1024,
        scheduling_policy="priority",
        enable_prefix_caching=False,
        num_threads=3,
        seed=9,
    )
    for config in (EngineConfig(), changed):
        args = build_parser().parse_args(["engine", *engine_args_from_config(config)])
        assert engine_config_from_args(args) == config


def test_serve_flags_reach_each_child():
    serve = supervisor(
        "--host",
        "0.0.0.0",
        "--port",
        "8100",
        "--grpc-port",
        "50153",
        "--engine-port",
        "50151",
        "--tokenizer-port",
        "50152",
        "--model",
        "/models/x",
        "--max-num-seqs",
        "7",
        "--no-enable-prefix-caching",
        "--drain-seconds",
        "3",
        "--served-model-name",
        "folio-x",
        "--routing-policy",
        "round_robin",
        "--chat-template",
        "{{ messages[0].content }}",
    )
    assert [c.args[0] for c in serve.children] == ["tokenizer", "engine", "gateway"]
    tokenizer = child_config(TokenizerServiceConfig, serve.tokenizer.args)
    engine = child_config(EngineServiceConfig, serve.engine.args)
    gateway = child_config(GatewayServerConfig, serve.gateway.args)
    assert (tokenizer.model, tokenizer.listen.host, tokenizer.listen.port) == (
        "/models/x",
        "127.0.0.1",
        50152,
    )
    assert tokenizer.options.chat_template == "{{ messages[0].content }}"
    assert (engine.listen.host, engine.listen.port) == ("127.0.0.1", 50151)
    assert engine.engine == EngineConfig(
        model="/models/x", max_num_seqs=7, enable_prefix_caching=False
    )
    assert not engine.simulation.simulate
    front = gateway.front
    assert (front.listen.host, front.listen.port, front.grpc_port) == ("0.0.0.0", 8100, 50153)
    assert (front.served_model_name, front.policy.routing_policy) == (("folio-x",), "round_robin")
    assert (gateway.engine_address, gateway.tokenizer_address) == (
        ("127.0.0.1:50151",),
        "127.0.0.1:50152",
    )
    drains = {tokenizer.listen.drain_seconds, engine.listen.drain_seconds}
    assert drains | {front.listen.drain_seconds} == {3.0}
    assert serve.url == "http://127.0.0.1:8100"


def test_each_child_gets_its_config_as_json_not_as_flags():
    serve = supervisor("--max-num-seqs", "7", "--engine-replicas", "2", "--num-threads", "1")
    for child in serve.children:
        [_, flag, text] = child.args
        assert flag == "--config-json"
        json.loads(text)
    replicas = [child_config(EngineServiceConfig, c.args) for c in serve.engines]
    assert [r.engine.max_num_seqs for r in replicas] == [7, 7]
    assert len({r.listen.port for r in replicas}) == 2


def test_gateway_workers_reach_the_gateway_and_each_worker_is_one_process(tmp_path):
    assert child_config(GatewayServerConfig, supervisor().gateway.args).workers == 1
    gateway_args = supervisor("--gateway-workers", "3", "--grpc-port", "0").gateway.args
    gateway = child_config(GatewayServerConfig, gateway_args)
    assert gateway.workers == 3
    front = gateway.front
    group = WorkerGroup(
        gateway_args, front.listen.host, front.listen.port, front.grpc_port, 3, 30.0
    )
    # The worker's own flags come after the group's JSON config, and win.
    worker = child_config(GatewayServerConfig, group.worker_command(2, 50999, 7, tmp_path))
    assert (worker.workers, worker.front.grpc_port) == (1, 50999)
    assert (worker.worker_index, worker.listen_fd, worker.shared_state) == (2, 7, str(tmp_path))
    # Everything else as the group was told.
    assert worker == dataclasses.replace(
        gateway,
        front=dataclasses.replace(front, grpc_port=50999),
        workers=1,
        worker_index=2,
        listen_fd=7,
        shared_state=str(tmp_path),
    )


def test_port_zero_picks_distinct_free_ports():
    serve = supervisor(
        "--port", "0", "--grpc-port", "0", "--engine-port", "0", "--tokenizer-port", "0"
    )
    ports = {
        serve.port,
        serve.grpc_port,
        int(serve.engine_address.rsplit(":", 1)[1]),
        int(serve.tokenizer_address.rsplit(":", 1)[1]),
    }
    assert len(ports) == 4 and 0 not in ports
