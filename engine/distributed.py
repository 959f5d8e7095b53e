"""The tensor-parallel group over torch.distributed: rendezvous, the step broadcast, liveness.

Rank 0 is the engine (scheduler, KV cache manager, sampler) and runs a shard of the model;
ranks 1..N-1 are worker processes (engine.worker). `EngineGroup` is rank 0's side: it hosts
the rendezvous store, starts the workers as plain subprocesses (or waits for external ones),
leaves the engine's configuration in the store (JSON), broadcasts every step, and watches the
workers.

What crosses: JSON in the store, and int64 tensors (a header [command, length], then the
payload), so nothing is ever unpickled. A step is its plan (engine.core.step_plan's int64
encoding, sampling parameters left on rank 0): every rank's runner applies it to its own
persistent batch and runs the same forward.

Every socket binds to the given address (127.0.0.1 unless told otherwise): the store's
listening socket is made here, and gloo's device binds to the local address that reaches it.
Liveness: workers bump a heartbeat counter in the store; rank 0 also polls the workers it
started. A collective never times out while the group is idle. This module never schedules,
samples or touches the KV cache manager.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from common.config import EngineConfig
from common.parent_death import child_env
from engine.core import step_plan
from engine.core.step_plan import StepPlan
from engine.errors import EngineGroupError
from engine.layers.parallel import TensorParallel

logger = logging.getLogger(__name__)

# Header of every broadcast: [command, payload length]. LORA: a LoRA adapter message
# (engine.lora.host: read an adapter, put it into a slot, or forget it; the payload: the
# operation, the adapter's id, the slot, then the adapter directory's path in UTF-8, a byte per
# entry). TIERS: a KV tier message (engine.kv_tiers.ranks: a disk probe, or the blocks each rank
# moves).
STEP, STOP, LORA, TIERS = 1, 2, 3, 4
_HEADER = 2
# Collectives wait this long: an idle group sits in a broadcast for as long as it is idle, and
# a dead peer is found by the heartbeats and the closed sockets, not by this timeout.
_COLLECTIVE_TIMEOUT = datetime.timedelta(days=365)
_JOIN_KEY = "folio/joined/{}"
_HEARTBEAT_KEY = "folio/heartbeat/{}"
_ENGINE_KEY = "folio/engine"
# Set by rank 0 before it tells the workers to stop: a worker that comes back for the next engine
# while this one's store still listens must not join a group whose rank 0 has left.
_STOPPED_KEY = "folio/stopped"
# Each worker rank bumps a counter in the rendezvous store this often; rank 0 declares a worker
# dead when its counter has not moved for TP_HEARTBEAT_TIMEOUT_SECONDS (or at once when a worker
# it started exits). Liveness never comes from a collective timing out: an idle group waits in
# its collectives for as long as it stays idle.
TP_HEARTBEAT_SECONDS = 0.5
TP_HEARTBEAT_TIMEOUT_SECONDS = 10.0
# How long a worker waits for the engine's rendezvous before trying again (engine.worker).
TP_RENDEZVOUS_RETRY_SECONDS = 1.0
# A restarted engine's fixed rendezvous port may be held a moment by its predecessor's sockets.
TP_BIND_RETRY_SECONDS = 30.0


def local_address_towards(host: str) -> str:
    """The address of this machine's interface that reaches `host` (127.0.0.1 for loopback)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP: picks the route, sends nothing
        return s.getsockname()[0]


