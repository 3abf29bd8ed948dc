"""Partial prefix matching (min_length semantics) on the index, against a reference model."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.index import Index
from kvstore.keys import Namespace
from kvstore.lookup import lookup
from tests.helpers import FP, make_chain

C, G = 8, 2  # chunk tokens and granularity for the small cases


def index_with(prompts: list[list[int]], *, level: int = 1, fp=FP, granularity: int = G) -> Index:
    idx = Index(granularity)
    for p in prompts:
        for header, _ in make_chain(p, C, fp=fp):
            idx.add(header, level)
    return idx


def run(idx: Index, q: list[int], **kw):  # type: ignore[no-untyped-def]
    kw.setdefault("chunk_tokens", C)
    return lookup(idx, kw.pop("fp", FP), q, **kw)


def test_exact_chain_and_complete() -> None:
    p = list(range(100, 124))  # 3 full chunks
    r = run(index_with([p]), p)
    assert r.matched_tokens == 24 and r.stop == "complete" and len(r.chunks) == 3
    assert [c.start for c in r.chunks] == [0, 8, 16]
    assert not any(c.partial for c in r.chunks)


def test_divergence_mid_chunk() -> None:
    p = list(range(100, 124))
    q = p[:13] + [1] + p[14:]  # diverges at token 13, inside chunk 1
    r = run(index_with([p]), q)
    assert r.matched_tokens == 12, "8 exact + floor(5 common / 2) * 2 = 12"
    assert r.stop == "diverged" and r.chunks[-1].partial and r.chunks[-1].tokens == 4


def test_query_shorter_than_stored() -> None:
    p = list(range(100, 124))
    r = run(index_with([p]), p[:19])
    assert r.matched_tokens == 18, "19-token query: 16 exact, 3 tokens into chunk 2, floor to 2"


def test_query_longer_than_stored() -> None:
    p = list(range(100, 120))  # 2 full chunks + a 4-token tail chunk
    r = run(index_with([p]), [*p, 1, 2, 3, 4, 5, 6])
    assert r.matched_tokens == 20, "the stored short tail chunk is a prefix of the query's chunk 2"
    assert r.chunks[-1].partial and r.chunks[-1].stored_tokens == 4


def test_namespace_isolation() -> None:
    p = list(range(100, 124))
    other = Namespace(model="another-model").fingerprint
    idx = index_with([p], fp=other)
    assert run(idx, p).matched_tokens == 0
    assert run(idx, p, fp=other).matched_tokens == 24


def test_min_tokens_and_granularity() -> None:
    p = list(range(100, 124))
    idx = index_with([p])
    assert run(idx, p[:10], min_tokens=16).matched_tokens == 0
    assert run(idx, p[:10], min_tokens=16).stop == "below_min_tokens"
    assert run(idx, p[:10], min_tokens=10).matched_tokens == 10
    assert run(idx, p, granularity=5).matched_tokens == 20, (
        "rounded down to the engine's block size"
    )


def test_prefix_spanning_tiers() -> None:
    p = list(range(100, 124))
    idx = Index(G)
    for level, (header, _) in zip((1, 2, 3), make_chain(p, C), strict=True):
        idx.add(header, level)
    r = run(idx, p)
    assert [c.tier for c in r.chunks] == [1, 2, 3] and r.by_tier == {1: 8, 2: 8, 3: 8}


def test_stop_reason_remembers_eviction() -> None:
    p = list(range(100, 124))
    idx = index_with([p])
    chain = make_chain(p, C)
    idx.drop_tier(chain[1][0].key, 1, "evicted")
    idx.remove(chain[2][0].key, "evicted")
    r = run(idx, p)
    assert r.matched_tokens == 8 and r.stop == "evicted"


def test_best_sibling_wins() -> None:
    base = list(range(100, 108))
    a, b = [*base, 1, 2, 3, 4, 9, 9, 9, 9], [*base, 1, 2, 3, 4, 5, 6, 9, 9]
    r = run(index_with([a, b]), [*base, 1, 2, 3, 4, 5, 6, 7, 8])
    assert r.matched_tokens == 14 and r.chunks[-1].key == make_chain(b, C)[1][0].key


def test_cost_does_not_depend_on_store_size() -> None:
    """Lookups touch only the prompt's chunks: a store 100x larger does not change the answer."""
    p = list(range(100, 124))
    small = index_with([p])
    big = index_with([p] + [[1000 + i, *range(7)] * 3 for i in range(300)])
    assert run(small, p) == run(big, p)


def reference(prompts: list[list[int]], q: list[int], g_req: int) -> int:
    best = 0
    for p in prompts:
        m = 0
        for s in range(0, len(q), C):
            qc, pc = q[s : s + C], p[s : s + C]
            if not pc:
                break
            if qc == pc:
                m += len(qc)
                continue
            common = 0
            while common < min(len(qc), len(pc)) and qc[common] == pc[common]:
                common += 1
            m += common // G * G
            break
        best = max(best, m)
    return best // g_req * g_req


@settings(max_examples=300, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=30), min_size=0, max_size=6),
    q=st.lists(st.integers(0, 2), min_size=0, max_size=34),
    g_req=st.sampled_from([1, 2, 4]),
)
def test_matches_reference_model(prompts: list[list[int]], q: list[int], g_req: int) -> None:
    # Stored chunks are whole units of the granularity, as an engine stores whole blocks.
    prompts = [p[: len(p) // G * G] for p in prompts if len(p) >= G]
    r = run(index_with(prompts), q, granularity=g_req)
    assert r.matched_tokens == reference(prompts, q, g_req), (prompts, q, r)
    assert sum(c.tokens for c in r.chunks) == r.matched_tokens
