"""The routing policies as pure decisions over a prefix index and loads made up in the test:
cache_aware follows the longest held prefix, breaks ties and unheld prompts by load, skips a
replica over the load threshold and says why, scores a prefix in a replica's KV host tier
between one in its pool and none, and prefers a replica with the request's LoRA adapter resident
(after the prefix, before the load); least_load and round_robin do what they say; the index follows
stored, removed and cleared blocks and matches leading blocks only. (And the KV tiers' series
and the LoRA series on /metrics, pooled over replicas, which the same engine reports feed.)"""

from __future__ import annotations

from collections import Counter

import pytest

from common.block_hash import prefix_block_hashes
from gateway.engines.replicas import Replica, pool_lora_stats
from gateway.engines.routing import (
    BALANCE_ABS,
    SETTLED_STEPS,
    CacheAware,
    LeastLoad,
    PrefixIndex,
    ReplicaLoad,
    RoundRobin,
    make_policy,
)
from gateway.messages import EngineStats
from gateway.metrics import Metrics

BLOCK = 4
PROMPT = list(range(100, 132))  # 8 full blocks
HASHES = prefix_block_hashes(PROMPT, BLOCK)


def index_with(holdings: dict[int, int]) -> PrefixIndex:
    """Replica -> how many leading blocks of PROMPT it holds."""
    index = PrefixIndex()
    for replica, count in holdings.items():
        index.stored(replica, HASHES[:count])
    return index


def idle(*replicas: int) -> dict[int, ReplicaLoad]:
    return {r: ReplicaLoad() for r in replicas}


def test_the_index_matches_leading_blocks_only_and_follows_removals_and_clears():
    index = index_with({0: 8, 1: 3})
    index.stored(2, HASHES[4:])  # later blocks without the first ones: no prefix match
    assert index.match(HASHES) == {0: 8, 1: 3}
    index.removed(0, [HASHES[5]])
    assert index.match(HASHES) == {0: 5, 1: 3}
    index.clear(1)
    assert index.match(HASHES) == {0: 5}
    assert index.num_blocks(1) == 0 and index.num_blocks(2) == 4
    assert index.match(prefix_block_hashes([7] * 32, BLOCK)) == {}


def test_cache_aware_goes_where_the_longest_prefix_is():
    decision = CacheAware().choose([0, 1, 2], HASHES, index_with({0: 2, 1: 7, 2: 4}), idle(0, 1, 2))
    assert decision.replica == 1 and decision.matched_blocks == 7
    assert "holds 7/8 leading blocks" in decision.reason


def test_cache_aware_breaks_ties_and_unheld_prompts_by_load():
    loads = {0: ReplicaLoad(unreported=3), 1: ReplicaLoad(running=1), 2: ReplicaLoad(waiting=2)}
    tie = CacheAware().choose([0, 1, 2], HASHES, index_with({0: 8, 1: 8, 2: 8}), loads)
    assert tie.replica == 1
    # Nobody holds a worthwhile share of the prompt: load alone decides.
    unheld = CacheAware().choose([0, 1, 2], HASHES, index_with({0: 1}), loads)
    assert unheld.replica == 1 and "no replica holds enough" in unheld.reason


def test_cache_aware_skips_a_replica_over_the_load_threshold():
    loads = {0: ReplicaLoad(unreported=int(BALANCE_ABS) + 20), 1: ReplicaLoad(), 2: ReplicaLoad()}
    decision = CacheAware().choose([0, 1, 2], HASHES, index_with({0: 8, 1: 2}), loads)
    assert decision.replica != 0
    assert "1 over the load threshold" in decision.reason
    # Everyone overloaded alike: nobody is skipped, the prefix decides again.
    busy = {r: ReplicaLoad(unreported=50) for r in (0, 1, 2)}
    assert CacheAware().choose([0, 1, 2], HASHES, index_with({0: 8}), busy).replica == 0


