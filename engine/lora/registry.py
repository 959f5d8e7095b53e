"""The engine's LoRA adapters: which are served, which are resident in the model's slots, and
who uses them. Torch-free bookkeeping; the weights are the backend's (the model executor).

An adapter is registered under a name (start-up's --lora-modules, or loaded at run time): the
backend reads and checks its files into host memory then. A request naming it holds it from
admission to its end (`enter` / `leave`), so an unload (`unload`) makes the name unknown to new
requests at once but frees the adapter only once its last request ended. Only `max_loras`
adapters sit in the model's slots at once: a request is admitted to run only once its adapter
has a slot (`pin`, the scheduler's admission gate), taken from an adapter no running request
pins, least recently used first, and loaded into it from host memory. A pinned slot is never
swapped. This module never touches tensors or reads files.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from common.block_hash import ROOT_HASH
from common.config import EngineConfig, lora_module
from common.errors import InvalidRequestError, ModelNotFound, NotFound
from engine.core.outputs import EngineStats
from engine.core.request import Request


class LoraBackend(Protocol):
    """What holds the adapters' weights (the model executor)."""

    def read_lora(self, path: str) -> object:
        """The adapter at `path` read and checked against the model, from any thread (it
        changes nothing held); AdapterError (a ValueError) naming the problem."""
        ...

    def load_lora(self, adapter_id: int, path: str, weights: object) -> None:
        """Hold `weights` (read_lora's, of `path`) in host memory as adapter `adapter_id`."""
        ...

    def drop_lora(self, adapter_id: int) -> None:
        """Forget its host copy (it is in no slot)."""
        ...

    def activate_lora(self, slot: int, adapter_id: int) -> None:
        """Copy its weights into the model's slot `slot` (no running request uses that slot)."""
        ...


@dataclass(eq=False)
class Adapter:
    name: str
    path: str
    adapter_id: int
    # The root of its requests' block hash chain: a prefix cached under one adapter (or the
    # base model) is never a hit for another, nor for a later adapter under the same name.
    hash_root: bytes
    slot: int | None = None
    in_flight: int = 0
    unloading: bool = False
    pins: set[Request] = field(default_factory=set)
    last_used: int = 0
    # Called once the adapter is gone, after an unload that had to wait for its requests.
    on_gone: list[Callable[[], None]] = field(default_factory=list)


_IDS = itertools.count(1)


def adapter_hash_root(name: str, adapter_id: int) -> bytes:
    return hashlib.sha256(ROOT_HASH + f"lora\0{name}\0{adapter_id}".encode()).digest()


