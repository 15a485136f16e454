"""Episodes stay where they live (proxy/routing/sessions.py): an environment episode's turns, each re-sending the
whole conversation, go to the replica that served its last turn, named by the X-Session-ID header.

The router tests are pure. The proxy test runs the proxy's own HTTP server (the production hot path, where the
header is read) in front of loopback stand-ins for replicas (tests/proxy/test_proxy_failures.py's RawServer): the
fact is which replica the proxy picked, which a stand-in shows as well as vLLM and in milliseconds.
"""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import httpx

from proxy.app import Proxy
from proxy.config import ProxyConfig
from proxy.routing.router import PREFIX_HIT, PrefixRouter
from tests.proxy.test_proxy_failures import RawServer, served

TEMPLATE = list(range(1000, 1048))


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2000, 30000) for _ in range(n)]


def _episodes(g: int, turns: int, seed: int = 0) -> list[list[list[int]]]:
    """g episodes of one prompt: each turn's prompt is the last one plus that episode's own reply and observation."""
    rng = random.Random(seed)
    first = TEMPLATE + _tokens(rng, 60)
    out = []
    for _ in range(g):
        prompts, p = [], first
        for _ in range(turns):
            prompts.append(p)
            p = p + _tokens(rng, 40) + TEMPLATE[:8] + _tokens(rng, 30)
        out.append(prompts)
    return out


def _run(router: PrefixRouter, episodes: list[list[list[int]]], sessions: bool) -> list[set[str]]:
    """Every episode's turns, the G episodes' turn k sent together; the replicas each episode used."""
    used: list[set[str]] = [set() for _ in episodes]
    for k in range(len(episodes[0])):
        decisions = []
        for e, prompts in enumerate(episodes):
            d = router.route_tokens("m", prompts[k], n=1, max_tokens=40, session=f"ep-{e}" if sessions else None)
            router.start(d)
            decisions.append(d)
            used[e].add(d.replica)
        for d in decisions:
            router.finish(d, 40)
    return used


def _router(replicas: tuple[str, ...]) -> PrefixRouter:
    r = PrefixRouter(block_size=16)
    r.set_replicas(replicas)
    return r


def test_every_turn_of_an_episode_goes_where_its_first_turn_went():
    router = _router(("r0", "r1", "r2", "r3"))
    used = _run(router, _episodes(8, 5), sessions=True)
    assert all(len(u) == 1 for u in used), used
    assert router.sessions.kept == 8 * 4 and router.sessions.moved == 0


def test_without_the_episode_key_later_turns_lose_their_replica():
    """Why the key exists: from turn 2 the group's prompt is shared by 8 distinct prompts, so it reads as template
    and says nothing about where each episode lives (if this ever passes, the key may no longer be needed)."""
    used = _run(_router(("r0", "r1", "r2", "r3")), _episodes(8, 5), sessions=False)
    assert any(len(u) > 1 for u in used), used


def test_an_episode_moves_only_when_its_replica_drains_or_leaves_and_then_stays():
    router = _router(("r0", "r1"))
    ep = _episodes(1, 4)[0]
    first = router.route_tokens("m", ep[0], session="e")
    home = first.replica
    other = "r1" if home == "r0" else "r0"
    router.set_draining([home])
    moved = router.route_tokens("m", ep[1], session="e")
    assert moved.replica == other and router.sessions.moved == 1
    router.set_draining([])
    stays = router.route_tokens("m", ep[2], session="e")
    assert (stays.replica, stays.kind) == (other, PREFIX_HIT)  # it lives there now
    router.set_replicas([home])  # its replica left: placed again on what is left
    assert router.route_tokens("m", ep[3], session="e").replica == home


def test_a_turn_does_not_pile_onto_a_replica_over_the_load_bound():
    router = _router(("r0", "r1"))
    ep = _episodes(1, 2)[0]
    home = router.route_tokens("m", ep[0], session="e").replica
    for _ in range(40):  # other requests in flight there make it far busier than the other replica
        router.start(home)
    assert router.route_tokens("m", ep[1], session="e").replica != home
    assert router.sessions.moved == 1


def test_the_proxy_keeps_an_episode_on_one_replica_and_its_version_held_between_turns(run_store):
    store, manifest = run_store

    async def body():
        ups = [await RawServer().start() for _ in range(3)]
        cfg = ProxyConfig(replica_urls=[u.url for u in ups], refresh_s=0.1, session_idle_s=30)
        proxy = Proxy(cfg, store, manifest, static_adapter_root="/a")
        episodes = _episodes(6, 4, seed=1)
        async with served(proxy) as url, httpx.AsyncClient(base_url=url) as client:
            used: list[set[str]] = [set() for _ in episodes]
            for k in range(4):
                answers = await asyncio.gather(
                    *(
                        client.post(
                            "/v1/completions",
                            json={"model": "base", "prompt": prompts[k], "max_tokens": 4},
                            headers={"X-Session-ID": f"episode-{e}"},
                        )
                        for e, prompts in enumerate(episodes)
                    )
                )
                for e, a in enumerate(answers):
                    assert a.status_code == 200, a.text
                    used[e].add(a.headers["x-brigade-replica"])
            assert all(len(u) == 1 for u in used), used
            # between turns nothing is in flight, yet the episodes' model counts as in use (never unloaded)
            assert not proxy.state.using and proxy.state.idle_for("base") == 0.0
            # a request without a key is not an episode: it holds nothing after it ended
            await client.post("/v1/completions", json={"model": "other", "prompt": episodes[0][0], "max_tokens": 4})
            assert proxy.state.idle_for("other") > 0.0
        for u in ups:
            u.close()

    asyncio.run(body())


def test_the_multiturn_benchmark_keeps_episodes_whole_where_round_robin_does_not():
    """benchmarks.proxy.multiturn on a small trace: its JSON is what the closing note quotes, so its arithmetic is
    checked here (brigade against its baselines, on the same seeded trace)."""
    from benchmarks.proxy.multiturn import simulate

    args = SimpleNamespace(seed=3, groups=24, group_size=4, groups_in_flight=6, version_every=64, kv_block=16)
    args.kv_blocks = 20_000
    figures = {p: simulate(p, 4, args) for p in ("brigade", "round_robin", "session_hash")}
    assert figures["brigade"]["episodes_split"] == 0.0 and figures["session_hash"]["episodes_split"] == 0.0
    assert figures["round_robin"]["episodes_split"] > 0.5
    assert figures["brigade"]["prefill_vs_ideal"] < 1.05 < figures["round_robin"]["prefill_vs_ideal"]
    assert figures["brigade"]["turns"] == figures["round_robin"]["turns"]  # one trace for every policy
