"""Routing by cost over constructed indexes (issue 26): the longest overlap wins at equal load,
load wins at equal overlap, weight 0 is pure load balancing, ties spread, temperature samples,
conditional disaggregation; the prefix index (events, predictions, gaps, bounds, drops); the
Router's ranking from WorkerInfo and a constructed index."""
from __future__ import annotations

import random
import time
from collections import Counter

import pytest

from services.engine.kv_events import prompt_block_hashes
from services.gateway import scoring
from services.gateway.kv_index import (APPROXIMATE, APPROXIMATE_PREDICTION_TTL_S, EVENTS,
                                       PrefixIndex)
from services.gateway.router import Route, Router, RoutingOptions
from services.gateway.scoring import Candidate
from services.state.registry import WorkerInfo

BS = 16


def cand(worker_id: str, overlap: int = 0, queued: int = 0, running: int = 0,
         free: int = 1000, spt: float = 0.0) -> Candidate:
    return Candidate(worker_id, overlap, queued, running, free, BS, spt)


def best(candidates, prompt_blocks=10, weight=1.0, seed=0) -> str:
    return scoring.rank(candidates, prompt_blocks, weight, rng=random.Random(seed))[0].candidate.worker_id


# -- scorer ----------------------------------------------------------------------------------
def test_the_longest_overlap_wins_at_equal_load():
    cs = [cand("a", overlap=2, running=3), cand("b", overlap=7, running=3),
          cand("c", overlap=5, running=3)]
    for seed in range(20):
        assert best(cs, seed=seed) == "b"
    assert scoring.reason(cs[1], cs, 1.0) == scoring.KV_OVERLAP


def test_load_wins_when_overlap_is_equal():
    cs = [cand("a", overlap=4, queued=160), cand("b", overlap=4, running=2),
          cand("c", overlap=4, queued=32, running=1)]
    assert [s.candidate.worker_id for s in scoring.rank(cs, 10, 1.0, rng=random.Random(0))] == \
        ["b", "c", "a"]  # load 2 < 3 < 10 blocks


def test_weight_zero_is_pure_load_balancing():
    cs = [cand("cached", overlap=9, running=2), cand("idle")]
    assert best(cs, weight=1.0) == "cached"  # 1 + 2 < 10 + 0
    for seed in range(20):
        assert best(cs, weight=0.0, seed=seed) == "idle"  # the cache is ignored
    chosen = cs[1]
    assert scoring.reason(chosen, cs, 0.0) == scoring.LOAD
    assert scoring.cost(cs[0], 10, 0.0) == scoring.cost(cand("x", running=2), 10, 0.0)


def test_a_higher_weight_favours_the_cache_over_load():
    cs = [cand("cached", overlap=8, queued=BS * 12), cand("idle")]
    assert best(cs, weight=1.0) == "idle"  # 2 + 12 > 10
    assert best(cs, weight=4.0) == "cached"  # 8 + 12 < 40


def test_ties_spread_over_every_tied_worker():
    cs = [cand(w, overlap=3, running=1) for w in "abcd"]
    rng = random.Random(1)
    firsts = Counter(scoring.rank(cs, 10, 1.0, rng=rng)[0].candidate.worker_id for _ in range(400))
    assert set(firsts) == set("abcd")
    assert min(firsts.values()) > 60  # about 100 each


def test_a_worker_without_room_comes_last_whatever_its_cost():
    cs = [cand("full", overlap=9, free=0), cand("roomy", running=5)]
    ranked = scoring.rank(cs, 10, 1.0, rng=random.Random(0))
    assert [s.candidate.worker_id for s in ranked] == ["roomy", "full"]
    assert not ranked[1].has_room


def test_temperature_samples_cheaper_workers_more_often():
    cs = [cand("cheap"), cand("mid", running=5), cand("dear", running=10)]
    rng = random.Random(3)
    firsts = Counter(scoring.rank(cs, 10, 1.0, 0.5, rng)[0].candidate.worker_id for _ in range(2000))
    assert firsts["cheap"] > firsts["mid"] > firsts["dear"] > 0
    assert Counter(best(cs, seed=s) for s in range(50)) == Counter({"cheap": 50})  # temperature 0


