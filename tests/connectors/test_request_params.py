"""A request's own kvstore settings, ``kv_transfer_params`` ``{"kvstore": {...}}``, through
the connector's halves (tests/connectors/halves.py) against a real kvstore-server: a
request that turns loading off is not looked up and loads nothing, one that turns saving
off leaves nothing on the server, and the requests beside them are served as usual. With
real vLLM engines: test_vllm_connector.py (test_pd_consumer_loads_from_disk_after_restart).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvstore.connectors.vllm_config import ConnectorConfig, RequestParams, request_params

from kvstore.errors import ConfigError
from kvstore.testing.server import KVServer
from tests.connectors.halves import Engine
from tests.connectors.test_connector_drops import keys_of
from tests.connectors.test_connector_loads import Layout, calls_since, prompt, requests, stored

NO_LOAD = {"kvstore": {"load": False}}
NO_SAVE = {"kvstore": {"save": False}}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[KVServer]:
    s = KVServer(tmp_path / "srv", memory="256MiB").start()
    yield s
    s.stop(signal.SIGKILL)


@pytest.fixture
def engine(server: KVServer) -> Iterator[Engine]:
    e = Engine(server.unix_url, blocks=800)
    yield e
    e.close()


def test_a_request_that_turns_saving_off_leaves_nothing_on_the_server(
    engine: Engine, server: KVServer
) -> None:
    """x ({"save": false}), v ({"save": "nope"}: unreadable, so off) and y computed in one
    step: only y's three chunks are stored; asked again, y loads and x misses (and, asked
    without the setting, is stored then)."""
    x, y, v = prompt(900), prompt(901), prompt(902)
    lay = Layout()
    got = engine.step(
        [(x, lay.take(600)), (y, lay.take(600)), (v, lay.take(600))],
        params=[NO_SAVE, None, {"kvstore": {"save": "nope"}}],
    )
    assert all(a.told == 0 for a in got), "nothing was stored before"
    assert len(keys_of(server)) == 3, "y's three chunks, none of x's or v's, must be stored"
    again = engine.step([(x, lay.take(600)), (y, lay.take(600))])
    assert again[0].told == 0, "x asked not to be saved: nothing of it may load"
    assert again[1].told == stored(600) and not again[1].failed, again[1]
    assert len(keys_of(server)) == 6, "x, asked again without the setting, is stored"


def test_a_request_that_turns_loading_off_is_not_looked_up(
    engine: Engine, server: KVServer
) -> None:
    """x, y, z and w stored; a step with x ({"load": false}), y, z ({"load": "sometimes"}:
    unreadable, so off) and w ({"load": "true"}: read as the engine's settings are): y and
    w load, one Lookup each; x and z compute, not looked up and counted neither as hits
    nor as misses."""
    x, y, z, w = prompt(910), prompt(911), prompt(912), prompt(913)
    lay = Layout()
    engine.step([(p, lay.take(600)) for p in (x, y, z, w)])
    engine.stats()
    before = requests(server)
    got = engine.step(
        [(p, lay.take(600)) for p in (x, y, z, w)],
        params=[NO_LOAD, None, {"kvstore": {"load": "sometimes"}}, {"kvstore": {"load": "true"}}],
    )
    assert got[0].told == 0 and got[2].told == 0, "x and z asked not to load: they compute"
    assert got[1].told == stored(600) and got[3].told == stored(600), got
    calls = calls_since(server, before)
    assert calls["Lookup"] == 2, f"y and w are looked up, x and z are not: {calls}"
    sched, _ = engine.stats()
    assert (sched.get("lookup_hits"), sched.get("lookup_misses", 0)) == (2, 0), sched


def test_a_request_cannot_turn_on_what_the_engine_has_off(server: KVServer) -> None:
    """An engine that does not load (a kv_producer) stays one for a request asking to."""
    x = prompt(920)
    producer = Engine(server.unix_url, blocks=200)
    consumer_off = Engine(server.unix_url, blocks=200, load=False)
    try:
        producer.step([(x, Layout().take(600))])
        (a,) = consumer_off.step([(x, Layout().take(600))], params=[{"kvstore": {"load": True}}])
        assert a.told == 0, "load: true must not turn on an engine's load=false"
    finally:
        producer.close()
        consumer_off.close()


def test_request_settings_are_read_and_what_cannot_be_read_turns_kvstore_off() -> None:
    cfg, drops = ConnectorConfig(), ConnectorConfig(drop_after_load=True)
    assert request_params(None, cfg) == (RequestParams(), []), "nothing: the engine's settings"
    assert request_params({"do_remote_prefill": True}, drops) == (
        RequestParams(drop_after_load=True),
        [],
    ), "others' keys: the engine's settings"
    assert request_params({"kvstore": {}}, drops)[0].drop_after_load is True
    keep = request_params({"kvstore": {"drop_after_load": False}}, drops)[0]
    assert keep.drop_after_load is False
    got: Any = request_params({"kvstore": {"load": False, "save": "false"}}, cfg)
    assert got == (RequestParams(load=False, save=False), []), "booleans as the engine reads them"
    got = request_params({"kvstore": {"save": 2, "load": True}}, cfg)
    assert got[0] == RequestParams(save=False), f"an unreadable save is off, load kept: {got}"
    assert len(got[1]) == 1 and "save: expected true or false, got 2; save is off" in got[1][0]
    got = request_params({"kvstore": {"drop_after_load": "maybe"}}, drops)
    assert got[0] == RequestParams(drop_after_load=True), "drop_after_load stays the engine's"
    assert "the engine's drop_after_load holds" in got[1][0], got[1]
    allowed = '"load": true|false, "save": true|false, "drop_after_load": true|false'
    got = request_params({"kvstore": {"drop": True, "save": False}}, cfg)
    assert got[0] == RequestParams(save=False), "an unknown key is ignored, the others read"
    assert "unknown key 'drop' ignored" in got[1][0] and allowed in got[1][0], got[1]
    got = request_params({"kvstore": "off"}, cfg)
    assert got[0] == RequestParams(load=False, save=False), "not a table: kvstore off for it"
    assert allowed in got[1][0], got[1]
    with pytest.raises(ConfigError):  # the engine's own setting stays strict
        ConnectorConfig.parse({"drop_after_load": "sometimes"})