class LoraRegistry:
    def __init__(self, max_loras: int, backend: LoraBackend) -> None:
        self.max_loras = max_loras
        self.backend = backend
        self.adapters: dict[str, Adapter] = {}
        self._slots: list[Adapter | None] = [None] * max_loras
        self._clock = itertools.count(1)
        self.num_swaps = 0
        # Requests that named each adapter since the start (kept past an unload: a counter).
        self.requests_total: dict[str, int] = {}

    @classmethod
    def start(cls, config: EngineConfig, backend: LoraBackend | None) -> LoraRegistry | None:
        """The engine's registry with --lora-modules loaded, or None without LoRA; ValueError
        naming the adapter and its problem."""
        if not config.lora_enabled:
            return None
        if backend is None:
            raise ValueError("this executor serves no LoRA adapters (lora_modules, lora_root)")
        registry = cls(config.max_loras, backend)
        for module in config.lora_modules:
            name, path = lora_module(module)
            try:
                registry.add(name, path)
            except ValueError as exc:
                raise ValueError(f"lora_modules {name}: {exc}") from None
        return registry

    def runtime_read(self, name: str, path: str, root: str | None) -> tuple[str, object]:
        """The first half of a load asked at run time, from any thread: `path` must resolve
        (symlinks followed) inside `root`; the resolved path and the adapter's weights read,
        or InvalidRequestError naming the rule or the adapter's problem, never a file's
        contents. runtime_add serves them."""
        if not name:
            raise InvalidRequestError("lora_name must not be empty", "lora_name")
        if root is None:
            raise InvalidRequestError(
                "loading LoRA adapters at run time needs the server started with --lora-root DIR "
                "(adapters load only from inside it)",
                "lora_path",
            )
        resolved = Path(root, path).resolve()
        if not resolved.is_relative_to(Path(root).resolve()):
            raise InvalidRequestError(
                f"lora_path {path!r} must resolve (symlinks followed) inside the server's "
                "--lora-root directory",
                "lora_path",
            )
        self._check_name_free(name)
        try:
            return str(resolved), self.backend.read_lora(str(resolved))
        except ValueError as exc:
            raise InvalidRequestError(str(exc), "lora_path") from None

    def runtime_add(self, name: str, read: tuple[str, object]) -> None:
        """Serve an adapter runtime_read read (on the engine's thread): InvalidRequestError if
        the name was taken meanwhile."""
        self._check_name_free(name)
        self.add(name, *read)

    def _check_name_free(self, name: str) -> None:
        if name in self.adapters:
            raise InvalidRequestError(
                f"a LoRA adapter named {name!r} is already loaded", "lora_name"
            )

    def runtime_remove(self, name: str, on_gone: Callable[[], None] | None = None) -> None:
        if not self.unload(name, on_gone):
            raise NotFound(f"no LoRA adapter named {name!r} is loaded", "lora_name")

    def served(self) -> list[str]:
        """The names new requests may use, in load order."""
        return [name for name, a in self.adapters.items() if not a.unloading]

    def resident(self) -> list[str]:
        return [a.name for a in self._slots if a is not None]

    def report(
        self, stats: EngineStats, running: Iterable[Request], waiting: Iterable[Request]
    ) -> None:
        """Fill `stats`' LoRA fields (vLLM's lora_requests_info: the adapters of the running
        and of the waiting requests, each once) from the scheduler's queues."""
        stats.running_lora_adapters = sorted({r.lora_name for r in running if r.lora_name})
        stats.waiting_lora_adapters = sorted({r.lora_name for r in waiting if r.lora_name})
        stats.resident_lora_adapters = self.resident()
        stats.max_lora = self.max_loras
        stats.lora_requests = dict(self.requests_total)

    def get(self, name: str) -> Adapter | None:
        """The adapter new requests naming `name` use; None if unknown or being unloaded."""
        adapter = self.adapters.get(name)
        return None if adapter is None or adapter.unloading else adapter

    def add(self, name: str, path: str, weights: object = None) -> Adapter:
        """Register `path` under `name` (its weights read now unless given); ValueError if the
        name is taken, the backend's AdapterError if the files are refused."""
        if name in self.adapters:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        if weights is None:
            weights = self.backend.read_lora(path)
        adapter_id = next(_IDS)
        self.backend.load_lora(adapter_id, path, weights)
        adapter = Adapter(name, path, adapter_id, adapter_hash_root(name, adapter_id))
        self.adapters[name] = adapter
        return adapter

    def unload(self, name: str, on_gone: Callable[[], None] | None = None) -> bool:
        """Stop serving `name` to new requests; it is freed once its requests end (`on_gone`
        runs then, at once if none runs). False if no such adapter is served."""
        adapter = self.get(name)
        if adapter is None:
            return False
        adapter.unloading = True
        if on_gone is not None:
            adapter.on_gone.append(on_gone)
        self._free_if_done(adapter)
        return True

    def adapter_for(self, name: str) -> Adapter:
        """The adapter a new request naming `name` runs with; ModelNotFound (404) if none."""
        adapter = self.get(name)
        if adapter is None:
            raise ModelNotFound(
                f"the model {name!r} does not exist: neither the base model nor a LoRA adapter "
                f"this engine serves ({', '.join(self.served()) or 'none loaded'})",
                "model",
            )
        return adapter

    @staticmethod
    def label(request: Request, adapter: Adapter) -> None:
        """Mark a new request (and its samples) as running with `adapter`, before it is
        queued: its prefix-cache lookups hash under the adapter from then on."""
        for r in (request, *request.samples):
            r.lora_name, r.hash_root = adapter.name, adapter.hash_root

    def hold(self, request: Request) -> None:
        """A labelled request was queued: its adapter is not freed before it ends."""
        adapter = self._of(request)
        if adapter is not None:
            adapter.in_flight += 1
            self.requests_total[adapter.name] = self.requests_total.get(adapter.name, 0) + 1

    def leave(self, request: Request) -> None:
        """A request (or sample) ended: it pins nothing any more; a top-level one no longer
        holds its adapter."""
        adapter = self._of(request)
        if adapter is None:
            return
        adapter.pins.discard(request)
        if request.parent is None:
            adapter.in_flight -= 1
            self._free_if_done(adapter)

    def pin(self, request: Request) -> bool:
        """Whether `request` may run now: True for the base model, or once its adapter has a
        slot (taking and filling the least recently used unpinned one if it has none); the
        request (and its samples) then carry the slot. False when every slot is pinned."""
        adapter = self._of(request)
        if adapter is None:
            return True
        if adapter.slot is None and not self._take_slot(adapter):
            return False
        assert adapter.slot is not None
        adapter.pins.add(request)
        adapter.last_used = next(self._clock)
        request.lora_slot = adapter.slot
        for sample in request.samples:
            sample.lora_slot = adapter.slot
        return True

    def unpin(self, request: Request) -> None:
        """A preempted request runs no more until admitted again."""
        adapter = self._of(request)
        if adapter is not None:
            adapter.pins.discard(request)

    def _of(self, request: Request) -> Adapter | None:
        return None if request.lora_name is None else self.adapters.get(request.lora_name)

    def _take_slot(self, adapter: Adapter) -> bool:
        free = [s for s, held in enumerate(self._slots) if held is None]
        if free:
            slot = free[0]
        else:
            idle = [s for s, held in enumerate(self._slots) if held is not None and not held.pins]
            if not idle:
                return False
            slot = min(idle, key=lambda s: self._slots[s].last_used)  # type: ignore[union-attr]
            evicted = self._slots[slot]
            assert evicted is not None
            evicted.slot = None
            self.num_swaps += 1
        self.backend.activate_lora(slot, adapter.adapter_id)
        self._slots[slot] = adapter
        adapter.slot = slot
        return True

    def _free_if_done(self, adapter: Adapter) -> None:
        if not adapter.unloading or adapter.in_flight > 0:
            return
        if adapter.slot is not None:
            self._slots[adapter.slot] = None
        del self.adapters[adapter.name]
        self.backend.drop_lora(adapter.adapter_id)
        for callback in adapter.on_gone:
            callback()


def find_adapter(registry: LoraRegistry | None, name: str | None) -> Adapter | None:
    """The adapter a new request naming `name` runs with (None: the base model); ModelNotFound
    (404) if this engine serves no such adapter."""
    if name is None:
        return None
    if registry is None:
        raise ModelNotFound(
            f"the model {name!r} does not exist: this engine serves no LoRA adapters", "model"
        )
    return registry.adapter_for(name)


def runtime_lora(registry: LoraRegistry | None, config: EngineConfig) -> LoraRegistry:
    """The registry run-time loads and unloads go to; InvalidRequestError where they are off."""
    if not config.lora_runtime_updates:
        raise InvalidRequestError(
            "loading and unloading LoRA adapters at run time is disabled on this server "
            "(--no-lora-runtime-updates)"
        )
    if registry is None:
        raise InvalidRequestError(
            "this server serves no LoRA adapters: start it with --lora-root DIR (and optionally "
            "--lora-modules) to load them at run time"
        )
    return registry


def lora_listing(registry: LoraRegistry | None) -> list[tuple[str, bool]]:
    """The adapters new requests may use, each with whether it sits in a slot now."""
    if registry is None:
        return []
    resident = set(registry.resident())
    return [(name, name in resident) for name in registry.served()]
