"""The tiers' data path in the model executor: moves KV blocks between the pool's tensors, the
host tier (engine.kv_tiers.host_tier) and the disk tier (engine.kv_tiers.disk_tier).

Per step, before the forward (`apply`): the blocks the step's allocations evicted are copied out
of the pool, one indexed copy per layer into a staging tensor (the forward may overwrite their
pool blocks next), and handed to the save thread (`SaveThread`), which stores them in their host
slots (quantizing them in the int8 format) while the engine goes on with its step: the step pays
one copy, never the quantization. Then the blocks claimed from the tiers are written into their
fresh pool blocks, one indexed copy per layer; a load from a slot whose save is still queued
first has that save done (the book lists the block in the host tier from its eviction on: the
save thread runs at the lowest priority, so the load takes back the saves it has not started
and does them itself). After
the step (`persist`, through the book's sink) the blocks newly cached are gathered once and
queued, as bytes, for the disk tier's writer thread. Batched per step, never per block; on CUDA
the host side is pinned memory. The engine thread's host-side work runs on one torch thread, and
so does the save thread: it is memory-bound, and torch's intra-op threads only wait on each other
there (on the shared 2-core host, a restart's 62-block scatter took 350 ms on two threads and 27
ms on one; dequantizing 16 blocks 12 ms and 1 ms).

The save thread is a speed-up, never a risk: if a save fails there, the failure is logged once,
the saves it had not done are redone on the engine's thread in their order, and every later save
runs there. Built only where tiers are asked for (`create`), with the start-up checks that name
the flag. It never decides which block goes where (the book does).

With tensor parallelism every rank has a store of its own shard (its KV heads: its host tier,
save thread and disk files); rank 0's has the book and sends every move it makes to the other
ranks' first (engine.kv_tiers.ranks), and the pinned hashes after each step that changed them
(every rank's disk bound deletes pinned blocks' files last), and asks them all whether a block
found in its own disk files is in theirs too: only a block every rank verified is loaded, by
every rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.config import EngineConfig
from engine.attention.kv_dtype import copyable
from engine.core.kv_cache_manager import KVGroups
from engine.kv_tiers import ranks
from engine.kv_tiers.book import TierBook, TierTransfers, key_hash
from engine.kv_tiers.disk_tier import DiskTier, model_identity
from engine.kv_tiers.host_tier import HostTier, bytes_per_block, resolve_format

logger = logging.getLogger(__name__)

GIB = 1024**3
# Staged bytes the save thread may have queued: past it a step waits for the oldest save (it
# never drops one: the book already lists the blocks in the host tier).
MAX_QUEUED_SAVE_BYTES = 256 * 1024**2


@dataclass
class _Save:
    slots: torch.Tensor
    blocks: torch.Tensor  # the staged copy: [layers, 2, n, block_size, heads, head_dim]
    future: Future[None]


class SaveThread:
    """Stores staged blocks into their host slots on one background thread, in the order
    submitted (so the last save into a slot wins, as the book's order says); `settle` makes a
    load wait for the saves into the slots it reads."""

    def __init__(self, host: HostTier) -> None:
        self.host = host
        self._queued: deque[_Save] = deque()  # oldest first, until seen done
        self._queued_bytes = 0
        # Loads that found a save into their slots still queued, and had it done first.
        self.waited = 0
        threads = torch.get_num_threads()
        self._executor: ThreadPoolExecutor | None = ThreadPoolExecutor(
            1, "kv-host-tier-saves", initializer=_background_thread
        )
        # Started now, then torch's default for threads starting later put back: setting the
        # save thread's one thread set it too (its own intra-op threads are its own).
        try:
            self._executor.submit(int).result()
        except Exception as error:  # the thread did not start: saves on the engine's thread
            self._fall_back(error)
        torch.set_num_threads(threads)

    @property
    def pending(self) -> int:
        """Saves submitted and not seen done yet."""
        self._reap()
        return len(self._queued)

    def submit(self, slots: torch.Tensor, blocks: torch.Tensor) -> None:
        self._reap()
        while self._queued and self._queued_bytes + blocks.nbytes > MAX_QUEUED_SAVE_BYTES:
            self._run_through(self._queued[0])
        if self._executor is not None:
            try:
                future = self._executor.submit(self.host.store, slots, blocks)
            except RuntimeError as error:  # the executor broke or was shut down
                self._fall_back(error)
            else:
                self._queued.append(_Save(slots, blocks, future))
                self._queued_bytes += blocks.nbytes
                return
        self.host.store(slots, blocks)

    def settle(self, slots: list[int]) -> None:
        """Return once no save into `slots` is queued (a load reads them next)."""
        wanted = set(slots)
        last = None
        for save in self._queued:
            if not wanted.isdisjoint(save.slots.tolist()):
                last = save
        if last is not None:
            self.waited += 1
            self._run_through(last)

    def drain(self) -> None:
        """Return once every save submitted is stored (tests, benchmarks, shutdown)."""
        if self._queued:
            self._run_through(self._queued[-1])

    def close(self) -> None:
        self.drain()
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None

    def _run_through(self, last: _Save) -> None:
        """Return once `last` and every save before it are stored. The save thread runs at
        the lowest priority, so on a busy machine it may wait long: the saves it has not
        started are taken back (cancelled from the newest: it starts them oldest first, so
        those it started are a prefix) and the ones up to `last` are done on this thread, after
        the one it is running; the ones after `last` are queued again behind them, in order."""
        queued = list(self._queued)
        taken: list[_Save] = []
        for save in reversed(queued):
            if not save.future.cancel():
                break
            taken.append(save)
        taken.reverse()
        started = queued[: len(queued) - len(taken)]
        if started:
            with contextlib.suppress(Exception):  # _reap sees it, and falls back
                started[-1].future.result()
            for _ in started:
                self._reap_one()
                if self._executor is None:
                    return  # fallen back: every queued save is stored
        index = next((i for i, save in enumerate(taken) if save is last), -1)
        try:
            for save in taken[: index + 1]:
                self.host.store(save.slots, save.blocks)
                self._pop_oldest()
        except Exception as error:
            self._fall_back(error)  # this save again, then the ones after it, here
            return
        for save in taken[index + 1 :]:
            assert self._executor is not None
            save.future = self._executor.submit(self.host.store, save.slots, save.blocks)

    def _reap(self) -> None:
        """Forget the saves done, oldest first; the first failed one means falling back."""
        while self._queued and self._queued[0].future.done() and self._executor is not None:
            self._reap_one()

    def _reap_one(self) -> None:
        """The oldest save is done: forget it, or fall back if it failed."""
        error = self._queued[0].future.exception()
        if error is not None:
            self._fall_back(error)
            return
        self._pop_oldest()

    def _pop_oldest(self) -> _Save:
        save = self._queued.popleft()
        self._queued_bytes -= save.blocks.nbytes
        return save

    def _fall_back(self, error: BaseException) -> None:
        """The save thread failed: log once, let it finish what it holds, then redo on this
        thread, in their order, the failed save and every one queued after it (redoing only
        the failed ones could write an older block over a newer one in a slot), and do every
        later save here."""
        logger.error(
            "--kv-offload-gib: the host tier's save thread failed (%s: %s); saving on the "
            "engine's thread from now on",
            type(error).__name__,
            error,
        )
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        while self._queued:
            save = self._pop_oldest()
            self.host.store(save.slots, save.blocks)


class KVTierStore:
    """One rank's tiers: its host tier, its disk files, and on rank 0 the book. With tensor
    parallelism rank 0 sends what the book decides to the other ranks (`link_ranks`), each of
    which moves its own shard of the same blocks (`receive`: engine.kv_tiers.ranks)."""

    def __init__(
        self,
        kv_slots: list[torch.Tensor],
        host: HostTier | None,
        disk: DiskTier | None,
        book: TierBook | None,
    ) -> None:
        self.kv_slots = kv_slots
        _, _, block_size, heads, head_dim = kv_slots[0].shape
        self.block_shape = (len(kv_slots), 2, block_size, heads, head_dim)
        self.dtype = kv_slots[0].dtype
        self.device = kv_slots[0].device
        self.host = host
        self.disk = disk
        self.saves = SaveThread(host) if host is not None else None
        # Rank 0's: the book, and (with other ranks) how it sends them a message and agrees.
        self._book = book
        self._share: Callable[[np.ndarray], None] | None = None
        self._agree: Callable[[np.ndarray], np.ndarray] | None = None
        # Another rank's: the disk payloads every rank verified at rank 0's probes, until the
        # step that loads them (rank 0's book keeps its own), and the block hashes rank 0 last
        # said are pinned (its disk bound deletes their files last, as rank 0's does).
        self._staged: dict[bytes, bytes] = {}
        self._pinned: frozenset[bytes] = frozenset()
        if book is not None:
            book.sink = self.persist
        elif disk is not None:
            disk.pinned = lambda key: key_hash(key) in self._pinned

    @property
    def book(self) -> TierBook:
        assert self._book is not None, "only rank 0 keeps the tiers' book"
        return self._book

    @classmethod
    def create(
        cls,
        config: EngineConfig,
        kv_slots: list[torch.Tensor],
        groups: KVGroups,
        model_path: Path,
        quantization: str | None,
        rank: int = 0,
        activations: torch.dtype | None = None,
    ) -> KVTierStore | None:
        """The store of tensor-parallel rank `rank` (rank 0's with the book), or None when no
        tier is asked for; ValueError in one line naming the flag when the tiers cannot serve
        this engine. The flags bound the tiers of all ranks together: each rank holds 1/N of
        every block (its KV heads) in 1/N of the bytes. `activations`: the model's dtype where
        the pool's is narrower (--kv-cache-dtype): its K and V, rounded, are other values than
        a pool of that dtype's own model holds. An entry of a tier is one block id of
        the pool (every cache slot's block: one KV group's layers), whatever `groups` say."""
        if not config.kv_offload_gib and config.kv_cache_dir is None:
            return None
        tp_size = config.tensor_parallel_size
        _, _, block_size, heads, head_dim = kv_slots[0].shape
        shape = (len(kv_slots), 2, block_size, heads, head_dim)
        dtype, device = kv_slots[0].dtype, kv_slots[0].device
        host = None
        if config.kv_offload_gib:
            fmt = resolve_format(config.kv_offload_format, device, dtype)
            per_block = bytes_per_block(shape, dtype, fmt) * tp_size
            num_slots = int(config.kv_offload_gib * GIB) // per_block
            if num_slots < 1:
                raise ValueError(
                    f"--kv-offload-gib {config.kv_offload_gib:g} is below one KV block "
                    f"({per_block} bytes in the {fmt} format); raise it"
                )
            host = HostTier(num_slots, shape, dtype, fmt, pin=device.type == "cuda")
        disk = None
        if config.kv_cache_dir is not None:
            identity = {
                "format": 1,
                "model": model_identity(model_path),
                "dtype": str(dtype),
                "block_size": block_size,
                "tensor_parallel_size": tp_size,
                "quantization": quantization,
                "kv_shape": list(shape),  # one rank's
            }
            if activations not in (None, dtype):
                identity["activations"] = str(activations)
            if groups.num_groups > 1:
                # Which layers a group's block holds in which cache slot (a one-group model's
                # identity has none, as before groups had tiers).
                identity["kv_groups"] = {
                    "windows": list(groups.windows),
                    "layer_group": list(groups.layer_group),
                    "layer_slot": list(groups.layer_slot),
                }
            disk = DiskTier(
                config.kv_cache_dir,
                int(config.kv_cache_dir_gib * GIB),
                bytes_per_block(shape, dtype, "native") * tp_size,
                identity,
                rank if tp_size > 1 else None,
                tp_size,
            )
        if rank:
            return cls(kv_slots, host, disk, None)
        book = TierBook(host.num_slots if host is not None else 0, disk, block_size)
        return cls(kv_slots, host, disk, book)

    def link_ranks(
        self, share: Callable[[np.ndarray], None], agree: Callable[[np.ndarray], np.ndarray]
    ) -> None:
        """Rank 0 with other ranks: `share(message)` broadcasts a tier message to them (they
        `receive` it), `agree(flags)` is the all-ranks minimum of each flag. From now on every
        move the book makes is sent to them before rank 0 makes it, and a block found in rank
        0's disk files counts as on disk only when every rank verified its own file of it."""
        self._share, self._agree = share, agree
        self.book.ranks_hold = self._ranks_hold

    def _ranks_hold(self, hashes: list[bytes]) -> list[bool]:
        """Whether every rank verified its own file of each block (rank 0 has, already)."""
        assert self._share is not None and self._agree is not None
        self._share(ranks.encode_probe(hashes))
        return [bool(v) for v in self._agree(np.ones(len(hashes), dtype=np.int64))]

    def receive(self, message: np.ndarray, agree: Callable[[np.ndarray], np.ndarray]) -> None:
        """Another rank: rank 0's tier message, on this rank's shard. A probe's verdict is
        every rank's (`agree`), so all ranks stage, and later load, the same blocks."""
        decoded = ranks.decode(message)
        if isinstance(decoded, list):
            payloads = [self.disk.read(h) if self.disk is not None else None for h in decoded]
            held = agree(np.array([p is not None for p in payloads], dtype=np.int64))
            for key, payload, everywhere in zip(decoded, payloads, held, strict=True):
                if everywhere and payload is not None:
                    self._staged[key] = payload
            return
        if decoded.pinned is not None:
            self._pinned = frozenset(decoded.pinned)  # read by the disk tier's writer thread
        self._persist(decoded.persists)
        transfers = decoded.transfers
        transfers.payloads = {h: self._staged.pop(h) for h, _ in transfers.disk_loads}
        with one_thread():
            self._apply(transfers)

    def step_done(self) -> None:
        """Another rank, after each step: payloads staged and not loaded are dropped (rank 0's
        book drops its own when the step takes its transfers)."""
        self._staged.clear()

    def _gather(self, blocks: list[int]) -> torch.Tensor:
        """[layers, 2, n, block_size, heads, head_dim] copies of pool blocks, on the pool's
        device: one indexed copy per layer, straight into the result."""
        index = torch.tensor(blocks, device=self.device)
        layers, _, *block = self.block_shape
        out = torch.empty((layers, 2, len(blocks), *block), dtype=self.dtype, device=self.device)
        for layer, kv in enumerate(self.kv_slots):
            torch.index_select(kv, 1, index, out=out[layer])
        return out

    def _scatter(self, blocks: list[int], data: torch.Tensor) -> None:
        """data: [layers, 2, n, ...] (any strides), into the pool blocks `blocks`."""
        index = torch.tensor(blocks, device=self.device)
        data = data.to(self.device, non_blocking=True)
        for layer, kv in enumerate(self.kv_slots):
            copyable(kv).index_copy_(1, index, copyable(data[layer]))

    def apply(self, transfers: TierTransfers) -> None:
        """The step's saves, then its loads (a block evicted this step may be loaded into);
        sent to the other ranks first, so that they move their shards meanwhile."""
        if self._share is not None and transfers:
            self._share(ranks.encode_moves(ranks.TierMoves(transfers=transfers)))
        with one_thread():
            self._apply(transfers)

    def _apply(self, transfers: TierTransfers) -> None:
        if transfers.saves:
            assert self.saves is not None, "saves without a host tier"
            blocks, slots = zip(*transfers.saves, strict=True)
            self.saves.submit(torch.tensor(slots), self._gather(list(blocks)))
        if transfers.host_loads:
            assert self.host is not None and self.saves is not None, "loads without a host tier"
            slots, blocks = zip(*transfers.host_loads, strict=True)
            self.saves.settle(list(slots))
            self._scatter(list(blocks), self.host.fetch(torch.tensor(slots)))
        if transfers.disk_loads:
            keys, blocks = zip(*transfers.disk_loads, strict=True)
            payload = b"".join(transfers.payloads[k] for k in keys)
            raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            data = raw.view(self.dtype).reshape(len(blocks), *self.block_shape)
            self._scatter(list(blocks), data.movedim(0, 2))

    def persist(self, persists: list[tuple[int, bytes]], pinned: list[bytes] | None) -> None:
        """Queue the newly cached blocks' files (the disk tier writes them in its thread), on
        every rank; the other ranks are sent the pinned hashes too when they changed (this
        rank's disk tier asks the pins themselves)."""
        if self._share is not None and (persists or pinned is not None):
            self._share(ranks.encode_moves(ranks.TierMoves(persists=persists, pinned=pinned)))
        self._persist(persists)

    def _persist(self, persists: list[tuple[int, bytes]]) -> None:
        if not persists or self.disk is None:
            return
        blocks, keys = zip(*persists, strict=True)
        with one_thread():
            # A file holds one block: [layers, 2, block_size, heads, head_dim].
            data = self._gather(list(blocks)).movedim(2, 0).contiguous().cpu()
        for key, block in zip(keys, data, strict=True):
            self.disk.write(key, block.view(torch.uint8).numpy().tobytes())

    def close(self) -> None:
        """Finish the queued saves and stop the save thread; write the queued files."""
        if self.saves is not None:
            self.saves.close()
        if self.disk is not None:
            self.disk.close()


def _background_thread() -> None:
    """The save thread runs its torch work on one thread, and at the lowest priority (Linux:
    a thread's nice value is its own): it takes the cores the engine leaves idle (its Python
    between kernels, the decode steps' small forwards), not the forward's, whose OpenMP
    threads would all wait for the one it displaced (a load that needs a queued save takes it
    back: SaveThread._run_through)."""
    # A thread's first torch call reads the process's default number of intra-op threads into
    # its own (OpenMP's are per thread): made first, so that the one set after stays.
    torch.get_num_threads()
    torch.set_num_threads(1)
    with contextlib.suppress(OSError, AttributeError):  # a platform without per-thread nice
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op threads set to one for the block, then back (a free switch)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
