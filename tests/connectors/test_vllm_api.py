"""KVStoreConnector against vLLM's KVConnectorBase_V1, without an engine.

vLLM calls the connector through its base class; a vLLM release that adds an abstract
method, renames a keyword or adds a parameter would otherwise surface as a TypeError
inside an engine process, far from its cause. These tests compare what the connector
defines with the installed vLLM's base class (and ``SupportsHMA`` where the connector
claims it): every abstract method implemented, every overridden method of the same
kind (method, classmethod, property) and callable the way the base class is called,
positionally and by keyword. A failure names the method and what differs.

The same check runs against any other vLLM's ``base.py`` without installing it:
``KVSTORE_VLLM_BASE_PY=/path/to/vllm/distributed/kv_transfer/kv_connector/v1/base.py``
(read as source, never imported). Hooks newer than the installed vLLM are checked
against the signatures recorded below from the vLLM 0.33.0 wheel.
"""

from __future__ import annotations

import abc
import ast
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvstore.connectors.vllm import KVStoreConnector
from vllm.distributed.kv_transfer.kv_connector.v1 import base as vllm_base

P = inspect.Parameter
POSITIONAL = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)


@dataclass(frozen=True)
class Member:
    """One method of a base class as vLLM calls it."""

    kind: str  # "method", "classmethod", "staticmethod" or "property"
    sig: inspect.Signature | None  # without self/cls; None for properties
    abstract: bool


def _kind(attr: Any) -> str:
    if isinstance(attr, classmethod):
        return "classmethod"
    if isinstance(attr, staticmethod):
        return "staticmethod"
    if isinstance(attr, property):
        return "property"
    return "method"


def _signature(attr: Any, kind: str) -> inspect.Signature | None:
    if kind == "property":
        return None
    fn = attr.__func__ if kind in ("classmethod", "staticmethod") else attr
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if kind != "staticmethod":
        params = params[1:]  # self / cls
    return sig.replace(parameters=params)


def api_of_class(cls: type) -> dict[str, Member]:
    """The public and overridable members ``cls`` itself defines."""
    out = {}
    for name, attr in vars(cls).items():
        if name.startswith("__") or not (
            callable(attr) or isinstance(attr, classmethod | staticmethod | property)
        ):
            continue
        if name.startswith("_") and name != "_get_connector_metadata":
            continue
        kind = _kind(attr)
        abstract = getattr(attr.fget if kind == "property" else attr, "__isabstractmethod__", False)
        out[name] = Member(kind, _signature(attr, kind), bool(abstract))
    return out


def api_of_source(source: str, class_name: str) -> dict[str, Member]:
    """The same, read from a base.py of another vLLM: each ``def`` line is rebuilt
    without annotations and with placeholder defaults, then inspected."""
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    out = {}
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("__"):
            continue
        if fn.name.startswith("_") and fn.name != "_get_connector_metadata":
            continue
        decorators = {ast.unparse(d).split(".")[-1] for d in fn.decorator_list}
        kind = next(
            (k for k in ("classmethod", "staticmethod", "property") if k in decorators),
            "method",
        )
        args = fn.args
        for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            a.annotation = None
        for extra in (args.vararg, args.kwarg):
            if extra is not None:
                extra.annotation = None
        args.defaults = [ast.Constant(None) for _ in args.defaults]
        args.kw_defaults = [None if d is None else ast.Constant(None) for d in args.kw_defaults]
        fn.decorator_list, fn.returns, fn.body = [], None, [ast.Pass()]
        ns: dict[str, Any] = {}
        exec(ast.unparse(fn), ns)  # a def of placeholders: no vLLM code runs
        raw: Any = ns[fn.name]
        attr = {"classmethod": classmethod, "staticmethod": staticmethod}.get(kind, lambda f: f)(
            raw
        )
        if kind == "property":
            attr = property(raw)
        out[fn.name] = Member(kind, _signature(attr, kind), "abstractmethod" in decorators)
    return out