def test_cache_aware_chooses_only_among_the_candidates():
    decision = CacheAware().choose([1, 2], HASHES, index_with({0: 8, 2: 5}), idle(0, 1, 2))
    assert decision.replica == 2


def test_least_load_and_round_robin():
    loads = {0: ReplicaLoad(running=4), 1: ReplicaLoad(waiting=1), 2: ReplicaLoad(running=1)}
    least = LeastLoad()
    picks = [least.choose([0, 1, 2], HASHES, index_with({0: 8}), loads).replica for _ in range(4)]
    assert picks == [1, 2, 1, 2]  # ties take turns
    turns = RoundRobin()
    picks = [turns.choose([0, 1, 2], [], PrefixIndex(), loads).replica for _ in range(6)]
    assert Counter(picks) == {0: 2, 1: 2, 2: 2}


def test_make_policy_names():
    assert make_policy("cache_aware").name == "cache_aware"
    with pytest.raises(ValueError, match="routing policy"):
        make_policy("random")


def timed(**fields) -> ReplicaLoad:
    """A replica that reports step timings, settled: 1 ms a prefill token, 20 ms a step,
    4-token blocks, a pool of 1,000 blocks and a 64-token step budget, unless told otherwise."""
    base = dict(
        measured_steps=SETTLED_STEPS,
        prefill_token_seconds=0.001,
        decode_step_seconds=0.02,
        block_size=BLOCK,
        num_kv_blocks=1000,
        token_budget=64,
    )
    return ReplicaLoad(**{**base, **fields})


def test_cache_aware_goes_where_the_first_token_comes_soonest():
    index = index_with({0: 8})
    # Replica 0 holds the whole prompt but has 2,000 prefill tokens queued (about 2.6 s);
    # replica 1 computes the 32 tokens at once (about 50 ms).
    loads = {0: timed(queued_prefill_tokens=2000), 1: timed()}
    decision = CacheAware().choose([0, 1], HASHES, index, loads)
    assert decision.replica == 1 and "first token expected in" in decision.reason
    # Queued work this gateway placed since the last report counts the same.
    loads = {0: timed(unreported=5, unreported_tokens=2000), 1: timed()}
    assert CacheAware().choose([0, 1], HASHES, index, loads).replica == 1
    # Decoding load: steps of 200 ms against 20 ms outweigh 32 cached tokens.
    loads = {0: timed(decode_step_seconds=0.2), 1: timed()}
    assert CacheAware().choose([0, 1], HASHES, index, loads).replica == 1


def test_cache_aware_prefers_the_prefix_when_within_a_step():
    # Holding 8 of 8 blocks saves 32 ms of prefill: the holder wins; one queued a little more
    # work (within a step of the best) still does.
    loads = {0: timed(queued_prefill_tokens=40), 1: timed()}
    decision = CacheAware().choose([0, 1], HASHES, index_with({0: 8}), loads)
    assert decision.replica == 0 and decision.matched_blocks == 8


def test_a_replica_too_fresh_for_its_own_timings_is_timed_like_the_one_that_ran_most():
    # Replica 0 has run (and timed) 500 steps; replica 1 none: what it reports is the step
    # cost model it started from, 3x off either way.
    settled = dict(measured_steps=500)
    # Slower than it is: replica 0, 72 tokens of prefill in two steps (112 ms) would win
    # against 156 ms, though replica 1 computes the prompt in one step (52 ms).
    loads = {
        0: timed(queued_prefill_tokens=40, **settled),
        1: timed(prefill_token_seconds=0.003, decode_step_seconds=0.06, measured_steps=0),
    }
    decision = CacheAware().choose([0, 1], HASHES, PrefixIndex(), loads)
    assert decision.replica == 1 and "expected in 52 ms" in decision.reason
    # Faster than it is: replica 0 holds the whole prompt (a step and 10 queued tokens, 90
    # ms); replica 1 would seem to compute it in 52 ms, but takes 156.
    slow = dict(prefill_token_seconds=0.003, decode_step_seconds=0.06)
    loads = {0: timed(queued_prefill_tokens=10, **slow, **settled), 1: timed(measured_steps=0)}
    decision = CacheAware().choose([0, 1], HASHES, index_with({0: 8}), loads)
    assert decision.replica == 0 and decision.matched_blocks == 8


