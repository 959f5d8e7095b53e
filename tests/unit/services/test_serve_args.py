"""`folio serve` hands its engine flags to `folio engine`: what it passes must parse back, through
the real `folio engine` parser, into the same EngineConfig; and every port it is given ends up on
the right child's command line; `--gateway-workers` reaches the gateway, and each of its workers
runs the group's flags as one process on the group's gRPC port."""

from __future__ import annotations

import dataclasses

from common.config import (
    EngineConfig,
    engine_args_from_config,
    engine_config_from_args,
    gateway_config_from_args,
)
from folio.cli import build_parser
from gateway.workers import WorkerGroup
from services.supervisor import Supervisor, serve_config_from_args


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
    args = build_parser().parse_args(
        [
            "serve",
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
            "--drain-seconds",
            "3",
        ]
    )
    supervisor = Supervisor(serve_config_from_args(args))
    parse = lambda child: build_parser().parse_args(child.args)  # noqa: E731
    tokenizer, engine, gateway = (
        parse(c) for c in (supervisor.tokenizer, supervisor.engine, supervisor.gateway)
    )
    assert (tokenizer.command, tokenizer.host, tokenizer.port, tokenizer.model) == (
        "tokenizer",
        "127.0.0.1",
        50152,
        "/models/x",
    )
    assert (engine.command, engine.host, engine.port) == ("engine", "127.0.0.1", 50151)
    assert engine_config_from_args(engine) == dataclasses.replace(
        EngineConfig(), model="/models/x", max_num_seqs=7
    )
    assert (gateway.command, gateway.host, gateway.port, gateway.grpc_port) == (
        "gateway",
        "0.0.0.0",
        8100,
        50153,
    )
    assert (gateway.engine_address, gateway.tokenizer_address) == (
        ["127.0.0.1:50151"],
        "127.0.0.1:50152",
    )
    assert {tokenizer.drain_seconds, engine.drain_seconds, gateway.drain_seconds} == {3.0}
    assert supervisor.url == "http://127.0.0.1:8100"


def test_gateway_workers_reach_the_gateway_and_each_worker_is_one_process(tmp_path):
    parser = build_parser()
    default = Supervisor(serve_config_from_args(parser.parse_args(["serve"])))
    assert parser.parse_args(default.gateway.args).workers == 1
    args = parser.parse_args(["serve", "--gateway-workers", "3", "--grpc-port", "0"])
    gateway_args = Supervisor(serve_config_from_args(args)).gateway.args
    gateway = parser.parse_args(gateway_args)
    assert gateway.workers == 3
    group = WorkerGroup(
        gateway_args, gateway.host, gateway.port, gateway.grpc_port, 3, gateway.drain_seconds
    )
    worker = parser.parse_args(group.worker_command(2, 50999, 7, tmp_path))
    assert (worker.workers, worker.grpc_port) == (1, 50999)
    assert (worker.worker_index, worker.listen_fd, worker.shared_state) == (2, 7, str(tmp_path))
    # Everything else as the group was told.
    assert (worker.port, worker.engine_address, worker.tokenizer_address) == (
        gateway.port,
        gateway.engine_address,
        gateway.tokenizer_address,
    )
    assert gateway_config_from_args(worker, ()) == gateway_config_from_args(gateway, ())


def test_port_zero_picks_distinct_free_ports():
    args = build_parser().parse_args(
        ["serve", "--port", "0", "--grpc-port", "0", "--engine-port", "0", "--tokenizer-port", "0"]
    )
    supervisor = Supervisor(serve_config_from_args(args))
    ports = {
        supervisor.port,
        supervisor.grpc_port,
        int(supervisor.engine_address.rsplit(":", 1)[1]),
        int(supervisor.tokenizer_address.rsplit(":", 1)[1]),
    }
    assert len(ports) == 4 and 0 not in ports
