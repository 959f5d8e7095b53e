"""The `folio` command line: one subcommand per job, each a thin call into a library.

The composition root: the one module that imports every package (common, engine, services,
gateway, bench) to wire them together. Argument parsing only; never business logic. Heavy
imports (torch, the engine) happen inside the subcommand that needs them so `folio --help`
stays instant.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

from common.config import (
    INTERNAL_TOKEN_ENV,
    EngineConfig,
    EngineServiceConfig,
    GatewayServerConfig,
    StepCostConfig,
    TokenizerServiceConfig,
)
from common.flags import add_flags, flag, from_args
from common.parent_death import die_with_parent


@dataclass
class PrepareModelConfig:
    """`folio prepare-model`."""

    force: bool = flag(False, "convert again even if cached")


@dataclass
class ChatConfig:
    """`folio chat`: one answer from the offline engine."""

    message: str = flag(help="the user's message", positional=True)
    max_tokens: int = flag(128, "most tokens of the answer")
    temperature: float = flag(0.7, "sampling temperature (0: greedy)")
    top_p: float = flag(0.9, "sample from the most likely tokens whose probabilities sum to this")
    sampling_seed: int | None = flag(
        None, "seed of this answer's sampling (default: the engine's generator, --seed)"
    )
    engine: EngineConfig = field(default_factory=EngineConfig)


@dataclass
class WorkerConfig:
    """`folio engine-worker`: one tensor-parallel rank."""

    rank: int = flag(help="this worker's rank, 1..N-1")
    world_size: int = flag(help="the engine's N")
    master_port: int = flag(help="the engine's --master-port")
    master_addr: str = flag("127.0.0.1", "the engine's --master-addr (rendezvous)")
    once: bool = flag(
        False, "exit when the engine stops or goes away (--no-once: wait for it to come back)"
    )


def _prepare_model(args: argparse.Namespace) -> int:
    from common.default_model import prepare_default_model

    print(prepare_default_model(force=from_args(PrepareModelConfig, args).force))
    return 0


def _chat(args: argparse.Namespace) -> int:
    from common.sampling_params import SamplingParams
    from engine.llm import LLM

    config = from_args(ChatConfig, args)
    llm = LLM(**vars(config.engine))
    messages = [{"role": "user", "content": config.message}]
    params = SamplingParams(
        temperature=config.temperature,
        top_p=config.top_p,
        max_tokens=config.max_tokens,
        seed=config.sampling_seed,
    )
    prompt = llm.tokenizer.encode_chat(messages)
    for delta in llm.generate_stream([prompt], params):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _bench_offline(args: argparse.Namespace) -> int:
    from bench.offline import run_offline_benchmark

    run_offline_benchmark(args)
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    from bench.serve import run_serve_benchmark

    run_serve_benchmark(args)
    return 0


def _bench_profile(args: argparse.Namespace) -> int:
    from bench.profile import run_profile

    run_profile(args)
    return 0


def _bench_goodput(args: argparse.Namespace) -> int:
    from bench.goodput import run_goodput_benchmark

    run_goodput_benchmark(args)
    return 0


def _bench_routing(args: argparse.Namespace) -> int:
    from bench.routing import run_routing_benchmark

    run_routing_benchmark(args)
    return 0


def _bench_lora(args: argparse.Namespace) -> int:
    from bench.lora import run_lora_benchmark

    run_lora_benchmark(args)
    return 0


def _bench_kv_tiers(args: argparse.Namespace) -> int:
    from bench.kv_tiers import run_kv_tiers_benchmark

    run_kv_tiers_benchmark(args)
    return 0


def _bench_spec(args: argparse.Namespace) -> int:
    from bench.spec import run_spec_benchmark

    run_spec_benchmark(args)
    return 0


def _bench_startup(args: argparse.Namespace) -> int:
    from bench.startup import run_startup_benchmark

    run_startup_benchmark(args)
    return 0


def _run_service(service, drain_seconds: float) -> int:
    import logging

    from common import event_loop
    from common.heap import own_process_heap

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    own_process_heap()  # this process is the service's, for its whole life
    return event_loop.run(service.run(drain_seconds))


def _require_internal_token(service):
    """The service refuses callers without FOLIO_INTERNAL_TOKEN, when it is set."""
    from common.auth import KeySet, internal_token

    service.require_keys(
        KeySet(filter(None, [internal_token()])), f"internal token ({INTERNAL_TOKEN_ENV})"
    )
    return service


def _tokenizer(args: argparse.Namespace) -> int:
    from services.tokenizer.server import TokenizerService

    config = from_args(TokenizerServiceConfig, args)
    listen = config.listen
    service = TokenizerService(config.model, listen.host, listen.port, config.options)
    return _run_service(_require_internal_token(service), listen.drain_seconds)


def _engine(args: argparse.Namespace) -> int:
    config = from_args(EngineServiceConfig, args)
    if config.simulation.simulate:
        return _simulated_engines(config)
    from services.engine.server import EngineService

    service = EngineService(
        config.engine,
        config.listen.host,
        config.listen.port,
        generate_socket_port=config.generate_socket_port,
    )
    return _run_service(_require_internal_token(service), config.listen.drain_seconds)


def _simulated_engines(config: EngineServiceConfig) -> int:
    import asyncio
    import logging

    from engine.simulated import StepCostModel
    from services.engine.simulate import run_simulated, simulated_services

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    services = simulated_services(
        config.engine,
        StepCostModel.load(config.simulation.cost.step_cost),
        config.listen.host,
        config.listen.port,
        config.simulation.replicas,
        config.generate_socket_port,
        _require_internal_token,
    )
    return asyncio.run(run_simulated(services, config.listen.drain_seconds))


def _engine_worker(args: argparse.Namespace) -> int:
    import logging

    from engine.worker import run_worker

    config = from_args(WorkerConfig, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run_worker(
        config.rank, config.world_size, config.master_addr, config.master_port, config.once
    )


def _gateway(args: argparse.Namespace) -> int:
    import dataclasses

    from common.auth import internal_token, load_api_keys

    config = from_args(GatewayServerConfig, args)
    front = config.front
    if config.workers > 1:
        from gateway.front.workers import WorkerGroup

        group = WorkerGroup(
            args.command_line,  # each worker runs these flags (and its own, given after them)
            front.listen.host,
            front.listen.port,
            front.grpc_port,
            config.workers,
            front.listen.drain_seconds,
            front.policy.scheme,
        )
        return group.run()
    from gateway.front.server import GatewayServer
    from gateway.front.workers import WorkerSetup

    worker = None
    if config.worker_index is not None:
        assert config.listen_fd is not None and config.shared_state is not None
        worker = WorkerSetup(config.worker_index, config.listen_fd, Path(config.shared_state))
    keys = load_api_keys(front.keys.api_key, front.keys.api_key_file)
    server = GatewayServer(
        front.listen.host,
        front.listen.port,
        front.grpc_port,
        config.engine_address,  # one or more replicas
        config.tokenizer_address,
        front.served_model_name,
        dataclasses.replace(front.policy, api_keys=keys),
        internal_token(),
        worker,
    )
    return _run_service(server, front.listen.drain_seconds)


def _serve(args: argparse.Namespace) -> int:
    from services.supervisor import ServeConfig, serve

    return serve(from_args(ServeConfig, args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="folio", description="Folio LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)

    prep = sub.add_parser(
        "prepare-model", help="convert the default model once; print its directory"
    )
    add_flags(prep, PrepareModelConfig)
    prep.set_defaults(func=_prepare_model)

    chat = sub.add_parser("chat", help="stream one chat answer from the offline engine")
    add_flags(chat, ChatConfig)
    chat.set_defaults(func=_chat)

    # The three services take --config-json too: how `folio serve` hands each its config.
    tokenizer = sub.add_parser("tokenizer", help="run the tokenizer gRPC service")
    add_flags(tokenizer, TokenizerServiceConfig, serialized=True)
    tokenizer.set_defaults(func=_tokenizer)

    engine = sub.add_parser("engine", help="run the engine gRPC service")
    add_flags(engine, EngineServiceConfig, serialized=True)
    engine.set_defaults(func=_engine)

    worker = sub.add_parser(
        "engine-worker",
        help="run one tensor-parallel rank of an engine started with --external-workers",
    )
    add_flags(worker, WorkerConfig)
    worker.set_defaults(func=_engine_worker)

    gateway = sub.add_parser(
        "gateway", help="run the HTTP gateway (OpenAI API) and its gRPC text API"
    )
    add_flags(gateway, GatewayServerConfig, serialized=True)
    gateway.set_defaults(func=_gateway)

    serve = sub.add_parser("serve", help="run tokenizer, engine and gateway as three processes")
    from services.supervisor import ServeConfig

    add_flags(serve, ServeConfig)
    serve.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="benchmarks that print figures")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    offline = bench_sub.add_parser("offline", help="engine vs transformers generate, same workload")
    from bench.offline import OfflineWorkload

    add_flags(offline, OfflineWorkload)
    add_flags(offline, EngineConfig)
    offline.set_defaults(func=_bench_offline)
    served = bench_sub.add_parser(
        "serve",
        help="gateway over HTTP vs the in-process engine (and --compare-url's server), same "
        "workload",
    )
    from bench.serve import ServeWorkload

    add_flags(served, ServeWorkload)
    add_flags(served, EngineConfig)
    served.set_defaults(func=_bench_serve)
    profile = bench_sub.add_parser(
        "profile", help="time the engine's steps; fit the simulated engine's step cost model"
    )
    from bench.profile import ProfileShapes

    add_flags(profile, ProfileShapes)
    add_flags(profile, EngineConfig)
    profile.set_defaults(func=_bench_profile)
    spec = bench_sub.add_parser(
        "spec", help="the engine with and without speculative decoding, same workload"
    )
    from bench.spec import SpecWorkload

    add_flags(spec, SpecWorkload)
    add_flags(spec, EngineConfig)
    spec.set_defaults(func=_bench_spec)
    routing = bench_sub.add_parser(
        "routing", help="multi-turn chats over engine replicas under each routing policy"
    )
    from bench.routing import RoutingWorkload

    add_flags(routing, RoutingWorkload)
    add_flags(routing, StepCostConfig)
    add_flags(routing, EngineConfig)
    routing.set_defaults(func=_bench_routing, num_kv_blocks=1024)
    goodput = bench_sub.add_parser(
        "goodput",
        help="two tenants, one flooding, under each scheduling policy at several loads, with "
        "deadlines",
    )
    from bench.goodput import GoodputWorkload

    add_flags(goodput, GoodputWorkload)
    add_flags(goodput, StepCostConfig)
    add_flags(goodput, EngineConfig)
    goodput.set_defaults(func=_bench_goodput, num_kv_blocks=1024, max_num_seqs=16)
    startup = bench_sub.add_parser(
        "startup",
        help="folio serve's time to healthy, cold and warm, and back after a SIGKILLed engine",
    )
    from bench.startup import StartupWorkload

    add_flags(startup, StartupWorkload)
    add_flags(startup, EngineConfig)
    startup.set_defaults(func=_bench_startup)
    kv_tiers = bench_sub.add_parser(
        "kv-tiers",
        help="multi-turn chats over a pool a quarter of their working set, with and without "
        "the KV cache tiers; the first request after a restart with the disk tier",
    )
    from bench.kv_tiers import KVTiersWorkload

    add_flags(kv_tiers, KVTiersWorkload)
    add_flags(kv_tiers, EngineConfig)
    kv_tiers.set_defaults(func=_bench_kv_tiers, enforce_eager=True)
    lora = bench_sub.add_parser(
        "lora", help="streams over 1, 4 and 16 LoRA adapters against the base model alone"
    )
    from bench.lora import LoraWorkload

    add_flags(lora, LoraWorkload)
    add_flags(lora, EngineConfig)
    lora.set_defaults(func=_bench_lora)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.command_line = list(sys.argv[1:] if argv is None else argv)
    die_with_parent()  # a service of `folio serve`, a worker of an engine: not alone
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"folio: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