def test_while_no_replica_has_settled_counts_and_prefixes_decide():
    """Two fresh replicas' timings are their start-up cost models, apart by more than a short
    prefix saves: the prefix holder wins though its own model calls it 3x slower, and the load
    threshold still applies."""
    slow = dict(prefill_token_seconds=0.003, decode_step_seconds=0.06)
    loads = {0: timed(**slow, measured_steps=50), 1: timed(measured_steps=99)}
    decision = CacheAware().choose([0, 1], HASHES, index_with({0: 8}), loads)
    assert decision.replica == 0 and "holds 8/8 leading blocks" in decision.reason
    assert "first token expected" not in decision.reason
    loads = {0: timed(**slow, measured_steps=50, running=30), 1: timed(measured_steps=99)}
    decision = CacheAware().choose([0, 1], HASHES, index_with({0: 8}), loads)
    assert decision.replica == 1 and "over the load threshold" in decision.reason
    # One settled replica is enough to time them all (the fresh one at its scale).
    loads = {0: timed(**slow, measured_steps=50), 1: timed(measured_steps=SETTLED_STEPS)}
    decision = CacheAware().choose([0, 1], HASHES, index_with({0: 8}), loads)
    assert "first token expected" in decision.reason


def test_cache_aware_avoids_a_replica_that_would_have_to_preempt():
    # Replica 0 is soonest but its KV cache is nearly full: 32 more tokens (8 blocks) of 1,000
    # would go over.
    loads = {0: timed(kv_usage=0.995), 1: timed(queued_prefill_tokens=500)}
    decision = CacheAware().choose([0, 1], HASHES, index_with({}), loads)
    assert decision.replica == 1 and "1 without KV room skipped" in decision.reason
    # When none has room, the soonest still takes it.
    full = {0: timed(kv_usage=0.995), 1: timed(kv_usage=0.999, queued_prefill_tokens=500)}
    assert CacheAware().choose([0, 1], HASHES, index_with({}), full).replica == 0


def test_a_prefix_in_a_host_tier_scores_between_the_pool_and_nothing():
    """Replica 0 holds the prompt in its pool, replica 1 in its host tier (KV events of medium
    "CPU": loaded, not computed), replica 2 not at all; all idle alike."""
    index = PrefixIndex()
    index.stored(0, HASHES)
    index.stored(1, HASHES[:2])
    index.stored(1, HASHES[2:], "CPU")
    loads = {r: timed(prefill_token_seconds=0.01) for r in (0, 1, 2)}
    assert index.match_tiers(HASHES) == {0: (8, 0), 1: (2, 6)}
    assert CacheAware().choose([0, 1, 2], HASHES, index, loads).replica == 0
    decision = CacheAware().choose([1, 2], HASHES, index, loads)
    assert decision.replica == 1 and "and 6 in its host tier" in decision.reason
    # Moved back into the pool, out of the host tier: events of both mediums; a clear drops both.
    index.removed(1, HASHES[2:], "CPU")
    index.stored(1, HASHES[2:])
    assert index.match_tiers(HASHES)[1] == (8, 0)
    index.clear(1)
    assert 1 not in index.match_tiers(HASHES)


def test_by_counts_a_prefix_in_a_host_tier_scores_between_the_pool_and_nothing():
    """Replicas without settled timings: the prefix still decides, a host tier's block worth
    nearly a pool's (loaded, not computed)."""
    index = PrefixIndex()
    index.stored(0, HASHES[:3])
    index.stored(1, HASHES[:2])
    index.stored(1, HASHES[2:], "CPU")
    loads = idle(0, 1, 2)
    decision = CacheAware().choose([0, 1, 2], HASHES, index, loads)
    assert decision.replica == 1 and decision.matched_blocks == 8
    assert "holds 2/8 leading blocks (and 6 in its host tier)" in decision.reason
    index.stored(2, HASHES)
    assert CacheAware().choose([0, 1, 2], HASHES, index, loads).replica == 2


