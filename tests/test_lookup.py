"""Partial prefix matching (min_length semantics) on the index, against a reference model."""

from __future__ import annotations

import pickle
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.engine.index import Index
from kvstore.engine.lookup import KeyChain, lookup
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.keys import ROOT, ChunkKey, Fingerprint, Namespace, family, token_view
from kvstore.protocol import lookup_from_pb, lookup_to_pb
from kvstore.sdk.chunks import lookup_hashes
from kvstore.types import ChunkMatch, ChunkMatches, LookupResult
from kvstore.v1 import kvstore_pb2 as pb
from tests.helpers import FP, make_chain, make_chunk

C, G = 8, 2  # chunk tokens and granularity for the small cases


def index_with(
    prompts: list[list[int]], *, level: int = 1, fp=FP, granularity: int = G, wide: int = 16
) -> Index:
    """``wide=0``: every family is filed by prefix (``Index.siblings``), as big ones are."""
    idx = Index(granularity, wide=wide)
    for p in prompts:
        for header, _ in make_chain(p, C, fp=fp):
            idx.add(header, level)
    return idx


def run(idx: Index, q: list[int], **kw):  # type: ignore[no-untyped-def]
    kw.setdefault("chunk_tokens", C)
    return lookup(idx, kw.pop("fp", FP), q, **kw)


def by_keys(idx: Index, q: list[int], **kw):  # type: ignore[no-untyped-def]
    """``run``, fed the way a client sends the prompt: its keys and every chunk's
    sub-hashes, hashed by the SDK (``kvstore.sdk.base.lookup_hashes``), no token ids."""
    fp = kw.pop("fp", FP)
    keys, sub = lookup_hashes(fp, token_view(q), C, idx.granularity)
    chain = KeyChain(keys, len(q), sub, C, idx.granularity)
    result = lookup(idx, fp, chain, chunk_tokens=C, **kw)
    assert chain.needs is None, "with every chunk's sub-hashes it never asks for more"
    return result


class Remote:
    """A shared tier as lookup sees one (``RemoteView``): what it holds, in memory."""

    def __init__(self, prompts: list[list[int]], fp: Fingerprint = FP) -> None:
        self.held: dict[bytes, tuple[bytes, bytes]] = {}  # key -> (parent, token bytes)
        for p in prompts:
            for header, _ in make_chain(p, C, fp=fp):
                self.held[header.key] = (header.parent, header.token_bytes)

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [k in self.held for k in keys]

    def siblings(
        self, parent: ChunkKey, fingerprint: bytes, subhashes: bytes, granularity: int
    ) -> dict[ChunkKey, bytes]:  # all of them: which are the best is lookup's to say
        return {ChunkKey(k): tb for k, (par, tb) in self.held.items() if par == parent}

    def has_children(self, parent: ChunkKey, fingerprint: bytes) -> bool:
        return any(par == parent for par, _ in self.held.values())


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
    # Where matching ended, in chunks, before the caller's rounding or its min_tokens.
    below = run(idx, p[:10], min_tokens=16)
    assert below.stop_chunk == 1 and below.chunks == (), "10 tokens: chunk 0 and 2 of chunk 1"
    cut = run(idx, p, granularity=5)  # 24 -> 20: chunk 2 kept in part (4 of its 8)
    assert cut.stop == "granularity" and cut.stop_chunk == 2, cut
    assert cut.chunks[-1].partial and cut.chunks[-1].tokens == 4, cut
    whole = run(idx, p, granularity=16)  # 24 -> 16: chunk 2 cut off whole
    assert whole.stop == "granularity" and whole.stop_chunk == 2 and len(whole.chunks) == 2


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
    idx = index_with(prompts)
    r = run(idx, q, granularity=g_req)
    assert r.matched_tokens == reference(prompts, q, g_req), (prompts, q, r)
    assert sum(c.tokens for c in r.chunks) == r.matched_tokens
    check_rows(r)
    assert by_keys(idx, q, granularity=g_req) == r, "fed by keys, the same lookup answers alike"
    filed = run(index_with(prompts, wide=0), q, granularity=g_req)
    assert filed == r, f"a family filed by prefix answers as one scanned: {filed} != {r}"


