"""`folio engine --simulate --replicas K`: K simulated engines (the engine loop on
engine.simulated's executor) in one process, each an EngineService of its own on its own port,
for routing studies at scale.

Wiring and life cycle only: the engines are the library's, the servicer is the real engine
service's. Ports are consecutive from --port (or each a free one with --port 0). SIGTERM / SIGINT
drain them all. Never imports torch: dozens of these must fit beside a gateway on one machine.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from collections.abc import Callable

from common.config import EngineConfig
from engine.simulated import StepCostModel, simulated_engine
from services.engine.server import EngineService

logger = logging.getLogger(__name__)


def _nth_port(first: int, i: int) -> int:
    """The i-th of consecutive ports from `first` (0: a free one each; -1: none)."""
    return first + i if first > 0 else first


def simulated_services(
    config: EngineConfig,
    cost: StepCostModel,
    host: str,
    port: int,
    replicas: int,
    generate_socket_port: int = 0,
    prepare: Callable[[EngineService], EngineService] = lambda service: service,
) -> list[EngineService]:
    """`replicas` engine services, each on a simulated engine, their Generate sockets on
    consecutive ports from `generate_socket_port` (0: free ones; -1: none); `prepare` adds
    what every service needs (the internal token)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    return [
        prepare(
            EngineService(
                config,
                host,
                port + i if port else 0,
                build_engine=functools.partial(simulated_engine, config, cost),
                generate_socket_port=_nth_port(generate_socket_port, i),
            )
        )
        for i in range(replicas)
    ]


async def run_simulated(services: list[EngineService], drain_seconds: float) -> int:
    """Serve until SIGTERM or SIGINT, then drain them all."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        ports = [await service.start() for service in services]
        host = services[0].address.rsplit(":", 1)[0]
        print(
            f"folio: {len(services)} simulated engines listening on {host}:"
            + ",".join(str(p) for p in ports),
            flush=True,
        )
        await asyncio.gather(*(service.wait_serving() for service in services))
        logger.info("%d simulated engines serving", len(services))
        await stop.wait()
    finally:
        await asyncio.gather(*(service.stop(drain_seconds) for service in services))
    return 0
