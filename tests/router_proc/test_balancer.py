"""The routing policies on synthetic workloads: in turn, by load, and by cached prefix."""

from __future__ import annotations

from baton.router_proc.balancer import (
    BALANCE_ABS_TOKENS,
    PREFIX_BLOCK_TOKENS,
    PrefixIndex,
    ReplicaBalancer,
    prefix_keys,
)


def prompt(system: int, question: int, length: int = 96) -> list[int]:
    """A prompt of a shared system part (64 tokens of `system`) and a question of its own."""
    return [1000 + system] * 64 + [question] * (length - 64)


def test_round_robin_takes_the_replicas_in_turn() -> None:
    balancer = ReplicaBalancer(3, "round_robin")
    assert [balancer.choose([1, 2, 3], 8) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_shortest_queue_goes_by_reported_load_and_what_was_sent_since() -> None:
    balancer = ReplicaBalancer(2, "shortest_queue")
    balancer.reported(0, 500)
    assert balancer.choose([1] * 100, 50) == 1  # 0 against 500
    assert balancer.loads == [500, 150]
    assert balancer.choose([1] * 100, 300) == 1  # 150 against 500
    assert balancer.choose([1] * 10, 10) == 0  # 550 against 500
    balancer.reported(1, 0)  # replica 1 finished everything: its own count wins
    assert balancer.choose([1], 1) == 1


def test_cache_aware_sends_shared_prefixes_to_the_replica_that_has_them() -> None:
    """Two families of prompts, each sharing a long system part: once each family has landed
    somewhere, every later member follows it, whatever the turn or the small loads."""
    balancer = ReplicaBalancer(2, "cache_aware")
    first_a = balancer.choose(prompt(1, 1), 16)
    first_b = balancer.choose(prompt(2, 1), 16)
    assert first_a != first_b  # the second family had no match: the lighter replica took it
    for question in range(2, 12):
        assert balancer.choose(prompt(1, question), 16) == first_a
        assert balancer.choose(prompt(2, question), 16) == first_b


def test_cache_aware_gives_way_to_balance_when_one_replica_is_swamped() -> None:
    balancer = ReplicaBalancer(2, "cache_aware")
    home = balancer.choose(prompt(1, 1), 16)
    balancer.reported(home, 10 * BALANCE_ABS_TOKENS)
    balancer.reported(1 - home, 0)
    assert balancer.choose(prompt(1, 2), 16) == 1 - home


def test_a_prefix_matches_by_whole_blocks_from_the_start() -> None:
    index = PrefixIndex()
    tokens = list(range(3 * PREFIX_BLOCK_TOKENS + 5))
    index.add(prefix_keys(tokens))
    assert index.matched_tokens(prefix_keys(tokens)) == 3 * PREFIX_BLOCK_TOKENS
    changed_second_block = tokens.copy()
    changed_second_block[PREFIX_BLOCK_TOKENS] = -1
    assert index.matched_tokens(prefix_keys(changed_second_block)) == PREFIX_BLOCK_TOKENS
    assert index.matched_tokens(prefix_keys(tokens[1:])) == 0  # not a prefix
    small = PrefixIndex(capacity=2)
    small.add(prefix_keys(tokens))  # the oldest block is forgotten
    assert small.matched_tokens(prefix_keys(tokens)) == 0
