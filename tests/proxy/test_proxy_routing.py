"""Prefix-aware routing (proxy/routing/router.py): pure unit tests, no I/O."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from proxy.routing.prefix_hashes import text_block_hashes, token_block_hashes
from proxy.routing.router import NEW, PREFIX_HIT, SPILL, PrefixRouter

TEMPLATE = list(range(1000, 1048))  # a 48-token "chat template" every prompt starts with (3 blocks of 16)


def prompt(i: int, length: int = 52) -> list[int]:
    rng = random.Random(i)
    return TEMPLATE + [rng.randrange(2000, 30000) for _ in range(length)]


def router(replicas=("r0", "r1"), **kw) -> PrefixRouter:
    r = PrefixRouter(block_size=16, **kw)
    r.set_replicas(replicas)
    return r


def test_hashes_cover_full_blocks_only_and_chain():
    ids = list(range(40))
    hashes = token_block_hashes(ids, "adapter-v1", 16)
    assert len(hashes) == 2  # the trailing 8 tokens are not a full block, and vLLM never caches them
    # Chained: a different first block changes every later link, not just the first.
    other = token_block_hashes([99] + ids[1:], "adapter-v1", 16)
    assert other[0] != hashes[0] and other[1] != hashes[1]
    # Same prefix, longer prompt: the shared links are identical.
    assert token_block_hashes(ids + list(range(50)), "adapter-v1", 16)[:2] == hashes


def test_adapter_name_seeds_the_chain():
    ids = prompt(1)
    a, b = token_block_hashes(ids, "run-v000001", 16), token_block_hashes(ids, "run-v000002", 16)
    assert len(a) == len(b) > 0
    assert not set(a) & set(b)
    ta, tb = text_block_hashes("x" * 300, "run-v000001", 16), text_block_hashes("x" * 300, "run-v000002", 16)
    assert len(ta) == 300 // 64 and not set(ta) & set(tb)


def test_same_prefix_goes_to_the_same_replica():
    r = router(("r0", "r1", "r2"))
    first = r.route_tokens("m", prompt(1))
    assert first.kind == NEW
    r.start(first.replica)
    for _ in range(7):  # the 7 siblings of a GRPO group, all in flight at once
        d = r.route_tokens("m", prompt(1))
        assert (d.replica, d.kind) == (first.replica, PREFIX_HIT)
        r.start(d.replica)
    assert r.inflight(first.replica) == 8


def test_longer_prompt_sharing_a_prefix_follows_it():
    r = router(("r0", "r1", "r2"))
    base = r.route_tokens("m", prompt(1, 64))
    r.route_tokens("m", prompt(2))  # teaches the router the shared template
    d = r.route_tokens("m", prompt(1, 64) + list(range(40)))  # a multi-turn continuation
    assert (d.replica, d.kind) == (base.replica, PREFIX_HIT)
    assert d.matched_blocks == (48 + 64) // 16 - 3


def test_different_adapter_is_a_new_prefix():
    r = router()
    a = r.route_tokens("run-v000001", prompt(1))
    r.start(a.replica)
    b = r.route_tokens("run-v000002", prompt(1))
    assert b.kind == NEW
    assert b.replica != a.replica  # least-loaded: a's replica has one in flight


def test_shared_template_is_discounted_so_distinct_prompts_spread():
    r = router(("r0", "r1"))
    counts = Counter()
    for i in range(16):
        d = r.route_tokens("m", prompt(i))
        counts[d.replica] += 1
        assert d.kind == NEW, f"prompt {i} was routed as {d.kind}: the template must not count as a shared prefix"
        r.start(d.replica)  # groups stay in flight, like a rollout worker's
    assert counts == {"r0": 8, "r1": 8}
    assert r.shared_prefix_blocks() == 3
    # ... while siblings still find their prompt's replica past the template.
    owner = r.route_tokens("m", prompt(5))
    assert owner.kind == PREFIX_HIT


def test_template_only_match_is_not_a_hit():
    r = router(("r0", "r1"))
    r.route_tokens("m", prompt(1))
    r.route_tokens("m", prompt(2))
    d = r.route_tokens("m", TEMPLATE + [7] * 20)  # shares the template and nothing else
    assert d.kind == NEW and d.matched_blocks == 0


def test_spill_to_least_loaded_when_preferred_is_far_ahead():
    r = router(("r0", "r1"), spill_threshold=3)
    for i in range(20):  # single-request groups: no siblings expected, so no room kept for them
        r.route_tokens("m", prompt(100 + i))
    home = r.route_tokens("m", prompt(1)).replica
    other = "r1" if home == "r0" else "r0"
    for _ in range(2):
        r.start(home)
    assert r.route_tokens("m", prompt(1)).kind == PREFIX_HIT  # 2 ahead: under the threshold
    r.start(home)
    d = r.route_tokens("m", prompt(1))  # 3 ahead: spill
    assert (d.replica, d.kind) == (other, SPILL)
    for _ in range(3):
        r.finish(home)
    assert r.route_tokens("m", prompt(1)).kind == PREFIX_HIT


def test_removed_replica_is_forgotten():
    r = router(("r0", "r1", "r2"))
    for i in range(6):
        r.route_tokens("m", prompt(i))
    d = r.route_tokens("m", prompt(3))
    assert d.kind == PREFIX_HIT
    gone = d.replica
    r.start(gone)
    r.set_replicas([x for x in ("r0", "r1", "r2") if x != gone])
    assert gone not in r.replicas and r.inflight(gone) == 0
    again = r.route_tokens("m", prompt(3))
    assert again.kind == NEW and again.replica != gone
    r.finish(gone)  # a request that was in flight on it ends later: harmless
    r.set_replicas(["r0", "r1", "r2", "r3"])  # a replica joins: it can be chosen
    assert "r3" in {r.route_tokens("m", prompt(100 + i)).replica for i in range(8)}


def test_exclude_skips_a_replica():
    r = router(("r0", "r1"))
    home = r.route_tokens("m", prompt(1)).replica
    d = r.route_tokens("m", prompt(1), exclude={home})
    assert d.replica != home
    assert r.route_tokens("m", prompt(1), exclude={"r0", "r1"}) is None


def test_no_replicas_means_no_decision():
    assert PrefixRouter().route_tokens("m", prompt(1)) is None


def test_text_prompts_route_by_bytes():
    r = router(("r0", "r1"))
    system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" * 3
    first = r.route_text("m", system + "What is 3 + 4? " * 10)
    r.route_text("m", system + "What is 9 + 1? " * 10)
    d = r.route_text("m", system + "What is 3 + 4? " * 10)
    assert (d.replica, d.kind) == (first.replica, PREFIX_HIT)
    assert r.shared_prefix_blocks(text=True) == len(system.encode()) // 64


def test_short_prompt_groups_but_has_no_prefix_signal():
    r = router()
    first = r.route_tokens("m", [1, 2, 3])
    assert first.kind == NEW
    assert (r.route_tokens("m", [1, 2, 3]).kind, first.matched_blocks) == (PREFIX_HIT, 0)  # a sibling follows
    assert r.route_tokens("m", [1, 2, 4]).kind == NEW  # no full block in common: a new group, placed by load


def test_block_memory_is_bounded():
    r = router(max_blocks=10)
    for i in range(20):
        r.route_tokens("m", prompt(i))
    assert r.known_blocks() == 10
    assert r.route_tokens("m", prompt(19)).kind == PREFIX_HIT  # the most recent survive


def test_an_unloaded_models_links_and_groups_are_forgotten_and_others_kept():
    """A long run loads a version per step: an unloaded one's links and groups go with it, or the tables fill
    with versions long gone (the proxy's RSS grew 10 % over a 718-version soak)."""
    r = router(("r0", "r1"), max_blocks=10_000, max_groups=10_000)
    teach_group_size(r, 4)
    other_blocks, other_groups = r.known_blocks(), r.known_groups()  # another model's, kept throughout
    for i in range(12):
        r.start(r.route_tokens("run-v000001", prompt(i)))
        r.route_text("run-v000001", f"a text prompt {i} " * 20)
    kept = r.route_tokens("run-v000002", prompt(0))
    r.start(kept)
    old_groups, blocks_before = r.known_groups(), r.known_blocks()
    reserved_before = sum(r._groups.reserved.values())
    assert reserved_before > 0  # the old version's groups still expect siblings
    r.forget_model("run-v000001")
    # The other model's and v2's (one prompt, one group) are left.
    v2_blocks = len(token_block_hashes(prompt(0), "run-v000002", 16))
    assert r.known_blocks() == other_blocks + v2_blocks < blocks_before
    assert r.known_groups() == other_groups + 1 < old_groups
    assert sum(r._groups.reserved.values()) == pytest.approx(r._groups.get(kept.group).reserved)
    assert r.route_tokens("run-v000002", prompt(0)).kind == PREFIX_HIT  # the live version is still routed home
    assert r.route_tokens("run-v000001", prompt(5)).kind == NEW  # the old one starts over (if it came back)
    r.forget_model("never-loaded")  # a name the router never saw: nothing happens
    assert r.known_groups() == other_groups + 2


def test_a_long_lived_models_link_list_stays_bounded():
    r = router(max_blocks=20)
    for i in range(200):
        r.route_tokens("base", prompt(i))
    assert r.known_blocks() == 20
    assert len(r._prefixes._by_name["base"]) <= 2 * 20 + len(token_block_hashes(prompt(0), "base", 16))
    r.forget_model("base")
    assert r.known_blocks() == 0


def test_off_template_prompt_does_not_cancel_the_discount():
    """One prompt without the template must not make the template a routing signal again (per-link counts)."""
    r = router(("r0", "r1"))
    r.route_tokens("m", prompt(1))
    r.route_tokens("m", prompt(2))
    r.route_tokens("m", [5] * 64)  # off-template
    for i in range(3, 11):
        d = r.route_tokens("m", prompt(i))
        assert d.kind == NEW, (i, d)
        r.start(d)
    assert r.shared_prefix_blocks() == 3


def test_siblings_follow_the_group_while_it_is_within_its_allowance():
    """The group's own requests never count against it: 8 siblings on an otherwise idle pair stay together."""
    r = router(("r0", "r1"), spill_threshold=2)
    seen = []
    for _ in range(8):
        d = r.route_tokens("m", prompt(1), max_tokens=64)
        r.start(d)
        seen.append((d.replica, d.kind))
    assert {rid for rid, _ in seen} == {seen[0][0]}
    assert [k for _, k in seen] == [NEW] + [PREFIX_HIT] * 7


def test_a_spilled_group_moves_as_a_unit_and_keeps_its_block_owner():
    r = router(("r0", "r1"), spill_threshold=2)
    home = r.route_tokens("m", prompt(1)).replica
    other = "r1" if home == "r0" else "r0"
    for _ in range(3):
        r.start(home)  # other work makes home 3 requests' worth ahead
    d = r.route_tokens("m", prompt(1))
    assert (d.replica, d.kind) == (other, SPILL)
    r.start(d)
    assert r.route_tokens("m", prompt(1)).replica == other  # the rest of the group follows
    for _ in range(3):
        r.finish(home)
    # A longer prompt sharing prompt(1)'s blocks still goes to where those blocks were first computed.
    r.route_tokens("m", prompt(2))  # teaches the template
    cont = r.route_tokens("m", prompt(1) + list(range(40)))
    assert (cont.replica, cont.kind) == (home, PREFIX_HIT)


@pytest.mark.parametrize("holder_block, kind", [(16, PREFIX_HIT), (32, NEW)])
def test_affinity_counts_only_whole_kv_blocks_of_the_holder(holder_block, kind):
    """A replica with 32-token KV blocks caches only whole 32-token prefixes: 16 prompt tokens past a
    32-token template are no prefix there."""
    template = list(range(1000, 1032))
    first = template + [7] * 16  # 48 tokens: template + one block of its own
    r = PrefixRouter(block_size=16)
    r.set_replicas({"holder": holder_block, "other": 16})
    assert r.route_tokens("m", first, exclude={"other"}).replica == "holder"
    r.route_tokens("m", template + [8] * 16, exclude={"holder"})  # teaches the template
    d = r.route_tokens("m", first + [9] * 30)  # a continuation of `first`
    assert d.kind == kind, d


def test_n_per_request_costs_n_completions():
    r = router(("r0", "r1"))
    d = r.route_tokens("m", prompt(1), n=8, max_tokens=100)
    r.start(d)
    assert d.cost >= 8 * 100 - 1 or d.cost >= 8 * r.completion_tokens
    e = r.route_tokens("m", prompt(2), n=1)
    assert e.replica != d.replica  # the n=8 request weighs 8 completions


def test_completion_lengths_teach_the_expected_cost():
    r = router(("r0",))
    before = r.completion_tokens
    for _ in range(200):
        d = r.route_tokens("m", prompt(1))
        r.start(d)
        r.finish(d, completion_tokens=20)
    assert r.completion_tokens < before / 2
    assert r.load_all() == {"r0": 0.0} and r.inflight_all() == {"r0": 0}


@pytest.mark.parametrize("bad", [[-1] * 32, [2**40] * 32])
def test_odd_token_values_still_hash(bad):
    assert len(token_block_hashes(bad, "m", 16)) == 2


def test_sequential_new_prompts_alternate_despite_unrouted_traffic():
    """A client that tokenizes (forwarded to the least-loaded replica) before each generation must not
    make every new prompt land on the same idle replica."""
    r = router(("r0", "r1"))
    counts = Counter()
    for i in range(8):
        r.least_loaded()  # /tokenize in between: places no prompt, changes no routing state
        d = r.route_tokens("m", prompt(i))
        counts[d.replica] += 1  # finished before the next one starts: all replicas idle again
    assert counts == {"r0": 4, "r1": 4}


@pytest.mark.parametrize(
    ("kv_block", "kv_blocks", "kind"),
    [(16, 0, PREFIX_HIT), (16, 1000, PREFIX_HIT), (16, 12, NEW), (32, 500, PREFIX_HIT), (32, 6, NEW)],
)
def test_prefixes_a_replica_has_likely_evicted_are_no_home(kv_block, kv_blocks, kind):
    """A replica registered with room for 12 routing blocks (12 of 16 tokens, or 6 of 32; 0 = unknown): after
    three more prompts of 7 blocks went to it, the first prompt's blocks are evicted (LRU), so a continuation
    of that prompt is new work wherever it goes."""
    from types import SimpleNamespace

    r = PrefixRouter(block_size=16)
    r.set_replicas({"r0": SimpleNamespace(block_size=kv_block, kv_blocks=kv_blocks)})
    r.route_tokens("m", prompt(1, 64))
    for i in (2, 3, 4):
        r.route_tokens("m", prompt(i, 64))
    assert r.route_tokens("m", prompt(1, 64) + list(range(40))).kind == kind


def teach_group_size(r: PrefixRouter, size: int, groups: int = 12) -> None:
    """Groups of `size` requests, each started and finished: the router learns the size, no load is left."""
    for i in range(groups):
        for _ in range(size):
            d = r.route_tokens("m", prompt(500 + i))
            r.start(d)
            r.finish(d)
    assert round(r._groups.expected_size) == size
    assert all(v < 1e-6 for v in r._groups.reserved.values())


def spread_rollouts(r: PrefixRouter, groups: int, size: int, inflight: int, seed: int) -> dict[int, set[str]]:
    """A rollout worker sending each group as `size` n=1 requests, `inflight` at a time, every request of a new group
    queued at a random place among the next `inflight` sends; completions long-tailed. Returns each group's
    replicas."""
    rng = random.Random(seed)
    queue: list[tuple[float, int]] = []  # (arrival key, group)
    running: list[tuple[float, object]] = []  # (finish time, decision)
    served: dict[int, set[str]] = {}
    started = sent = 0
    now = 0.0
    while started < groups or queue or running:
        while len(running) < inflight and (queue or started < groups):
            while len(queue) < inflight and started < groups:
                queue += [(sent + rng.random() * inflight, started) for _ in range(size)]
                started += 1
            queue.sort()
            _, g = queue.pop(0)
            d = r.route_tokens("m", prompt(g), max_tokens=2000)
            r.start(d)
            sent += 1
            served.setdefault(g, set()).add(d.replica)
            running.append((now + min(20.0, rng.lognormvariate(0, 1)), d))
        running.sort(key=lambda x: x[0])
        now, d = running.pop(0)
        r.finish(d)
    return served


def test_siblings_arriving_one_by_one_among_other_groups_stay_together():
    """n=1 siblings interleaved with other groups' requests, some after the first ones finished (issue 19): the
    group's siblings are expected on its replica (reserved there), so no replica piles up groups still to come,
    and every group stays whole while every replica serves its share."""
    for replicas in (("r0", "r1"), ("r0", "r1", "r2", "r3")):
        r = router(replicas)
        served = spread_rollouts(r, groups=150, size=8, inflight=64, seed=len(replicas))
        split = [g for g, where in served.items() if len(where) > 1]
        assert len(split) <= 1, split  # <= 1 % of groups
        per_replica = Counter(next(iter(where)) for where in served.values())
        assert max(per_replica.values()) <= 1.15 * len(served) / len(replicas), per_replica
        assert r.decisions[SPILL] <= 1
        assert max(r.load_all().values()) < 1e-6 and r.inflight_all() == {rid: 0 for rid in replicas}


def test_a_late_sibling_follows_after_its_group_finished_while_loads_are_balanced():
    r = router(("r0", "r1"), spill_threshold=2)
    teach_group_size(r, 4)
    first = r.route_tokens("m", prompt(1))
    r.start(first)
    r.finish(first)  # the group's first request ended before any sibling arrived
    for i in range(6):  # other groups' requests in between, spread by load
        other = r.route_tokens("m", prompt(10 + i))
        r.start(other)
    d = r.route_tokens("m", prompt(1))
    assert (d.replica, d.kind) == (first.replica, PREFIX_HIT)


@pytest.mark.parametrize(("others", "kind"), [(4, PREFIX_HIT), (6, SPILL)])
def test_a_sibling_moves_once_its_replica_is_over_the_load_bound(others, kind):
    """Groups of 4 (3 siblings expected): a sibling follows while its replica, without the group, is less than
    spill_threshold (2) + 3 requests' worth ahead of the least-loaded; past that it moves, its reservation
    with it, and the rest of the group follows it there."""
    r = router(("r0", "r1"), spill_threshold=2)
    teach_group_size(r, 4)
    first = r.route_tokens("m", prompt(1))
    r.start(first)
    home, away = first.replica, "r1" if first.replica == "r0" else "r0"
    assert r._groups.reserved[home] > 0  # 3 siblings expected there
    r.finish(first)
    for _ in range(others):
        r.start(home)  # other work on the group's replica
    d = r.route_tokens("m", prompt(1))
    assert d.kind == kind
    assert d.replica == (home if kind == PREFIX_HIT else away)
    r.start(d)
    if kind == SPILL:
        assert r._groups.reserved.get(home, 0.0) < 1e-6 and r._groups.reserved[away] > 0
        follow = r.route_tokens("m", prompt(1))
        assert (follow.replica, follow.kind) == (away, PREFIX_HIT)


def test_reservations_lapse():
    """A group whose siblings never come does not weigh on its replica for long."""
    r = router(("r0", "r1"))
    teach_group_size(r, 8)
    d = r.route_tokens("m", prompt(1))
    r.start(d)
    group = r._groups.get(d.group)
    assert group.reserved > 0 and r._groups.reserved[d.replica] == pytest.approx(group.reserved)
    assert r.load_all()[d.replica] == pytest.approx(d.cost)  # reservations are not reported as in flight
    r.finish(d)
    for i in range(4):  # more than twice the requests in flight (none), plus 2, routed since
        r.route_tokens("m", prompt(900 + i))
    assert group.reserved == 0 and group.expected == 0


def test_a_draining_replica_takes_no_new_group_but_keeps_the_siblings_of_its_own():
    """A replica asked to leave: new groups (and a multi-turn continuation of its prompts) go elsewhere, the
    siblings of a group in flight there follow it whatever its load; a group whose requests all ended moves."""
    r = router(("r0", "r1"), spill_threshold=2)
    d = r.route_tokens("m", prompt(1), max_tokens=64)
    r.start(d)
    home, other = d.replica, "r1" if d.replica == "r0" else "r0"
    r.set_draining([home])
    assert r.draining == {home}
    for i in range(2, 8):  # new groups, however idle the draining replica is
        n = r.route_tokens("m", prompt(i), max_tokens=64)
        assert n.replica == other, i
        r.start(n)
    for _ in range(7):  # siblings of the group already there, though it is far less loaded than the other
        s = r.route_tokens("m", prompt(1), max_tokens=64)
        assert (s.replica, s.kind) == (home, PREFIX_HIT)
        r.start(s)
    assert r.route_tokens("m", prompt(1) + list(range(40)), max_tokens=64).replica == other  # its prefix, not a group
    assert r.least_loaded() == other and r.route_any().replica == other
    # Its requests end: a later request of that prompt is no sibling in flight, and goes elsewhere.
    for _ in range(8):
        r.finish(d)
    r._groups.expire(0)  # the reservation of siblings expected lapses (routing enough other requests does it)
    late = r.route_tokens("m", prompt(1), max_tokens=64)
    assert (late.replica, late.kind) == (other, SPILL)


def test_when_only_draining_replicas_are_left_they_still_serve():
    r = router(("r0", "r1"))
    r.set_draining(["r0", "r1"])
    assert r.route_tokens("m", prompt(1)) is not None and r.least_loaded() is not None
    r.set_draining(["r0"])
    r.set_replicas(["r0"])  # the other one left: better the draining replica than no answer
    assert r.route_tokens("m", prompt(2)).replica == "r0"
    r.set_replicas(["r1"])
    assert r.draining == set()  # a removed replica is no longer draining
