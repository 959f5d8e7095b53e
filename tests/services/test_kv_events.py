"""KV-cache events over real gRPC from a real engine on a tiny random-weight Llama: batches come
numbered in order within one epoch, name blocks by the chained hash of common/block_hash.py (what
the gateway computes), replay what a subscriber missed after it reconnects, send a snapshot when
the gap is older than the replay buffer, report evictions, and a subscriber that applies them
ends up knowing exactly the blocks the engine's prefix cache holds."""

from __future__ import annotations

import random
import time

import pytest
from common.grpc_stubs.folio.v1 import common_pb2, engine_pb2, engine_pb2_grpc

from common.block_hash import prefix_block_hashes
from common.config import EngineConfig
from grpc_helpers import TIMEOUT, ServerThread
from services.engine.server import EngineService
from tiny_models import VARIANTS, make_checkpoint

BLOCK = 4
# A small pool (evictions come soon) and a small replay buffer (snapshots come soon).
ENGINE_ARGS = dict(
    dtype="float32",
    block_size=BLOCK,
    num_kv_blocks=24,
    max_num_batched_tokens=64,
    max_num_seqs=4,
    kv_events_replay_batches=6,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    config_class, kwargs = VARIANTS["llama"]
    make_checkpoint(directory, config_class, kwargs)
    server = ServerThread(
        EngineService(EngineConfig(model=str(directory), **ENGINE_ARGS), "127.0.0.1", 0)
    )
    yield server
    server.close()


@pytest.fixture
def stub(server):
    return engine_pb2_grpc.EngineServiceStub(server.channel)


_rng = random.Random(7)


def fresh_prompt(length: int) -> list[int]:
    """Token ids no earlier prompt of this module started with."""
    return [_rng.randrange(3, 150) for _ in range(length)]


def run(stub, ids: list[int], max_tokens: int = 3) -> list[int]:
    """Generate greedily to the end; the prompt plus the generated tokens."""
    request = engine_pb2.GenerateRequest(
        add=engine_pb2.EngineRequest(
            request_id=f"r{time.monotonic_ns()}",
            prompt_token_ids=ids,
            sampling_params=common_pb2.SamplingParams(
                temperature=0.0, max_tokens=max_tokens, ignore_eos=True
            ),
        )
    )
    tokens = list(ids)
    for response in stub.Generate(iter([request]), timeout=TIMEOUT):
        for out in response.outputs:
            assert not out.HasField("error"), out.error
            tokens += out.token_ids
    return tokens


def cached_prefix(tokens: list[int], max_tokens: int = 3) -> list[bytes]:
    """The hashes of the full blocks the engine cached for a finished request: its last token
    was never computed."""
    return prefix_block_hashes(tokens[:-1], BLOCK)


class Subscriber:
    """A SubscribeKvEvents stream and the index a router would build from it."""

    def __init__(self, stub, start: int = 0, epoch: str = "") -> None:
        self.call = stub.SubscribeKvEvents(
            engine_pb2.SubscribeKvEventsRequest(start_sequence_number=start, epoch=epoch),
            timeout=TIMEOUT,
        )
        self.batches: list[engine_pb2.SubscribeKvEventsResponse] = []
        self.blocks: set[bytes] = set()
        self.stored: list[bytes] = []  # every stored hash, in order
        self.removed: list[bytes] = []

    def read_until(self, done) -> None:
        """Read batches until done(self) holds (the stream's deadline fails a test that waits
        for what never comes)."""
        while not done(self):
            batch = next(self.call)
            self.batches.append(batch)
            for event in batch.events:
                kind = event.WhichOneof("event")
                if kind == "all_blocks_cleared":
                    self.blocks.clear()
                elif kind == "block_stored":
                    stored = event.block_stored
                    assert stored.block_size == BLOCK
                    assert len(stored.token_ids) == BLOCK * len(stored.block_hashes)
                    self.blocks.update(stored.block_hashes)
                    self.stored += stored.block_hashes
                else:
                    self.blocks.difference_update(event.block_removed.block_hashes)
                    self.removed += event.block_removed.block_hashes

    def holds(self, hashes: list[bytes]):
        return lambda s: set(hashes) <= s.blocks

    def close(self) -> None:
        self.call.cancel()


def engine_cached_hashes(server) -> set[bytes]:
    return server.service.engine.engine.kv_cache.announced_hashes()


def test_stored_blocks_are_numbered_in_order_with_the_shared_chained_hash(server, stub):
    subscriber = Subscriber(stub)
    try:
        first = run(stub, fresh_prompt(10))
        # A second request sharing the first one's first two blocks stores only what is new.
        second = run(stub, first[:8] + fresh_prompt(6))
        expected_first = cached_prefix(first)
        expected_second = cached_prefix(second)
        subscriber.read_until(subscriber.holds(expected_first + expected_second))
    finally:
        subscriber.close()
    batches = subscriber.batches
    assert len({b.epoch for b in batches}) == 1 and batches[0].epoch
    numbers = [b.sequence_number for b in batches]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    # The engine's hashes are the ones common/block_hash.py computes from the token ids, each
    # stored once, the shared prefix not again, in the order the blocks filled.
    assert subscriber.stored[-len(expected_first) - 2 :] == expected_first + expected_second[2:]
    chain = [e.block_stored for b in batches for e in b.events if e.HasField("block_stored")]
    last = chain[-1]
    assert last.parent_block_hash in (expected_second[1], *expected_second[2:])
    assert last.token_ids == second[: len(expected_second) * BLOCK][-len(last.token_ids) :]


def test_a_subscriber_that_reconnects_gets_what_it_missed(server, stub):
    subscriber = Subscriber(stub)
    tokens = run(stub, fresh_prompt(9))
    subscriber.read_until(subscriber.holds(cached_prefix(tokens)))
    subscriber.close()
    last, epoch = subscriber.batches[-1].sequence_number, subscriber.batches[-1].epoch

    missed = run(stub, fresh_prompt(7))  # stored while nobody listened
    again = Subscriber(stub, start=last + 1, epoch=epoch)
    try:
        again.read_until(again.holds(cached_prefix(missed)))
    finally:
        again.close()
    first = again.batches[0]
    assert not first.snapshot
    assert first.sequence_number == last + 1 and first.epoch == epoch
    numbers = [b.sequence_number for b in again.batches]
    assert numbers == list(range(last + 1, last + 1 + len(numbers)))


def test_a_gap_older_than_the_replay_buffer_gets_a_snapshot_of_the_cache(server, stub):
    subscriber = Subscriber(stub)
    subscriber.read_until(lambda s: s.batches)  # a snapshot or the latest batches
    subscriber.close()
    last, epoch = subscriber.batches[-1].sequence_number, subscriber.batches[-1].epoch
    # More batches than the buffer keeps (each request stores blocks in at least one step).
    for _ in range(ENGINE_ARGS["kv_events_replay_batches"] + 1):
        run(stub, fresh_prompt(6), max_tokens=1)
    again = Subscriber(stub, start=last + 1, epoch=epoch)
    try:
        again.read_until(lambda s: s.batches)
        snapshot = again.batches[0]
        assert snapshot.snapshot and snapshot.sequence_number > last
        assert snapshot.events[0].HasField("all_blocks_cleared")
        # The engine is idle: the snapshot holds exactly what its prefix cache holds.
        assert again.blocks == engine_cached_hashes(server)
        # And the stream goes on live from there.
        tokens = run(stub, fresh_prompt(9))
        again.read_until(again.holds(cached_prefix(tokens)))
        numbers = [b.sequence_number for b in again.batches]
        assert numbers == list(
            range(snapshot.sequence_number, snapshot.sequence_number + len(numbers))
        )
    finally:
        again.close()


def test_evictions_are_reported_and_the_index_matches_the_cache(server, stub):
    subscriber = Subscriber(stub, start=5, epoch="another-engine")
    try:
        # Distinct prompts of 5 blocks each fill the 24-block pool: older cached blocks go.
        last_tokens: list[int] = []
        for _ in range(6):
            last_tokens = run(stub, fresh_prompt(18))
        subscriber.read_until(subscriber.holds(cached_prefix(last_tokens)))
        # Another engine's epoch: a snapshot first, whatever its numbers said.
        assert subscriber.batches[0].snapshot
        assert subscriber.removed, "a full pool evicted no cached block"
        assert set(subscriber.removed) <= set(subscriber.stored) | {
            h for b in subscriber.batches[:1] for e in b.events for h in e.block_stored.block_hashes
        }
        assert subscriber.blocks == engine_cached_hashes(server)
    finally:
        subscriber.close()