def test_negative_weight_is_refused():
    with pytest.raises(ValueError, match="weight"):
        scoring.cost(cand("a"), 10, -1.0)


def test_local_prefill_under_the_threshold_or_when_the_prefill_queue_is_longer():
    d = cand("d", overlap=4, spt=0.001)
    assert scoring.local_prefill_reason(4 * BS + 100, d, None, 100) == scoring.THRESHOLD
    assert scoring.local_prefill_reason(4 * BS + 101, d, None, 100) is None  # no prefill worker
    idle_p = cand("p", spt=0.001)
    busy_p = cand("p", queued=8000, spt=0.001)
    assert scoring.local_prefill_reason(2000, d, idle_p, 100) is None  # no wait on P
    assert scoring.local_prefill_reason(2000, d, busy_p, 100) == scoring.QUEUE  # 8 s > 1.9 s
    assert scoring.local_prefill_reason(9000, d, busy_p, 100) is None  # 8.9 s > 8 s
    assert scoring.local_prefill_reason(2000, cand("d"), busy_p, 100) is None  # D's cost unknown


def test_local_prefill_weighs_the_handoff_beside_the_prefill_queue():
    idle_p = cand("p", spt=0.001)
    busy_p = cand("p", queued=8000, spt=0.001)
    d = cand("d", spt=0.001)  # 2,000 tokens here: 2 s
    assert scoring.local_prefill_reason(2000, d, idle_p, 100, handoff_s=1.9) is None
    assert scoring.local_prefill_reason(2000, d, idle_p, 100, handoff_s=2.1) == scoring.QUEUE
    assert scoring.local_prefill_reason(9000, d, busy_p, 100, handoff_s=0.5) is None  # 9 > 8.5
    assert scoring.local_prefill_reason(9000, d, busy_p, 100, handoff_s=1.5) == scoring.QUEUE
    assert scoring.local_prefill_reason(50, d, idle_p, 100, handoff_s=0.0) == scoring.THRESHOLD
    # the streams it runs do not count (scoring's docstring says why)
    assert scoring.local_prefill_reason(2000, cand("d", running=60, spt=0.001), idle_p, 100,
                                        handoff_s=2.1) == scoring.QUEUE


# -- prefix index ----------------------------------------------------------------------------
def chain(n: int, seed: int = 0) -> list[int]:
    return prompt_block_hashes([seed * 1000 + i for i in range(n * BS + 1)], BS)


def test_match_finds_each_workers_longest_prefix():
    idx = PrefixIndex()
    h = chain(6)
    idx.apply("a", "e", 0, [["cleared"], ["stored", h[:2]]])
    idx.apply("b", "e", 0, [["cleared"], ["stored", h[:5]]])
    idx.apply("c", "e", 0, [["cleared"], ["stored", h[1:6]]])  # no first block: no prefix
    assert idx.match(h) == {"a": 2, "b": 5}
    assert idx.match(h, ["a", "c"]) == {"a": 2}
    assert idx.modes() == {"a": EVENTS, "b": EVENTS, "c": EVENTS}
    assert idx.size == 12


def test_removed_and_cleared_events_and_a_restart_empty_a_worker():
    idx = PrefixIndex()
    h = chain(4)
    idx.apply("a", "e1", 0, [["cleared"], ["stored", h]])
    idx.apply("a", "e1", 1, [["removed", h[2:]]])
    assert idx.match(h) == {"a": 2}
    idx.apply("a", "e1", 2, [["cleared"]])
    assert idx.match(h) == {} and idx.size == 0
    idx.apply("a", "e1", 3, [["stored", h]])
    idx.apply("a", "e2", 0, [["cleared"], ["stored", []]])  # restarted: a new epoch's snapshot
    assert idx.match(h) == {}