def threads_per_rank(config: EngineConfig) -> int | None:
    """On CPU, the cores split between the ranks (each a process of its own) unless set."""
    if config.num_threads or config.device != "cpu":
        return config.num_threads
    return max(1, len(os.sched_getaffinity(0)) // config.tensor_parallel_size)


def rank_device(device: str, rank: int) -> str:
    """Each rank's own GPU on a CUDA machine, counted from the engine's (an engine replica on
    cuda:4 with 2 ranks: cuda:4 and cuda:5); the CPU is shared."""
    base = torch.device(device)
    if base.type != "cuda":
        return device
    return f"cuda:{((base.index or 0) + rank) % torch.cuda.device_count()}"


def join_group(store: dist.Store, rank: int, size: int, device: str, host: str) -> TensorParallel:
    """Initialise the default process group: NCCL on CUDA, gloo (bound to `host`'s route)
    on CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))
        dist.init_process_group(
            "nccl", store=store, rank=rank, world_size=size, timeout=_COLLECTIVE_TIMEOUT
        )
    else:
        # The private options are the one way to bind gloo's sockets to a chosen address.
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = _COLLECTIVE_TIMEOUT
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size, pg_options=options)
    return TensorParallel(rank, size, dist.group.WORLD)


def leave_group() -> None:
    with contextlib.suppress(Exception):  # a broken group may refuse a clean teardown
        dist.destroy_process_group()


class Channel:
    """Rank 0 broadcasts int64 messages; the other ranks receive them."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self._header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)

    def send(self, command: int, payload: np.ndarray | None = None) -> None:
        length = 0 if payload is None else len(payload)
        self._header.copy_(torch.tensor([command, length]))
        dist.broadcast(self._header, src=0)
        if length:
            dist.broadcast(torch.from_numpy(payload).to(self.device), src=0)

    def receive(self) -> tuple[int, torch.Tensor | None]:
        dist.broadcast(self._header, src=0)
        command, length = self._header.tolist()
        if not length:
            return command, None
        payload = torch.empty(length, dtype=torch.int64, device=self.device)
        dist.broadcast(payload, src=0)
        return command, payload

    def all_min(self, values: np.ndarray) -> np.ndarray:
        """Every rank's int64 `values` (the same length on all), reduced to their minimum."""
        tensor = torch.from_numpy(values).to(self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return tensor.cpu().numpy()


def encode_lora(operation: int, adapter_id: int, slot: int, path: str) -> np.ndarray:
    return np.array([operation, adapter_id, slot, *path.encode()], dtype=np.int64)


def decode_lora(payload: np.ndarray) -> tuple[int, int, int, str]:
    operation, adapter_id, slot = (int(v) for v in payload[:3])
    return operation, adapter_id, slot, bytes(payload[3:].astype(np.uint8)).decode()


# -- rank 0 -------------------------------------------------------------------------------------


class EngineGroup:
    """Rank 0's side of the group: rendezvous host, step broadcaster, workers' watchman."""

    def __init__(
        self, config: EngineConfig, model_path: Path, num_blocks: int, max_model_len: int
    ) -> None:
        self.size = size = config.tensor_parallel_size
        self.host = config.master_addr
        listener = _listen(self.host, config.master_port, size * 4)
        self.port = listener.getsockname()[1]
        # The store owns the listening socket from here on (and closes it).
        store = dist.TCPStore(
            self.host,
            self.port,
            size,
            True,
            timeout=_COLLECTIVE_TIMEOUT,
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )
        info = asdict(config)
        info.update(model=str(model_path), num_blocks=num_blocks, max_model_len=max_model_len)
        store.set(_ENGINE_KEY, json.dumps(info))
        self._store: dist.TCPStore | None = store
        self.failure: EngineGroupError | None = None
        self._listeners: list[Callable[[EngineGroupError], None]] = []
        self._closed = threading.Event()
        self.workers: dict[int, subprocess.Popen] = {}
        if not config.external_workers:
            for rank in range(1, size):
                self.workers[rank] = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "folio.cli",
                        "engine-worker",
                        "--rank",
                        str(rank),
                        "--world-size",
                        str(size),
                        "--master-addr",
                        self.host,
                        "--master-port",
                        str(self.port),
                        "--once",
                    ],
                    stdin=subprocess.DEVNULL,
                    env=child_env(),  # they die with the engine
                )
        else:
            logger.info(
                "waiting for %d tensor-parallel workers at %s:%d", size - 1, self.host, self.port
            )
        self._wait_for_workers(store)
        self.device = config.device
        self.tp = join_group(store, 0, size, config.device, self.host)
        self.channel = Channel(config.device)
        self._monitor = threading.Thread(target=self._watch, name="folio-tp-monitor", daemon=True)
        self._monitor.start()

    def _wait_for_workers(self, store: dist.TCPStore) -> None:
        """Until every worker has reached the store; a started worker that exits first fails
        the start with its exit code."""
        pending = set(range(1, self.size))
        while pending:
            for rank in list(pending):
                process = self.workers.get(rank)
                if process is not None and process.poll() is not None:
                    self.close()
                    raise EngineGroupError(
                        f"tensor-parallel worker rank {rank} exited with code "
                        f"{process.returncode} while joining the group (see its output)"
                    )
                if store.check([_JOIN_KEY.format(rank)]):
                    pending.discard(rank)
            time.sleep(0.05)

    # -- steps ---------------------------------------------------------------------------------

    def broadcast_plan(self, plan: StepPlan) -> None:
        self.channel.send(STEP, step_plan.encode(plan))

    def broadcast_lora(self, operation: int, adapter_id: int, slot: int, path: str) -> None:
        """A LoRA adapter message (engine.lora.host) for every other rank, before the next
        step."""
        self.channel.send(LORA, encode_lora(operation, adapter_id, slot, path))

    def broadcast_tiers(self, message: np.ndarray) -> None:
        """A KV tier message (engine.kv_tiers.ranks) for every rank's tier store."""
        self.channel.send(TIERS, message)

    def all_min(self, values: np.ndarray) -> np.ndarray:
        return self.channel.all_min(values)

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    def step_failed(self, error: BaseException) -> EngineGroupError:
        """The error to raise for a step that failed on rank 0: the group is out of step now.
        A worker's death is named when the watchman finds it soon (its socket closed first)."""
        deadline = time.monotonic() + 10 * TP_HEARTBEAT_SECONDS
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(TP_HEARTBEAT_SECONDS / 5)
        if self.failure is None:
            self._fail(f"a tensor-parallel step failed on rank 0: {error}")
        # _fail leaves failure unset only once the group is closed: name this step's error then.
        return self.failure or EngineGroupError(f"a tensor-parallel step failed: {error}")

    def add_failure_listener(self, listener: Callable[[EngineGroupError], None]) -> None:
        """`listener(error)` runs once, in the watchman's thread, when the group fails."""
        self._listeners.append(listener)

    # -- liveness ------------------------------------------------------------------------------

    def _watch(self) -> None:
        store = dist.TCPStore(self.host, self.port, self.size, False, timeout=_COLLECTIVE_TIMEOUT)
        beats = {rank: (-1, time.monotonic()) for rank in range(1, self.size)}
        while not self._closed.wait(TP_HEARTBEAT_SECONDS):
            now = time.monotonic()
            for rank, (count, since) in beats.items():
                process = self.workers.get(rank)
                if process is not None and process.poll() is not None:
                    return self._fail(f"tensor-parallel worker rank {rank} {_exit(process)}")
                current = store.add(_HEARTBEAT_KEY.format(rank), 0)
                if current != count:
                    beats[rank] = (current, now)
                elif now - since > TP_HEARTBEAT_TIMEOUT_SECONDS:
                    return self._fail(
                        f"tensor-parallel worker rank {rank} sent no heartbeat for "
                        f"{now - since:.0f} s (dead, hung or cut off)"
                    )
        return None

    def _fail(self, message: str) -> None:
        if self.failure is not None or self._closed.is_set():
            return
        self.failure = EngineGroupError(
            f"{message}; the engine cannot run without all {self.size} ranks"
        )
        logger.error("%s", self.failure)
        for listener in self._listeners:
            listener(self.failure)

    # -- stop ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Tell the workers to stop (when the group still works) and wait for those started."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._store.set(_STOPPED_KEY, "1")
        if self.failure is None and hasattr(self, "channel"):
            with contextlib.suppress(Exception):
                self.channel.send(STOP)
        else:  # the survivors wait in a collective that will never complete
            for process in self.workers.values():
                if process.poll() is None:
                    process.terminate()
        for process in self.workers.values():
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        leave_group()
        self._store = None  # closes the rendezvous port: a restarted engine may bind it again