def call_problems(base: inspect.Signature, over: inspect.Signature) -> list[str]:
    """Why a call that is valid for ``base`` could fail against ``over`` (empty: none)."""
    problems = []
    bp, op = list(base.parameters.values()), list(over.parameters.values())
    var_pos = any(p.kind is P.VAR_POSITIONAL for p in op)
    var_kw = any(p.kind is P.VAR_KEYWORD for p in op)
    o_pos = [p for p in op if p.kind in POSITIONAL]
    o_kw = {p.name: p for p in op if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
    b_pos = [p for p in bp if p.kind in POSITIONAL]
    for i, p in enumerate(b_pos):
        q = o_pos[i] if i < len(o_pos) else None
        if q is None:
            if not var_pos:
                problems.append(f"takes no parameter {i + 1} ({p.name!r})")
            elif p.kind is P.POSITIONAL_OR_KEYWORD and p.name not in o_kw and not var_kw:
                problems.append(f"cannot take {p.name!r} by keyword")
            continue
        if p.kind is P.POSITIONAL_OR_KEYWORD and q.name != p.name and not var_kw:
            problems.append(f"parameter {i + 1} is {q.name!r}, vLLM's is {p.name!r}")
        elif p.kind is P.POSITIONAL_OR_KEYWORD and q.kind is P.POSITIONAL_ONLY:
            problems.append(f"{p.name!r} is positional-only here, vLLM may pass it by keyword")
        if p.default is not P.empty and q.default is P.empty:
            problems.append(f"{q.name!r} has no default, vLLM may leave it out")
    for p in bp:
        if p.kind is P.KEYWORD_ONLY:
            q = o_kw.get(p.name)
            if q is None and not var_kw:
                problems.append(f"takes no keyword {p.name!r}")
            elif q is not None and p.default is not P.empty and q.default is P.empty:
                problems.append(f"{p.name!r} has no default, vLLM may leave it out")
        elif p.kind is P.VAR_POSITIONAL and not var_pos:
            problems.append(f"takes no *{p.name}")
        elif p.kind is P.VAR_KEYWORD and not var_kw:
            problems.append(f"takes no **{p.name} (vLLM passes extra keywords)")
    b_names = {p.name for p in bp}
    for i, q in enumerate(o_pos[len(b_pos) :], start=len(b_pos)):
        if q.default is P.empty:
            problems.append(f"parameter {i + 1} ({q.name!r}) is required, vLLM never passes it")
    for q in op:
        if q.kind is P.KEYWORD_ONLY and q.name not in b_names and q.default is P.empty:
            problems.append(f"keyword {q.name!r} is required, vLLM never passes it")
    return problems


def _defined_by(cls: type, name: str, bases: tuple[type, ...]) -> type | None:
    """The class in ``cls``'s MRO that defines ``name``, or None if only vLLM's do."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return None if klass in bases or klass is object else klass
    return None


def api_problems(cls: type, api: dict[str, Member], bases: tuple[type, ...]) -> list[str]:
    """Every way ``cls`` falls short of ``api``, one line per method, naming it."""
    problems = []
    for name, member in sorted(api.items()):
        owner = _defined_by(cls, name, bases)
        if owner is None:
            if member.abstract:
                problems.append(f"{name}: abstract in vLLM's base class, not implemented")
            continue
        attr = vars(owner)[name]
        kind = _kind(attr)
        if kind != member.kind:
            problems.append(f"{name}: a {kind} here, a {member.kind} in vLLM's base class")
            continue
        if member.sig is None:
            continue
        sig = _signature(attr, kind)
        assert sig is not None
        for p in call_problems(member.sig, sig):
            problems.append(f"{name}{sig}: {p} (vLLM's base class: {name}{member.sig})")
    return problems


def _bases_of(cls: type) -> tuple[type, ...]:
    return tuple(
        b for b in (vllm_base.KVConnectorBase_V1, getattr(vllm_base, "SupportsHMA", None)) if b
    ) + tuple(k for k in cls.__mro__ if k is abc.ABC or k.__module__.startswith("vllm."))


def installed_api(cls: type) -> dict[str, Member]:
    api = api_of_class(vllm_base.KVConnectorBase_V1)
    hma = getattr(vllm_base, "SupportsHMA", None)
    if hma is not None and issubclass(cls, hma):
        api.update(api_of_class(hma))
    return api


# Hooks vLLM 0.33.0 added to KVConnectorBase_V1 (read from the 0.33.0 wheel's base.py; its
# abstract methods and every other signature are those of 0.32): sleep mode's. A connector
# that overrides one must take the arguments 0.33 passes, even while 0.32 never calls it.
VLLM_033_ADDED = {
    "supports_sleep_mode": Member(
        "classmethod", inspect.Signature([P("kv_transfer_config", P.POSITIONAL_OR_KEYWORD)]), False
    ),
    "unregister_kv_caches": Member("method", inspect.Signature([]), False),
    "restore_kv_caches": Member("method", inspect.Signature([]), False),
}


def test_connector_fits_the_installed_base_class() -> None:
    cls = KVStoreConnector
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    assert not missing, f"KVStoreConnector leaves vLLM's abstract methods unimplemented: {missing}"
    problems = api_problems(cls, installed_api(cls), _bases_of(cls))
    assert not problems, "KVStoreConnector does not fit the installed vLLM:\n" + "\n".join(problems)


def test_connector_fits_the_hooks_of_vllm_033() -> None:
    api = {k: v for k, v in VLLM_033_ADDED.items() if k not in vars(vllm_base.KVConnectorBase_V1)}
    problems = api_problems(KVStoreConnector, api, _bases_of(KVStoreConnector))
    assert not problems, "KVStoreConnector does not fit vLLM 0.33's hooks:\n" + "\n".join(problems)


def test_connector_claims_sleep_mode() -> None:
    """0.33 refuses to start an engine with sleep mode on if the connector says no."""
    assert KVStoreConnector.supports_sleep_mode(None) is True


@pytest.mark.skipif(not os.environ.get("KVSTORE_VLLM_BASE_PY"), reason="KVSTORE_VLLM_BASE_PY unset")
def test_connector_fits_another_vllms_base_py() -> None:
    path = Path(os.environ["KVSTORE_VLLM_BASE_PY"])
    source = path.read_text()
    api = api_of_source(source, "KVConnectorBase_V1")
    problems = api_problems(KVStoreConnector, api, _bases_of(KVStoreConnector))
    assert not problems, f"KVStoreConnector does not fit {path}:\n" + "\n".join(problems)


def test_source_reading_agrees_with_the_installed_class() -> None:
    """The reader of other vLLMs' base.py sees the installed one as inspect does."""
    source = Path(inspect.getfile(vllm_base)).read_text()
    from_source = api_of_source(source, "KVConnectorBase_V1")
    from_class = api_of_class(vllm_base.KVConnectorBase_V1)
    assert from_source.keys() == from_class.keys()
    for name, m in from_class.items():
        s = from_source[name]
        assert (s.kind, s.abstract) == (m.kind, m.abstract), name
        if m.sig is not None:
            assert s.sig is not None
            assert [(p.name, p.kind, p.default is P.empty) for p in s.sig.parameters.values()] == [
                (p.name, p.kind, p.default is P.empty) for p in m.sig.parameters.values()
            ], name


# -- the check itself can fail, and says where -------------------------------------------------


def _broken(**members: Callable[..., Any]) -> type:
    return type("Broken", (KVStoreConnector,), {"__module__": __name__, **members})


@pytest.mark.parametrize(
    ("members", "expected"),
    [
        (
            {"get_num_new_matched_tokens": lambda self, request, computed: (0, False)},
            "get_num_new_matched_tokens(request, computed): parameter 2 is 'computed', "
            "vLLM's is 'num_computed_tokens'",
        ),
        (
            {"save_kv_layer": lambda self, layer_name, kv_layer, attn_metadata: None},
            "save_kv_layer(layer_name, kv_layer, attn_metadata): takes no **kwargs",
        ),
        (
            {"request_finished": lambda self, request: (False, None)},
            "request_finished(request): takes no parameter 2 ('block_ids')",
        ),
        (
            {"update_connector_output": lambda self, out, extra: None},
            "update_connector_output(out, extra): parameter 2 ('extra') is required",
        ),
        (
            {"build_kv_connector_stats": lambda self, data=None: None},
            "build_kv_connector_stats: a method here, a classmethod in vLLM's base class",
        ),
        (
            {"requires_kv_delivery": lambda self: False},
            "requires_kv_delivery: a method here, a property in vLLM's base class",
        ),
    ],
)
def test_the_check_names_what_differs(
    members: dict[str, Callable[..., Any]], expected: str
) -> None:
    cls = _broken(**members)
    problems = api_problems(cls, installed_api(cls), _bases_of(cls))
    assert any(expected in p for p in problems), f"expected {expected!r} among {problems}"


def test_the_check_finds_an_abstract_method_left_out() -> None:
    """A base class that grows an abstract method the connector lacks."""

    class Grown(vllm_base.KVConnectorBase_V1):
        def a_new_hook(self, request: Any, *, tokens: int) -> None:
            raise NotImplementedError

        a_new_hook.__isabstractmethod__ = True  # type: ignore[attr-defined]

    api = {**installed_api(KVStoreConnector), **api_of_class(Grown)}
    problems = api_problems(KVStoreConnector, api, _bases_of(KVStoreConnector))
    assert problems == ["a_new_hook: abstract in vLLM's base class, not implemented"]
