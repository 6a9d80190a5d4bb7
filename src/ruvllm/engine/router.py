"""Which data-parallel replica serves a request (docs/scaling.md, "Routing").

Each replica is an engine core with a prefix cache of its own, so where a request goes decides
whether its prompt's blocks are found cached. The `prefix` policy (the default) does three things:

1. **Recent prefixes.** The router remembers, per replica, the chained hashes of the full prompt
   blocks it sent there (an LRU of `prefix_memory` hashes a replica; the same chain as the core's
   prefix cache: salted by the tenant's cache salt and the adapter, so only prompts that could hit
   one another match). A request goes to the replica holding the longest run of its leading blocks:
   turn k + 1 of a chat starts with turn k's whole prompt, so a conversation stays where its cache is.
2. **A load bound.** No replica takes a request for its prefix while its load is above
   `load_factor` x the mean load, counting the new request (Mirrokni, Thorup and Zadimoghaddam's
   consistent hashing with bounded loads): a hot prefix (one system prompt shared by every chat)
   spills to other replicas instead of piling onto one.
3. **A consistent hash** for prompts nobody holds: the first block's hash picks a point on a ring of
   `virtual_nodes` points per replica, and the walk goes clockwise to the first replica at or under
   the mean load (the bound with factor 1: nothing is gained by going anywhere, so balance decides).
   The same new prefix goes to the same replica while loads allow, and only the prefixes of a
   replica that dies move.

Load is what the front knows at once: sequences it has sent a replica and not yet seen finish
(running and waiting there, without waiting for the core's next stats), plus the replica's KV
usage (0-1, from its latest stats) to break ties. `least_loaded` and `round_robin` are the
policies to compare against.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from ruvllm.config import Checked, setting

ROUTING_POLICIES = ("prefix", "least_loaded", "round_robin")


@dataclass(frozen=True)
class RouterConfig(Checked):
    policy: str = setting("prefix", "Which replica serves a request: prefix (the one that holds the prompt's prefix, "
                                    "under a load bound), least_loaded or round_robin.", flag="--routing",
                          choices=ROUTING_POLICIES, metavar="POLICY")
    load_factor: float = setting(1.25, "A replica above this x the mean load (the request counted) takes none.",
                                 minimum=1.0, cli=False)
    prefix_memory: int = setting(65536, "Block hashes remembered per replica (LRU).", minimum=1, cli=False)
    virtual_nodes: int = setting(64, "Points per replica on the consistent-hash ring.", minimum=1, cli=False)


def block_hashes(token_ids: Sequence[int], block_size: int, salt: object = None) -> list[int]:
    """Chained hashes of the prompt's full blocks: hash i covers tokens [0, (i + 1) x block_size)."""
    out: list[int] = []
    parent = hash(("ruvllm-route", salt))
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        out.append(parent)
    return out


def _ring_point(key: str) -> int:
    # A stable hash (Python's hash() of a str changes per process): the ring is the same every run.
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class Router:
    """Routing state of one front: not thread-safe (the data-parallel client calls it under its lock).

    Replicas are any hashable keys (indices 0..N-1 for the data-parallel client, Ray Serve's replica
    ids behind the Ray deployment's request router); the set may change from call to call."""

    def __init__(self, block_size: int, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()
        self.block_size = block_size
        self._recent: dict[Hashable, OrderedDict[int, None]] = {}
        self._ring: tuple[frozenset, list[int], list[Hashable]] = (frozenset(), [], [])
        self._next = itertools.count()

    def choose(self, token_ids: Sequence[int], salt: object, loads: Mapping[Hashable, float]) -> Hashable:
        """The replica for a request whose prompt is `token_ids`, among the keys of `loads` (the
        replicas that can take it; load in sequences, the fractional part KV usage). Records the
        prompt's blocks as the chosen replica's recent prefixes."""
        if not loads:
            raise RuntimeError("no replica is available")
        candidates = sorted(loads, key=str)
        hashes = block_hashes(token_ids, self.block_size, salt)
        policy = self.config.policy
        if policy == "round_robin":
            choice = candidates[next(self._next) % len(candidates)]
        elif policy == "least_loaded":
            choice = min(candidates, key=lambda r: (loads[r], str(r)))
        else:
            choice = self._by_prefix(hashes, token_ids, salt, loads, candidates)
        self._remember(choice, hashes)
        return choice

    def _by_prefix(self, hashes: list[int], token_ids: Sequence[int], salt: object, loads: Mapping[Hashable, float],
                   candidates: list[Hashable]) -> Hashable:
        # Whole sequences count against the bounds; the KV fraction only orders equals.
        total = sum(int(loads[r]) for r in candidates) + 1
        mean = total / len(candidates)
        bound = math.ceil(self.config.load_factor * mean)
        under = [r for r in candidates if int(loads[r]) + 1 <= bound]
        depths = {r: self.match_depth(r, hashes) for r in under}
        deepest = max(depths.values(), default=0)
        if deepest > 0:
            return min((r for r in under if depths[r] == deepest), key=lambda r: (loads[r], str(r)))
        # A prefix nobody holds gains nothing from any replica: the bound is the mean itself (c = 1),
        # so a burst of new prompts splits evenly (1.25 x the mean let one replica take 21 of 32 and
        # the burst lasted 1.3x longer), and the ring only says which of the replicas at or under it.
        key = hashes[0] if hashes else hash(("ruvllm-route", salt, tuple(token_ids)))
        points, owners = self._ring_for(candidates)
        start = bisect.bisect(points, _ring_point(str(key)))
        allowed = {r for r in candidates if int(loads[r]) + 1 <= math.ceil(mean)}
        for i in range(len(points)):
            owner = owners[(start + i) % len(points)]
            if owner in allowed:
                return owner
        raise AssertionError("the ring holds every candidate")

    def _ring_for(self, candidates: list[Hashable]) -> tuple[list[int], list[Hashable]]:
        """The ring of every replica seen so far (a replica that is down keeps its points, so the
        others' shares do not move while it restarts); rebuilt only when a new one appears."""
        known, points, owners = self._ring
        if not known.issuperset(candidates):
            known = known | frozenset(candidates)
            ring = sorted((_ring_point(f"replica-{r}-{v}"), r) for r in known for v in range(self.config.virtual_nodes))
            points, owners = [p for p, _ in ring], [r for _, r in ring]
            self._ring = (known, points, owners)
        return points, owners

    def match_depth(self, replica: Hashable, hashes: list[int]) -> int:
        """How many of the prompt's leading blocks were recently sent to `replica`."""
        recent = self._recent.get(replica)
        depth = 0
        if recent is None:
            return 0
        for h in hashes:
            if h not in recent:
                break
            depth += 1
        return depth

    def _remember(self, replica: Hashable, hashes: list[int]) -> None:
        recent = self._recent.setdefault(replica, OrderedDict())
        for h in hashes:
            recent[h] = None
            recent.move_to_end(h)
        while len(recent) > self.config.prefix_memory:
            recent.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        """A replica that restarted has an empty prefix cache: nothing it held is there any more."""
        self._recent.pop(replica, None)