def test_the_tiers_series_on_metrics():
    """/metrics' per-tier series, from an engine's GetStats answer (rendered as scraped)."""
    stats = EngineStats(kv_tier_hits={"host": 48, "disk": 16}, kv_tier_usage={"host": 0.25})
    text = Metrics().render(stats).decode()
    assert 'folio_kv_tier_hits_total{tier="host"} 48.0' in text
    assert 'folio_kv_tier_hits_total{tier="disk"} 16.0' in text
    assert 'folio_kv_tier_usage_ratio{tier="host"} 0.25' in text


def test_cache_aware_prefers_a_replica_with_the_request_s_adapter_resident():
    """A request's LoRA adapter resident on a replica (no swap before it runs) breaks ties
    after the prefix, and among replicas under the load threshold when none holds the prefix;
    it never outweighs a longer prefix, the threshold, or more than a step of expected time."""
    resident = ReplicaLoad(adapter_resident=True)
    tie = CacheAware().choose(
        [0, 1, 2], HASHES, index_with({0: 8, 1: 8, 2: 8}), {0: ReplicaLoad(), 1: resident}
    )
    assert tie.replica == 1 and "its LoRA adapter resident" in tie.reason
    loads = {0: ReplicaLoad(running=1), 1: ReplicaLoad(running=2, adapter_resident=True)}
    assert CacheAware().choose([0, 1], HASHES, index_with({}), loads).replica == 1
    prefix = CacheAware().choose([0, 1], HASHES, index_with({0: 8, 1: 4}), {1: resident})
    assert prefix.replica == 0 and "resident" not in prefix.reason
    busy = {1: ReplicaLoad(running=int(BALANCE_ABS) + 6, adapter_resident=True)}
    assert CacheAware().choose([0, 1], HASHES, index_with({}), busy).replica == 0
    # Timed engines: 10 more queued tokens is within a step of the best, 100 more is not.
    near = {0: timed(), 1: timed(queued_prefill_tokens=10, adapter_resident=True)}
    assert CacheAware().choose([0, 1], HASHES, index_with({}), near).replica == 1
    far = {0: timed(), 1: timed(queued_prefill_tokens=100, adapter_resident=True)}
    assert CacheAware().choose([0, 1], HASHES, index_with({}), far).replica == 0


def test_a_replica_s_load_says_whether_the_request_s_adapter_is_resident():
    replica = Replica(0, client=None)  # type: ignore[arg-type]  # its last answer only
    replica.reported(EngineStats(resident_lora_adapters=["sql"]))
    assert replica.load(0, "sql").adapter_resident
    assert not replica.load(0, "chat").adapter_resident and not replica.load(0).adapter_resident


def test_the_lora_series_on_metrics_pool_the_replicas():
    """vllm:lora_requests_info and the requests per adapter over two replicas' answers: each
    adapter once in the labels, the slots and counts summed; none over engines without LoRA."""
    total = EngineStats()
    for answer in (
        EngineStats(
            running_lora_adapters=["a"],
            waiting_lora_adapters=["b"],
            resident_lora_adapters=["a"],
            max_lora=2,
            lora_requests={"a": 3, "b": 1},
        ),
        EngineStats(
            running_lora_adapters=["a", "c"],
            resident_lora_adapters=["c"],
            max_lora=2,
            lora_requests={"a": 1, "c": 2},
        ),
    ):
        pool_lora_stats(total, answer)
    assert total.resident_lora_adapters == ["a", "c"]
    text = Metrics().render(total).decode()
    assert (
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,c",'
        'waiting_lora_adapters="b"}' in text
    )
    for name, count in (("a", 4), ("b", 1), ("c", 2)):
        assert f'folio_lora_requests_total{{lora_name="{name}"}} {count}.0' in text
    assert "lora" not in Metrics().render(EngineStats()).decode()