def test_a_gap_in_the_stream_drops_confirmed_entries_until_the_next_snapshot():
    idx = PrefixIndex()
    h = chain(3)
    idx.apply("a", "e", 0, [["cleared"], ["stored", h[:1]]])
    assert idx.apply("a", "e", 2, [["stored", h[1:]]]) is False  # batch 1 was lost
    assert idx.modes()["a"] == APPROXIMATE and idx.match(h) == {}
    assert idx.apply("a", "e", 3, [["stored", h]]) is True  # still no snapshot: ignored
    assert idx.match(h) == {}
    idx.apply("a", "e", 4, [["cleared"], ["stored", h]])
    assert idx.modes()["a"] == EVENTS and idx.match(h) == {"a": 3}


def test_predictions_expire_and_events_confirm_them():
    now = [0.0]
    idx = PrefixIndex(clock=lambda: now[0])
    h = chain(3)
    idx.predict("a", h)  # approximate mode: 120 s
    assert idx.match(h) == {"a": 3}
    now[0] = APPROXIMATE_PREDICTION_TTL_S + 1
    assert idx.match(h) == {} and idx.size == 0
    idx.apply("a", "e", 0, [["cleared"]])
    idx.predict("a", h)
    idx.apply("a", "e", 1, [["stored", h[:2]]])
    now[0] += 1000  # long after any prediction's TTL: confirmed entries stay
    assert idx.match(h) == {"a": 2}


def test_entries_are_bounded_by_the_workers_capacity_and_dropped_with_it():
    idx = PrefixIndex()
    for i in range(10):
        idx.predict("a", chain(4, seed=i), capacity=12)
    assert idx.size == 12
    assert idx.match(chain(4, seed=9)) == {"a": 4}  # the newest survive
    assert idx.match(chain(4, seed=0)) == {}
    idx.apply("b", "e", 0, [["cleared"], ["stored", chain(4)]])
    assert idx.keep_only(["b"]) == ["a"]
    assert idx.worker_ids() == ["b"] and idx.size == 4
    idx.drop("b")
    assert idx.size == 0 and idx.match(chain(4)) == {}


# -- router ----------------------------------------------------------------------------------
def worker(worker_id: str, role: str = "unified", **load) -> WorkerInfo:
    return WorkerInfo(worker_id, role, f"127.0.0.1:{len(worker_id)}", free_kv_blocks=1000,
                      total_kv_blocks=1000, block_size=BS, **load)


def router(mode: str = "kv", **options) -> Router:
    return Router(RoutingOptions(mode, **options), registry=None, model="m",
                  rng=random.Random(0))


def test_router_sends_a_shared_prefix_where_it_is_cached():
    r = router()
    prompt = list(range(10 * BS))
    workers = [worker(w) for w in ("w0", "w1", "w2", "w3")]
    r.index.apply("w2", "e", 0, [["cleared"], ["stored", prompt_block_hashes(prompt, BS)[:8]]])
    routes = r.rank_decode(prompt, workers, [])
    assert routes[0].worker.worker_id == "w2"
    assert (routes[0].reason, routes[0].overlap_blocks) == (scoring.KV_OVERLAP, 8)
    assert routes[0].cost == pytest.approx(2.0)


def test_router_learns_from_its_own_decisions_without_events():
    r = router(kv_events=False)
    prompt = list(range(10 * BS))
    workers = [worker(w) for w in ("w0", "w1", "w2", "w3")]
    first = r.rank_decode(prompt, workers, [])[0]
    r.routed(first, prompt, computes=True, sent_at=time.time())
    later = [worker(w, last_heartbeat=time.time() + 1) for w in ("w0", "w1", "w2", "w3")]
    again = r.rank_decode(prompt + [7, 8, 9], later, [])[0]  # the first prompt computed since
    assert again.worker.worker_id == first.worker.worker_id
    assert again.overlap_blocks == 9  # the prompt's first 9 blocks (the 10th holds its last token)
    assert r.index.modes() == {first.worker.worker_id: APPROXIMATE}


