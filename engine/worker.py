"""A tensor-parallel worker rank (`folio engine-worker`): joins the engine's group, loads its
shard of the model and its own paged KV cache, then runs the forward of every step rank 0
broadcasts until told to stop.

It learns everything (model, dtype, device, KV pool size) from the engine through the
rendezvous store, so its command line needs only the rendezvous. Started by the engine
(`--once`) it exits when the engine stops or goes away; started by hand, on this host or
another, it tries the rendezvous again until an engine is back. It never schedules or
samples: rank 0 does.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path

import torch

from common.config import EngineConfig
from common.gguf_file import hold_gguf
from engine.core import step_plan
from engine.distributed import (
    LORA,
    STEP,
    STOP,
    TIERS,
    TP_RENDEZVOUS_RETRY_SECONDS,
    Channel,
    beat,
    connect_store,
    decode_lora,
    engine_info,
    join_group,
    leave_group,
    local_address_towards,
    rank_device,
    threads_per_rank,
)

logger = logging.getLogger(__name__)


def serve_engine(rank: int, world_size: int, master_addr: str, master_port: int) -> None:
    """Join the engine at master_addr:master_port once and run its steps until it says stop.
    Raises when the engine cannot be reached or the group breaks."""
    from engine.kv_tiers.store import KVTierStore
    from engine.lora.host import WorkerLoras
    from engine.model_runner import ModelRunner
    from engine.models.gguf_metadata import file_quantization

    store = connect_store(master_addr, master_port, rank, world_size, TP_RENDEZVOUS_RETRY_SECONDS)
    info = engine_info(store)
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    config = EngineConfig(**{k: v for k, v in info.items() if k in fields})
    if config.tensor_parallel_size != world_size:
        raise ValueError(
            f"this worker was started with --world-size {world_size}, the engine at "
            f"{master_addr}:{master_port} runs tensor_parallel_size {config.tensor_parallel_size}"
        )
    config.device = rank_device(config.device, rank)
    threads = threads_per_rank(config)
    if threads:
        torch.set_num_threads(threads)
    stop_beating = threading.Event()
    threading.Thread(
        target=beat,
        args=(master_addr, master_port, rank, world_size, stop_beating),
        name="folio-tp-heartbeat",
        daemon=True,
    ).start()
    try:
        tp = join_group(store, rank, world_size, config.device, local_address_towards(master_addr))
        loading = hold_gguf(info["model"])  # one parse of a GGUF's metadata while loading
        runner = ModelRunner(
            config, info["model"], info["num_blocks"], info["max_model_len"], tp=tp
        )
        channel = Channel(config.device)
        model_path = Path(info["model"])
        # This rank's shard of the KV tiers: it moves the blocks rank 0's book names.
        tiers = KVTierStore.create(
            config,
            runner.kv_slots,
            runner.kv_groups,
            model_path,
            config.quantization or file_quantization(model_path),
            rank,
            runner.dtype,
        )
        del loading
        loras = (
            WorkerLoras(runner.lora, config.max_lora_rank, runner.dtype)
            if runner.lora is not None
            else None
        )
        logger.info("rank %d of %d: serving %s", rank, world_size, info["model"])
        while True:
            command, payload = channel.receive()
            if command == STOP:
                if tiers is not None:
                    tiers.close()
                if loras is not None:
                    loras.close()
                return
            if command == TIERS and payload is not None:
                if tiers is None:
                    raise ValueError("rank 0 sent a KV tier message; this rank has no tiers")
                tiers.receive(payload.cpu().numpy(), channel.all_min)
                continue
            if command == LORA and payload is not None and loras is not None:
                loras.receive(*decode_lora(payload.cpu().numpy()))
                continue
            if command != STEP or payload is None:
                raise ValueError(f"unknown command {command} from rank 0")
            plan = step_plan.decode(payload.cpu().numpy())
            runner.forward(runner.prepare(plan))
            if tiers is not None:
                tiers.step_done()
    finally:
        stop_beating.set()
        leave_group()


def run_worker(rank: int, world_size: int, master_addr: str, master_port: int, once: bool) -> int:
    """`folio engine-worker`: with `once`, 0 after the engine stopped the group and 1 when it
    went away; without, it serves engine after engine until killed."""
    if not 0 < rank < world_size:
        raise ValueError(f"rank must be in 1..{world_size - 1} (rank 0 is the engine), got {rank}")
    waiting_logged = False
    while True:
        try:
            serve_engine(rank, world_size, master_addr, master_port)
            logger.info("rank %d: the engine stopped the group", rank)
            if once:
                return 0
            waiting_logged = False
        except ValueError:
            raise  # a wrong command line: retrying cannot help
        except Exception as exc:
            if once:
                logger.error("rank %d: the tensor-parallel group failed: %s", rank, exc)
                return 1
            if not waiting_logged:
                first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
                logger.warning(
                    "rank %d: no engine at %s:%d (%s); trying again until one is there",
                    rank,
                    master_addr,
                    master_port,
                    first_line,
                )
                waiting_logged = True
            time.sleep(TP_RENDEZVOUS_RETRY_SECONDS)
