"""The `folio` command line: one subcommand per job, each a thin call into a library.

The composition root: the one module that imports every package (common, engine, services,
gateway, bench) to wire them together. Argument parsing only; never business logic. Heavy
imports (torch, the engine) happen inside the subcommand that needs them so `folio --help`
stays instant.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common.config import (
    ENGINE_PORT,
    INTERNAL_TOKEN_ENV,
    TOKENIZER_PORT,
    add_engine_args,
    add_gateway_args,
    add_service_args,
    default_step_cost_path,
    engine_config_from_args,
    gateway_config_from_args,
)
from common.parent_death import die_with_parent


def _prepare_model(args: argparse.Namespace) -> int:
    from common.default_model import prepare_default_model

    print(prepare_default_model(force=args.force))
    return 0


def _chat(args: argparse.Namespace) -> int:
    from common.sampling_params import SamplingParams
    from engine.llm import LLM

    config = engine_config_from_args(args)
    llm = LLM(**vars(config))
    messages = [{"role": "user", "content": args.message}]
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
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


def _bench_routing(args: argparse.Namespace) -> int:
    from bench.routing import run_routing_benchmark

    run_routing_benchmark(args)
    return 0


def _run_service(service, drain_seconds: float) -> int:
    import logging

    from common import event_loop

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
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

    service = _require_internal_token(TokenizerService(args.model, args.host, args.port))
    return _run_service(service, args.drain_seconds)


def _engine(args: argparse.Namespace) -> int:
    if args.simulate:
        return _simulated_engines(args)
    if args.replicas != 1:
        raise ValueError(
            "--replicas needs --simulate (real replicas: folio serve --engine-replicas N)"
        )
    from services.engine.server import EngineService

    service = EngineService(engine_config_from_args(args), args.host, args.port)
    return _run_service(_require_internal_token(service), args.drain_seconds)


def _simulated_engines(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from engine.simulated import StepCostModel
    from services.engine.simulate import run_simulated, simulated_services

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cost = StepCostModel.load(args.step_cost)
    services = simulated_services(
        engine_config_from_args(args),
        cost,
        args.host,
        args.port,
        args.replicas,
        _require_internal_token,
    )
    return asyncio.run(run_simulated(services, args.drain_seconds))


def _engine_worker(args: argparse.Namespace) -> int:
    import logging

    from engine.worker import run_worker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run_worker(args.rank, args.world_size, args.master_addr, args.master_port, args.once)


def _gateway(args: argparse.Namespace) -> int:
    from common.auth import internal_token, load_api_keys

    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    config = gateway_config_from_args(args, load_api_keys(args.api_key, args.api_key_file))
    if args.workers > 1:
        from gateway.workers import WorkerGroup

        group = WorkerGroup(
            args.command_line,  # each worker runs these flags (and its own, given after them)
            args.host,
            args.port,
            args.grpc_port,
            args.workers,
            args.drain_seconds,
        )
        return group.run()
    from gateway.server import GatewayServer
    from gateway.workers import WorkerSetup

    worker = (
        None
        if args.worker_index is None
        else WorkerSetup(args.worker_index, args.listen_fd, Path(args.shared_state))
    )
    server = GatewayServer(
        args.host,
        args.port,
        args.grpc_port,
        args.engine_address,  # one or more replicas
        args.tokenizer_address,
        args.served_model_name,
        config,
        internal_token(),
        worker,
    )
    return _run_service(server, args.drain_seconds)


def _serve(args: argparse.Namespace) -> int:
    from services.supervisor import serve, serve_config_from_args

    return serve(serve_config_from_args(args))


class _AppendReplacingDefault(argparse.Action):
    """A repeatable flag whose default list is replaced, not extended, by the values given."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        given = getattr(namespace, self.dest)
        setattr(namespace, self.dest, [*([] if given is self.default else given), values])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="folio", description="Folio LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)

    prep = sub.add_parser(
        "prepare-model", help="convert the default model once; print its directory"
    )
    prep.add_argument("--force", action="store_true", help="convert again even if cached")
    prep.set_defaults(func=_prepare_model)

    chat = sub.add_parser("chat", help="stream one chat answer from the offline engine")
    chat.add_argument("message", help="the user's message")
    chat.add_argument("--max-tokens", type=int, default=128)
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--top-p", type=float, default=0.9)
    chat.add_argument("--sampling-seed", type=int, default=None)
    add_engine_args(chat)
    chat.set_defaults(func=_chat)

    tokenizer = sub.add_parser("tokenizer", help="run the tokenizer gRPC service")
    tokenizer.add_argument(
        "--model",
        default=None,
        help="a local Hugging Face model directory (default: SmolLM2-135M-Instruct)",
    )
    add_service_args(tokenizer, TOKENIZER_PORT)
    tokenizer.set_defaults(func=_tokenizer)

    engine = sub.add_parser("engine", help="run the engine gRPC service")
    add_service_args(engine, ENGINE_PORT)
    add_engine_args(engine)
    simulate = engine.add_argument_group("simulation")
    simulate.add_argument(
        "--simulate",
        action="store_true",
        help="no model: the real scheduler and KV cache, each step as long as the step cost "
        "model says, placeholder tokens (for routing studies at scale)",
    )
    simulate.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="with --simulate: simulated engines in this process, on consecutive ports from "
        "--port (0: free ones)",
    )
    simulate.add_argument(
        "--step-cost",
        type=Path,
        default=default_step_cost_path(),
        help="the step cost model `folio bench profile` wrote",
    )
    engine.set_defaults(func=_engine)

    worker = sub.add_parser(
        "engine-worker",
        help="run one tensor-parallel rank of an engine started with --external-workers",
    )
    worker.add_argument("--rank", type=int, required=True, help="this worker's rank, 1..N-1")
    worker.add_argument("--world-size", type=int, required=True, help="the engine's N")
    worker.add_argument(
        "--master-addr", default="127.0.0.1", help="the engine's --master-addr (rendezvous)"
    )
    worker.add_argument("--master-port", type=int, required=True, help="the engine's --master-port")
    worker.add_argument(
        "--once",
        action="store_true",
        help="exit when the engine stops or goes away (default: wait for it to come back)",
    )
    worker.set_defaults(func=_engine_worker)

    gateway = sub.add_parser(
        "gateway", help="run the HTTP gateway (OpenAI API) and its gRPC text API"
    )
    from common.config import DEFAULT_HOST, DRAIN_SECONDS, GATEWAY_GRPC_PORT, HTTP_PORT

    gateway.add_argument("--host", default=DEFAULT_HOST, help="address to listen on")
    gateway.add_argument(
        "--port", type=int, default=HTTP_PORT, help="HTTP port (0 picks a free one)"
    )
    gateway.add_argument(
        "--grpc-port",
        type=int,
        default=GATEWAY_GRPC_PORT,
        help="port of the gateway's gRPC text API (0 picks a free one)",
    )
    gateway.add_argument(
        "--engine-address",
        action=_AppendReplacingDefault,
        default=[f"{DEFAULT_HOST}:{ENGINE_PORT}"],
        help="HOST:PORT of the engine service; repeat it for each engine replica (the gateway "
        "routes between them by --routing-policy)",
    )
    gateway.add_argument(
        "--tokenizer-address",
        default=f"{DEFAULT_HOST}:{TOKENIZER_PORT}",
        help="HOST:PORT of the tokenizer service",
    )
    gateway.add_argument(
        "--drain-seconds",
        type=float,
        default=DRAIN_SECONDS,
        help="on SIGTERM / Ctrl-C, how long requests in flight may finish",
    )
    gateway.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients use (default: the model directory's name)",
    )
    gateway.add_argument(
        "--workers",
        type=int,
        default=1,
        help="gateway processes sharing the HTTP and gRPC ports, each with its own engine and "
        "tokenizer streams; metrics and rate limits stay the whole server's",
    )
    # Set by the parent of --workers for each worker; not for users.
    gateway.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    gateway.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)
    gateway.add_argument("--shared-state", default=None, help=argparse.SUPPRESS)
    add_gateway_args(gateway)
    gateway.set_defaults(func=_gateway)

    serve = sub.add_parser("serve", help="run tokenizer, engine and gateway as three processes")
    from services.supervisor import add_serve_args

    add_serve_args(serve)
    add_gateway_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="benchmarks that print figures")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    offline = bench_sub.add_parser("offline", help="engine vs transformers generate, same workload")
    from bench.offline import add_offline_args

    add_offline_args(offline)
    add_engine_args(offline)
    offline.set_defaults(func=_bench_offline)
    served = bench_sub.add_parser(
        "serve",
        help="gateway over HTTP vs the in-process engine (and --compare-url's server), same "
        "workload",
    )
    from bench.serve import add_serve_bench_args

    add_serve_bench_args(served)
    add_engine_args(served)
    served.set_defaults(func=_bench_serve)
    profile = bench_sub.add_parser(
        "profile", help="time the engine's steps; fit the simulated engine's step cost model"
    )
    from bench.profile import add_profile_args

    add_profile_args(profile)
    add_engine_args(profile)
    profile.set_defaults(func=_bench_profile)
    routing = bench_sub.add_parser(
        "routing", help="multi-turn chats over engine replicas under each routing policy"
    )
    from bench.routing import add_routing_bench_args

    add_routing_bench_args(routing)
    routing.add_argument(
        "--step-cost",
        type=Path,
        default=default_step_cost_path(),
        help="with --simulate: the step cost model `folio bench profile` wrote",
    )
    add_engine_args(routing)
    routing.set_defaults(func=_bench_routing, num_kv_blocks=1024)
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