def test_router_counts_work_it_sent_since_the_last_heartbeat():
    r = router(mode="load")
    a, b = worker("a", last_heartbeat=0.0), worker("b", last_heartbeat=0.0)
    first = r.rank_decode(list(range(64)), [a, b], [])[0]
    r.routed(first, list(range(64)), computes=True, sent_at=time.time())
    second = r.rank_decode(list(range(64)), [a, b], [])[0]
    assert second.worker.worker_id != first.worker.worker_id


def test_random_routing_uses_every_worker_and_never_prefills_on_decode():
    r = router(mode="random")
    workers = [worker(w, "decode") for w in "abcd"]
    firsts = Counter()
    for _ in range(200):
        routes = r.rank_decode(list(range(40)), workers, [worker("p", "prefill")])
        assert not any(x.local_prefill for x in routes)
        firsts[routes[0].worker.worker_id] += 1
    assert set(firsts) == set("abcd")


def test_pd_pair_short_prompts_prefill_on_the_decode_worker_long_ones_go_to_prefill():
    r = router(pd_threshold_tokens=64)
    d = [worker("d", "decode")]
    p = [worker("p", "prefill")]
    short = r.rank_decode(list(range(60)), d, p)[0]
    assert short.local_prefill and short.reason == scoring.THRESHOLD
    long = r.rank_decode(list(range(2000)), d, p)[0]
    assert not long.local_prefill
    cached = list(range(2000))  # the decode worker holds all but the last 50 tokens
    r.index.apply("d", "e", 0, [["cleared"], ["stored", prompt_block_hashes(cached, BS)]])
    tail = r.rank_decode(cached + list(range(30)), d, p)[0]
    assert tail.local_prefill and tail.reason == scoring.THRESHOLD
    assert r.rank_decode(list(range(60)), d, [])[0].local_prefill  # no prefill worker at all
    off = router(pd_threshold_tokens=0)  # conditional disaggregation off: always the prefill pool
    assert not off.rank_decode(list(range(60)), d, p)[0].local_prefill


def test_pd_queue_rule_prefills_on_the_decode_worker_when_the_prefill_queue_is_long():
    r = router(pd_threshold_tokens=1)
    d = [worker("d", "decode", prefill_seconds_per_token=0.001)]
    p_idle = [worker("p", "prefill", prefill_seconds_per_token=0.001)]
    p_busy = [worker("p", "prefill", prefill_seconds_per_token=0.001, num_prefill_tokens=8000)]
    assert not r.rank_decode(list(range(500)), d, p_idle)[0].local_prefill
    route = r.rank_decode(list(range(500)), d, p_busy)[0]
    assert route.local_prefill and route.reason == scoring.QUEUE


def test_router_weighs_the_handoff_it_measured_for_that_pair():
    r = router(pd_threshold_tokens=1)
    d = [worker("d", "decode", prefill_seconds_per_token=0.001)]
    p = [worker("p", "prefill", prefill_seconds_per_token=0.001)]
    prompt = list(range(500))  # 32 blocks: 0.5 s here
    assert not r.rank_decode(prompt, d, p)[0].local_prefill  # no queue, no handoff known
    r.observe_handoff("p", "other-d", 32, 5.0)  # another pair's handoffs say nothing of this one
    assert not r.rank_decode(prompt, d, p)[0].local_prefill
    for blocks in (8, 16, 64, 128):  # base 0.4 s + 5 ms a block: 32 blocks 0.56 s
        r.observe_handoff("p", "d", blocks, 0.4 + 0.005 * blocks)
    route = r.rank_decode(prompt, d, p)[0]
    assert route.local_prefill and route.reason == scoring.QUEUE
    assert not r.rank_decode(list(range(1000)), d, p)[0].local_prefill  # 1 s > 0.4 + 63 x 0.005
    # the handoff counted is of the blocks the decode worker lacks: it holds 31 of the 33
    # blocks of this prompt, and 24 tokens x 1 ms here beat handing 2 over (0.41 s)
    cached = list(range(500))
    r.index.apply("d", "e", 0, [["cleared"], ["stored", prompt_block_hashes(cached, BS)]])
    route = r.rank_decode(cached + list(range(20)), d, p)[0]
    assert route.local_prefill and route.reason == scoring.QUEUE and route.overlap_blocks == 31