def _listen(host: str, port: int, backlog: int) -> socket.socket:
    """The rendezvous socket on host:port. A fixed port may still be held for a moment by the
    engine this one replaces (its connections closing): tried again for a while."""
    deadline = time.monotonic() + TP_BIND_RETRY_SECONDS
    while True:
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, port))
        except OSError as exc:
            listener.close()
            if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise OSError(
                    exc.errno,
                    f"cannot bind the tensor-parallel rendezvous to {host}:{port}: {exc.strerror}",
                ) from None
            time.sleep(0.2)
            continue
        listener.listen(backlog)
        return listener


def _exit(process: subprocess.Popen) -> str:
    code = process.returncode
    if code < 0:
        return f"(pid {process.pid}) was killed by {signal.Signals(-code).name}"
    return f"(pid {process.pid}) exited with code {code}"


# -- worker ranks ---------------------------------------------------------------------------------


def connect_store(host: str, port: int, rank: int, size: int, timeout: float) -> dist.TCPStore:
    """A worker's connection to the engine's store, announcing this rank; raises when the
    engine is not there within `timeout` seconds."""
    store = dist.TCPStore(host, port, size, False, timeout=datetime.timedelta(seconds=timeout))
    store.set_timeout(_COLLECTIVE_TIMEOUT)
    store.set(_JOIN_KEY.format(rank), "1")
    return store


def engine_info(store: dist.Store) -> dict:
    """What rank 0 left in the store: its EngineConfig fields, the resolved model directory,
    num_blocks and max_model_len. Raises when that engine is stopping (its store not yet
    closed): the worker tries again for the next one."""
    if store.check([_STOPPED_KEY]):
        raise RuntimeError("the engine at this address is stopping")
    return json.loads(store.get(_ENGINE_KEY))


def beat(host: str, port: int, rank: int, size: int, stop: threading.Event) -> None:
    """A worker's heartbeat (its own thread and store client), until `stop` or the store goes."""
    try:
        store = dist.TCPStore(host, port, size, False, timeout=datetime.timedelta(seconds=10))
        while not stop.wait(TP_HEARTBEAT_SECONDS):
            store.add(_HEARTBEAT_KEY.format(rank), 1)
    except Exception:  # the engine is gone; the main loop finds out in its next collective
        return


def start_engine_group(
    config: EngineConfig, model_path: Path, num_blocks: int, max_model_len: int
) -> EngineGroup:
    """Rank 0's set-up: its share of the cores or its GPU, then the group."""
    threads = threads_per_rank(config)
    if threads:
        torch.set_num_threads(threads)
    return EngineGroup(config, model_path, num_blocks, max_model_len)