@settings(max_examples=300, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 2), min_size=2, max_size=24), max_size=12),
    gone=st.sets(st.integers(0, 40)),
    queries=st.lists(
        st.tuples(st.integers(0, 11), st.integers(0, 24), st.lists(st.integers(0, 2), max_size=8)),
        min_size=1,
        max_size=6,
    ),
)
def test_families_filed_by_prefix_answer_as_scanned_ones_after_removals(
    prompts: list[list[int]], gone: set[int], queries: list[tuple[int, int, list[int]]]
) -> None:
    """Queries are stored prompts cut short and given another tail: they share prefixes
    with what is stored, and with what was removed."""
    prompts = [p[: len(p) // G * G] for p in prompts]
    asked = [[*prompts[i % len(prompts)][:cut], *tail] if prompts else tail
             for i, cut, tail in queries]  # fmt: skip
    scanned, filed = index_with(prompts, wide=10**9), index_with(prompts, wide=0)
    keys = list(scanned.entries)
    for i in sorted(gone):
        if i < len(keys):
            scanned.remove(keys[i])
            filed.remove(keys[i])
    for q in asked:
        assert run(filed, q) == run(scanned, q), (prompts, sorted(gone), q)
    for p in prompts:  # stored again after the removals
        for header, _ in make_chain(p, C):
            scanned.add(header, 1)
            filed.add(header, 1)
    for q in asked:
        assert run(filed, q) == run(scanned, q), (prompts, q)


def test_a_miss_reads_the_best_siblings_not_the_whole_family() -> None:
    """ROOT's family holds every distinct first chunk of a namespace. A partial match in
    it reads the siblings that share the most units with the chunk that missed, however
    many others share fewer (a scan of 100,000 siblings made a miss take 127 ms)."""
    g = 2
    idx = Index(g)
    template = [7] * 4  # every stored prompt's first two units
    for i in range(2000):
        for header, _ in make_chain([*template, i % 251, i // 251, 1, 2], C, fp=FP):
            idx.add(header, 1)
    best = [*template, 5, 3, 9, 9]  # shares 3 units with prompt 5 + 3*251 only
    q = [*best, *range(8)]
    qsub = lookup_hashes(FP, token_view(q), C, g)[1][: C // g * 8]
    got, most = idx.siblings(family(ROOT, FP), FP, qsub)
    assert list(got) == [make_chain([*template, 5, 3, 1, 2], C)[0][0].key] and most == 3, got
    r = lookup(idx, FP, q, chunk_tokens=C)
    assert r.matched_tokens == 6 and r.stop == "diverged", r
    assert r.chunks[0].key == make_chain([*template, 5, 3, 1, 2], C)[0][0].key
    other = lookup_hashes(FP, token_view([*template, 9, 9, 9, 9]), C, g)[1]
    shallow, most = idx.siblings(family(ROOT, FP), FP, other)
    assert 0 < len(list(shallow)) <= 64 and most == 2, "two units shared by all: a bounded read"


def check_rows(r: LookupResult) -> None:
    """What every answer's rows hold, however the columns were built and trimmed, and
    that they cross the wire unchanged."""
    rows = list(r.chunks)
    assert all(c.start == i * C for i, c in enumerate(rows)), rows
    assert all(0 < c.tokens <= c.stored_tokens for c in rows), rows
    assert not any(c.partial for c in rows[:-1]), f"only the last chunk is partial: {rows}"
    for c in rows:  # an exact match serves the prompt's chunk whole: a short last one too
        assert c.partial or c.tokens == c.stored_tokens == min(C, r.total_tokens - c.start), rows
    per_tier: dict[int, int] = {}
    for c in rows:
        per_tier[c.tier] = per_tier.get(c.tier, 0) + c.tokens
    assert per_tier == r.by_tier, (rows, r.by_tier)
    assert lookup_from_pb(lookup_to_pb(r)) == r, "the wire keeps every field"


@settings(max_examples=200, deadline=None)
@given(
    local=st.lists(st.lists(st.integers(0, 2), min_size=2, max_size=30), max_size=4),
    shared=st.lists(st.lists(st.integers(0, 2), min_size=2, max_size=30), max_size=4),
    q=st.lists(st.integers(0, 2), min_size=0, max_size=34),
    min_tokens=st.sampled_from([0, 6]),
)
def test_keys_and_token_ids_answer_alike_across_tiers(
    local: list[list[int]], shared: list[list[int]], q: list[int], min_tokens: int
) -> None:
    """With a shared tier (L3) holding chains the index does not know, both feeds give
    the same result, field by field: walk, stop reason, partial match, rounding."""
    local = [p[: len(p) // G * G] for p in local]
    shared = [p[: len(p) // G * G] for p in shared]
    idx, remote = index_with(local), Remote(shared)
    want = run(idx, q, remote=remote, min_tokens=min_tokens)
    got = by_keys(idx, q, remote=remote, min_tokens=min_tokens)
    assert got == want, (local, shared, q)
    check_rows(got)
    # The SDK's way for a long prompt: keys alone, then the one chunk's sub-hashes if asked.
    keys, subs = lookup_hashes(FP, token_view(q), C, G)
    bare = KeyChain(keys, len(q), b"", C, G)
    first = lookup(idx, FP, bare, chunk_tokens=C, remote=remote, min_tokens=min_tokens)
    if bare.needs is None:
        assert first == want, "not asked for sub-hashes: the answer is final"
    else:
        k = bare.needs
        one = KeyChain(keys, len(q), subs[k * 32 : (k + 1) * 32], C, G, subs_of=k)
        assert lookup(idx, FP, one, chunk_tokens=C, remote=remote, min_tokens=min_tokens) == want


def test_keys_without_sub_hashes_match_whole_chunks_and_say_which_chunk_needs_them() -> None:
    """Sent without sub-hashes, a lookup counts whole chunks and names the chunk where a
    stored sibling might share a prefix; asked again with that chunk's sub-hashes
    alone (``subs_of``), it answers as with every chunk's, or with the token ids."""
    p = list(range(100, 124))
    idx = index_with([p])
    q = p[:13] + [1] + p[14:]  # diverges inside chunk 1: 12 tokens with the partial rule
    want = run(idx, q)
    assert want.matched_tokens == 12 and by_keys(idx, q) == want
    keys, subs = lookup_hashes(FP, token_view(q), C, G)
    bare = KeyChain(keys, len(q), b"", C, G)
    r = lookup(idx, FP, bare, chunk_tokens=C)
    assert r.matched_tokens == 8 and r.stop == "not_stored" and bare.needs == 1, (r, bare.needs)
    one = KeyChain(keys, len(q), subs[4 * 8 : 8 * 8], C, G, subs_of=1)
    assert lookup(idx, FP, one, chunk_tokens=C) == want and one.needs is None
    # Where no stored chunk shares the parent there is nothing to compare: no second ask.
    longer = [*p, *range(8)]
    bare = KeyChain(lookup_hashes(FP, token_view(longer), C, G)[0], len(longer), b"", C, G)
    assert lookup(idx, FP, bare, chunk_tokens=C).matched_tokens == 24 and bare.needs is None
    full = KeyChain(lookup_hashes(FP, token_view(p), C, G)[0], len(p), b"", C, G)
    assert lookup(idx, FP, full, chunk_tokens=C).matched_tokens == 24 and full.needs is None


def test_key_chains_that_do_not_fit_the_prompt_are_refused() -> None:
    p = list(range(100, 120))  # 3 chunks: 8 + 8 + 4 tokens
    keys, subs = lookup_hashes(FP, token_view(p), C, G)
    assert len(keys) == 3 * 32 and len(subs) == (4 + 4 + 2) * 8
    KeyChain(keys, 20, subs, C, G)
    KeyChain(b"", 0, b"", C, G)
    with pytest.raises(InvalidArgument, match="chunk_keys is 64 bytes; a 20-token prompt"):
        KeyChain(keys[:64], 20, subs, C, G)
    with pytest.raises(InvalidArgument, match="chunk_keys is 96 bytes; a 25-token"):
        KeyChain(keys, 25, subs, C, G)
    with pytest.raises(InvalidArgument, match="sub_hashes is 72 bytes; a 20-token prompt has 80"):
        KeyChain(keys, 20, subs[:72], C, G)
    with pytest.raises(InvalidArgument, match="sub_hashes is 32 bytes; chunk 2 of a 20-token"):
        KeyChain(keys, 20, subs[:32], C, G, subs_of=2)
    with pytest.raises(InvalidArgument, match=r"sub_hashes_of=3: the prompt has chunks 0\.\.2"):
        KeyChain(keys, 20, subs[:32], C, G, subs_of=3)
    # Keys of another namespace name nothing here: the walk stops at once. (The sub-hashes
    # say which tokens the prompt starts with, as token ids would: they still count.)
    other = Namespace(model="another-model").fingerprint
    okeys, osubs = lookup_hashes(other, token_view(p), C, G)
    idx = index_with([p])
    r = lookup(idx, FP, KeyChain(okeys, 20, b"", C, G), chunk_tokens=C)
    assert r.matched_tokens == 0 and r.stop == "not_stored", r  # (and it needs sub-hashes)
    r = lookup(idx, FP, KeyChain(okeys, 20, osubs, C, G), chunk_tokens=C)
    assert r.matched_tokens == 8 and r.chunks[0].partial, "chunk 0's first 8 tokens agree"


def test_a_sibling_of_another_namespace_is_never_matched() -> None:
    """A chunk of namespace B stored under a chunk of namespace A as its parent (a writer of
    B that knows A's key can make one: its key is valid for its own parent and namespace)
    shares A's next tokens: neither feed matches it for A. (It was matched partly by the
    token ids: A's reader would have loaded B's KV.)"""
    other = Namespace(model="another-model").fingerprint
    p = list(range(100, 116))  # A: 2 chunks
    idx = index_with([p])
    a0 = make_chain(p, C)[0][0]
    intruder, _ = make_chunk([*p[8:12], 1, 1, 1, 1], parent=a0.key, fp=other)
    idx.add(intruder, 1)
    q = [*p[:12], 1, 1, 7, 7]  # A's chunk 1 shares its first 4 tokens, the intruder 6
    r = run(idx, q)
    assert r.matched_tokens == 12, f"A's own chunk 1 matches 4 tokens, nothing more: {r}"
    assert all(m.key != intruder.key for m in r.chunks), f"B's chunk served to A: {r}"
    assert by_keys(idx, q) == r
    bare = KeyChain(lookup_hashes(FP, token_view(q), C, G)[0], len(q), b"", C, G)
    lookup(idx, FP, bare, chunk_tokens=C)
    okeys = lookup_hashes(other, token_view(p), C, G)[0]
    idx.add(make_chain(p, C, fp=other)[0][0], 1)  # B's own chunk 0
    r = lookup(idx, FP, KeyChain(okeys, len(p), b"", C, G), chunk_tokens=C)
    assert r.matched_tokens == 0, "keys of B's chunks sent under A's fingerprint name nothing"


def test_a_sibling_of_another_namespace_does_not_hide_the_namespaces_own() -> None:
    """The intruder above, in a family filed by prefix: it shares more units with the
    query than A's own sibling, and A's partial match is still found (filed under the
    intruder's namespace, it is never a candidate)."""
    other = Namespace(model="another-model").fingerprint
    answers = []
    for wide in (10**9, 0):
        idx = index_with([], wide=wide)
        h0, _ = make_chunk(list(range(100, 108)), fp=FP)
        idx.add(h0, 1)
        mine, _ = make_chunk([1, 1, 5, 5, 0, 0, 0, 0], parent=h0.key, fp=FP)
        theirs, _ = make_chunk([1, 1, 2, 2, 3, 3, 0, 0], parent=h0.key, fp=other)
        idx.add(mine, 1)
        idx.add(theirs, 1)
        r = run(idx, [*range(100, 108), 1, 1, 2, 2, 3, 3, 9, 9])
        assert r.matched_tokens == 10 and r.chunks[-1].key == mine.key, (wide, r)
        answers.append(r)
    assert answers[0] == answers[1]


def test_chunk_matches_read_as_the_rows_they_hold() -> None:
    """ChunkMatches keeps columns; read as a sequence it is the tuple of rows it stands for."""
    keys = [bytes([i]) * 32 for i in range(3)]
    rows = tuple(
        ChunkMatch(ChunkKey(k), i * C, C if i < 2 else 4, C, 1 + i % 2, i == 2)
        for i, k in enumerate(keys)
    )
    m = ChunkMatches.of(rows)
    assert len(m) == 3 and m == rows and rows == m and list(m) == list(rows)
    assert m[0] == rows[0] and m[-1] == rows[-1] and m[-3] == rows[0]
    assert m[1:] == rows[1:] and isinstance(m[1:], ChunkMatches) and m[::2] == rows[::2]
    assert m[5:] == () and not m[5:] and ChunkMatches() == () and ChunkMatches.of(m) is m
    assert m != rows[:2] and m != (*rows[:2], rows[0]) and m != "abc"
    with pytest.raises(IndexError):
        m[3]
    with pytest.raises(IndexError):
        m[-4]
    with pytest.raises(ValueError, match="differ in length"):
        ChunkMatches(b"".join(keys), [0, C], [C] * 3, [C] * 3, b"\x01" * 3, [False] * 3)
    assert "ChunkMatch(" in repr(m), "a failing test shows the rows"


def test_a_lookup_answer_whose_columns_differ_is_refused() -> None:
    msg = lookup_to_pb(
        LookupResult(C, C, ChunkMatches.of((ChunkMatch(ChunkKey(b"k" * 32), 0, C, C, 1, False),)))
    )
    msg.chunks.tokens.append(C)
    with pytest.raises(KVStoreError, match="malformed lookup response"):
        lookup_from_pb(pb.LookupResponse.FromString(msg.SerializeToString()))
    msg.chunks.tokens.pop()
    got = lookup_from_pb(msg)
    assert pickle.loads(pickle.dumps(got)) == got, (
        "a client's answer pickles (its columns are a message's)"
    )
    msg.chunks.tier[0] = 300
    with pytest.raises(KVStoreError, match="malformed lookup response"):
        lookup_from_pb(msg)