def test_a_slow_handoff_fades_so_the_pair_is_tried_again():
    """One slow handoff (a first connection, a stall) keeps prompts on the decode worker,
    where no handoff is measured: the estimate halves every HANDOFF_HALF_LIFE_S seconds until
    the prefill pool wins again, and fresh handoffs outweigh the old one."""
    from services.gateway.router import HANDOFF_HALF_LIFE_S as H

    now = [1000.0]
    r = router(pd_threshold_tokens=1)
    r.clock = lambda: now[0]
    d = [worker("d", "decode", prefill_seconds_per_token=0.001)]
    p = [worker("p", "prefill", prefill_seconds_per_token=0.001)]
    prompt = list(range(500))  # 0.5 s on the decode worker, 32 blocks
    r.observe_handoff("p", "d", 32, 4.0)
    assert r.rank_decode(prompt, d, p)[0].reason == scoring.QUEUE
    now[0] += 2 * H  # 1.0 s
    assert r.rank_decode(prompt, d, p)[0].local_prefill
    now[0] += 2 * H  # 0.25 s: the prefill worker again
    assert not r.rank_decode(prompt, d, p)[0].local_prefill
    for _ in range(3):  # the handoffs it measures now are fast
        r.observe_handoff("p", "d", 32, 0.05)
    assert r._handoff_seconds(r._candidate(p[0], 0), r._candidate(d[0], 0), 500) \
        == pytest.approx((4.0 / 16 + 3 * 0.05) / (1 / 16 + 3))
    # fresh handoffs count in full: a slow pair stays slow while it is measured
    r.observe_handoff("p", "d", 32, 4.0)
    assert r._handoff_seconds(r._candidate(p[0], 0), r._candidate(d[0], 0), 500) > 1.0


def test_handoff_estimate_is_the_mean_until_sizes_differ_then_the_fit():
    from services.engine.step_cost import StepCostModel

    m = StepCostModel()
    assert m.expected_seconds(10) == 0.0
    m.observe(10, 0.2)
    m.observe(10, 0.4)
    assert m.expected_seconds(1000) == pytest.approx(0.3, rel=0.01)  # no slope from one size
    for blocks in (1, 50, 100):
        m.observe(blocks, 0.01 * blocks)
    assert m.expected_seconds(200) > m.expected_seconds(20) > 0


def test_prefill_workers_rank_by_their_own_cache():
    r = router()
    prompt = list(range(20 * BS))
    ps = [worker("p0", "prefill"), worker("p1", "prefill")]
    r.index.apply("p1", "e", 0, [["cleared"], ["stored", prompt_block_hashes(prompt, BS)]])
    assert r.rank_prefill(prompt, ps)[0].worker.worker_id == "p1"


def test_routing_options_refuse_bad_values():
    with pytest.raises(ValueError, match="routing"):
        RoutingOptions("nearest")
    with pytest.raises(ValueError, match="kv_overlap_score_weight"):
        RoutingOptions(weight=-1)


def test_router_corrects_a_heartbeat_for_its_own_requests_sent_or_done_since():
    r = router(mode="load")
    ticket = r.routed(Route(worker("a"), scoring.LOAD), list(range(160)), computes=True,
                      sent_at=time.time())
    before = worker("a", last_heartbeat=ticket.at - 1)  # taken before the request was sent
    c = r._candidate(before, 0)
    assert (c.queued_prefill_tokens, c.num_running) == (160, 1)
    during = worker("a", last_heartbeat=ticket.at + 1, num_prefill_tokens=160, num_running=1)
    ticket.prefilled_at, ticket.ended_at = ticket.at + 2, ticket.at + 3  # done after it
    c = r._candidate(during, 0)
    assert (c.queued_prefill_tokens, c.num_running) == (0, 0)
    after = worker("a", last_heartbeat=ticket.at + 4)
    r._candidate(after, 0)
    assert r._sent["a"] == []  # reflected by the heartbeat: forgotten
