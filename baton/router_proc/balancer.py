"""Which data-parallel replica takes a request (--load-balance-method, SGLang's names).

- round_robin: in turn.
- shortest_queue: the replica with the fewest tokens in its requests, running or waiting, as it
  last reported them plus what was sent to it since.
- cache_aware (sgl-router's policy, simplified): the replica whose prefix cache most likely
  holds the longest prefix of the prompt, as far as the router knows from the prompts it sent
  there, unless the replicas' loads are out of balance, when the least loaded takes it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

# Prompts are indexed in blocks of this many tokens, each block's key the hash of the whole
# prefix up to it (as vLLM's prefix cache hashes blocks): a match is the number of leading
# blocks a replica was sent before.
PREFIX_BLOCK_TOKENS = 16
# Blocks remembered per replica, the least recently matched forgotten first: about what a
# replica's radix cache holds over a few thousand prompts.
PREFIX_BLOCKS_REMEMBERED = 1 << 16
# cache_aware goes to the least loaded replica when the loads differ by more than both of these
# (sgl-router's balance thresholds: absolute, in tokens here, and relative).
BALANCE_ABS_TOKENS = 4096
BALANCE_REL = 1.5
# ...and when no replica holds at least this fraction of the prompt.
CACHE_MATCH_FRACTION = 0.3


class PrefixIndex:
    """The prompt prefixes sent to one replica, block by block (an approximation of its radix
    cache: it cannot see evictions)."""

    def __init__(self, capacity: int = PREFIX_BLOCKS_REMEMBERED) -> None:
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._capacity = capacity

    def matched_tokens(self, keys: Sequence[int]) -> int:
        """Tokens of the leading blocks (their prefix `keys`) this replica was sent."""
        matched = 0
        for key in keys:
            if key not in self._blocks:
                break
            self._blocks.move_to_end(key)
            matched += 1
        return matched * PREFIX_BLOCK_TOKENS

    def add(self, keys: Sequence[int]) -> None:
        for key in keys:
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self._capacity:
            self._blocks.popitem(last=False)


def prefix_keys(token_ids: Sequence[int]) -> list[int]:
    """One key per whole block of `token_ids`: the hash of the prefix up to its end."""
    keys, key = [], 0
    for end in range(PREFIX_BLOCK_TOKENS, len(token_ids) + 1, PREFIX_BLOCK_TOKENS):
        key = hash((key, tuple(token_ids[end - PREFIX_BLOCK_TOKENS : end])))
        keys.append(key)
    return keys


class ReplicaBalancer:
    """Chooses replicas for requests and keeps what each policy needs: loads, prefixes."""

    def __init__(self, replicas: int, method: str) -> None:
        self.method = method
        self.loads = [0] * replicas  # as last reported, plus what was sent since
        self._prefixes = [PrefixIndex() for _ in range(replicas)]
        self._next = 0

    def choose(self, prompt_token_ids: Sequence[int], max_tokens: int) -> int:
        """The replica that takes this request; counted in its load at once."""
        if self.method == "round_robin":
            replica = self._next
            self._next = (self._next + 1) % len(self.loads)
        elif self.method == "shortest_queue":
            replica = self._least_loaded()
        else:
            replica = self._cache_aware(prompt_token_ids)
        self.loads[replica] += len(prompt_token_ids) + max_tokens
        return replica

    def reported(self, replica: int, tokens: int) -> None:
        """A replica's own count: it replaces the estimate."""
        self.loads[replica] = tokens

    def _least_loaded(self) -> int:
        return min(range(len(self.loads)), key=lambda replica: self.loads[replica])

    def _cache_aware(self, prompt_token_ids: Sequence[int]) -> int:
        keys = prefix_keys(prompt_token_ids)
        lightest = self._least_loaded()
        low, high = self.loads[lightest], max(self.loads)
        if high - low > BALANCE_ABS_TOKENS and high > low * BALANCE_REL:
            replica = lightest
        else:
            matches = [index.matched_tokens(keys) for index in self._prefixes]
            best = max(range(len(matches)), key=lambda replica: matches[replica])
            enough = matches[best] >= CACHE_MATCH_FRACTION * max(1, len(prompt_token_ids))
            replica = best if enough and matches[best] else lightest
        self._prefixes[replica].add(keys)
        return replica
