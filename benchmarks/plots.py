"""PNG plots of a benchmark run, one per family, drawn from the records alone.

    python -m benchmarks.plots FILE.json [--out benchmarks/plots]

``python -m benchmarks`` calls ``make_all`` after a full run; any JSON that
``--json`` wrote, or ``benchmarks/results/results.json``, can be re-plotted
later (installed: ``python -m kvstore.benchmarks.plots``, default ``--out``
``./kvstore-bench/plots``). Each figure draws kvstore's figures as solid lines
and the limits measured in the same run as dashed ones, so the gap a reader
sees is the ratio the tables report. A family with no records in the
run is skipped. Needs matplotlib (the dev extra).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvstore.config import parse_size

from .harness import KiB, MiB, Record, module, output_dir

PLOTS = output_dir() / "plots"  # benchmarks/plots in the checkout
Rec = Mapping[str, Any]
Point = tuple[float, float, float | None]  # x, value, limit


def _as_dicts(records: Iterable[Record | Rec]) -> list[Rec]:
    return [r.to_json() if isinstance(r, Record) else r for r in records]


def series(recs: Sequence[Rec], pattern: str, x: Callable[[str], float]) -> list[Point]:
    """Points of the records whose name fully matches ``pattern`` (group 1 is the x label)."""
    rx = re.compile(pattern)
    out = []
    for r in recs:
        m = rx.fullmatch(r["name"])
        if m:
            out.append((x(m.group(1)), float(r["value"]), r.get("limit")))
    return sorted(out)


def _size_ticks(ax: Any, xs: Iterable[float]) -> None:
    ticks = sorted(set(xs))
    labels = [f"{int(t // MiB)}M" if t >= MiB else f"{int(t // KiB)}K" for t in ticks]
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, labels)
    ax.xaxis.set_minor_formatter(_null())


def _log_y(ax: Any) -> None:
    """Log y axis labelled with plain numbers (0.2, 5, 20), not 2x10^-1."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.set_yscale("log")
    plain = FuncFormatter(lambda y, _: f"{y:g}")
    ax.yaxis.set_major_formatter(plain)
    lo, hi = ax.get_ylim()
    if hi / lo < 3:  # a narrow range: label every minor tick
        ax.yaxis.set_minor_formatter(plain)
    elif hi / lo < 30:  # up to ~1.5 decades: label the 2s and 5s
        ax.yaxis.set_minor_formatter(
            FuncFormatter(lambda y, _: f"{y:g}" if _lead(y) in (2, 5) else "")
        )
    else:
        ax.yaxis.set_minor_formatter(NullFormatter())


def _lead(y: float) -> int:
    """The leading digit of ``y`` (2 for 0.2, 20 and 2.0)."""
    import math

    return int(round(y / 10 ** math.floor(math.log10(y)), 6)) if y > 0 else 0


def _count_ticks(ax: Any, xs: Iterable[float], k: int = 1000) -> None:
    """Log x axis at the measured points, labelled 1k, 128k, 1M (k: 1000 or 1024)."""
    ticks = sorted(set(xs))
    ax.set_xscale("log")
    ax.set_xticks(ticks, [f"{t / k**2:g}M" if t >= k**2 else f"{t / k:g}k" for t in ticks])
    ax.xaxis.set_minor_formatter(_null())


def _null() -> Any:
    from matplotlib.ticker import NullFormatter

    return NullFormatter()


def _line(ax: Any, pts: list[Point], label: str, style: str = "o-", **kw: Any) -> None:
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label, linewidth=1.8,
                markersize=5, **kw)  # fmt: skip


def _limit(ax: Any, pts: list[Point], label: str, style: str = "--", **kw: Any) -> None:
    pts = [p for p in pts if p[2]]
    if pts:
        ax.plot([p[0] for p in pts], [p[2] for p in pts], style, label=label, linewidth=1.4,
                alpha=0.8, **kw)  # fmt: skip


def _finish(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


# -- families -----------------------------------------------------------------------------
def tiers(recs: Sequence[Rec], path: Path) -> Path | None:
    import matplotlib.pyplot as plt

    size = parse_size
    s = lambda pat: series(recs, pat, size)  # noqa: E731
    panels: list[tuple[str, list[tuple[str, list[Point]]], list[tuple[str, list[Point], str]]]]
    panels = [
        ("L1 put (memory)", [("MemoryTier.put", s(r"l1\.tier\.put\.(\w+)")),
                             ("TieredStore.put", s(r"l1\.store\.put\.(\w+)"))],
         [("memcpy", s(r"l1\.tier\.put\.(\w+)"), "k")]),
        ("L2 put (LMDB)", [("DiskTier.put", s(r"l2\.put\.(\w+)"))],
         [("raw py-lmdb put", s(r"l2\.put\.(\w+)"), "tab:green"),
          ("memcpy", s(r"l2\.lmdb_put\.(\w+)"), "k")]),
        ("L3 put (Redis / Valkey)", [("RemoteTier.put, redis", s(r"l3\.redis\.put\.(\w+)")),
                                     ("RemoteTier.put, valkey", s(r"l3\.valkey\.put\.(\w+)"))],
         [("raw SET, redis", s(r"l3\.redis\.put\.(\w+)"), "tab:blue"),
          ("raw SET, valkey", s(r"l3\.valkey\.put\.(\w+)"), "tab:orange"),
          ("loopback TCP", s(r"l3\.redis\.raw_set\.(\w+)"), "k")]),
        ("L1 get_into", [("MemoryTier (verify)", s(r"l1\.tier\.get_into\.(\w+)")),
                         ("MemoryTier (no verify)", s(r"l1\.tier\.get_into\.noverify\.(\w+)")),
                         ("TieredStore", s(r"l1\.store\.get_into\.(\w+)"))],
         [("memcpy", s(r"l1\.tier\.get_into\.(\w+)"), "k")]),
        ("L2 get_into (warm page cache)", [("DiskTier.get_into", s(r"l2\.get_into\.(\w+)"))],
         [("raw py-lmdb get + copy", s(r"l2\.get_into\.vs_lmdb\.(\w+)"), "tab:green"),
          ("memcpy", s(r"l2\.get_into\.(\w+)"), "k")]),
        ("L3 get_into", [("RemoteTier, redis", s(r"l3\.redis\.get_into\.(\w+)")),
                         ("RemoteTier, valkey", s(r"l3\.valkey\.get_into\.(\w+)"))],
         [("raw GET + copy, redis", s(r"l3\.redis\.get_into\.(\w+)"), "tab:blue"),
          ("raw GET + copy, valkey", s(r"l3\.valkey\.get_into\.(\w+)"), "tab:orange"),
          ("loopback TCP", s(r"l3\.redis\.raw_get\.(\w+)"), "k")]),
    ]  # fmt: skip
    if not any(pts for _, lines, _ in panels for _, pts in lines):
        return None
    fig, axes = plt.subplots(2, 3, figsize=(16, 10), dpi=100)
    for ax, (title, lines, limits) in zip(axes.flat, panels, strict=True):
        xs = [p[0] for _, pts in lines for p in pts]
        for label, pts in lines:
            _line(ax, pts, label)
        for label, pts, color in limits:
            _limit(ax, pts, f"limit: {label}", color=color)
        ax.set_title(title, fontsize=11)
        _log_y(ax)
        ax.grid(True, which="both", alpha=0.3)
        if xs:
            _size_ticks(ax, xs)
            ax.legend(fontsize=7.5, loc="best", framealpha=0.85)
        ax.set_xlabel("chunk size (bytes)")
        ax.set_ylabel("GB/s (log)")
    fig.suptitle("Tier throughput vs chunk size (solid: kvstore; dashed: limits measured in the "
                 "same run)", fontsize=12)  # fmt: skip
    return _finish(fig, path)


def server_planes(recs: Sequence[Rec], path: Path) -> Path | None:
    import matplotlib.pyplot as plt

    s = lambda pat: series(recs, pat, parse_size)  # noqa: E731
    if not s(r"server\.shm\.put\.(\w+)"):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), dpi=100)
    for ax, op, shm_op in ((axes[0], "put", "put"), (axes[1], "get", "get_into")):
        shm, grpc = s(rf"server\.shm\.{shm_op}\.(\w+)"), s(rf"server\.grpc\.{op}\.(\w+)")
        _line(ax, shm, f"shared memory: Client.{shm_op} (Unix socket)", color="tab:blue")
        _line(ax, grpc, f"gRPC streaming: Client(shm=False).{op} (TCP)", color="tab:red")
        _limit(ax, shm, "limit: memcpy (1 thread)", color="tab:blue")
        _limit(ax, grpc, "limit: raw grpcio streaming, same bytes", color="tab:red")
        _limit(ax, s(rf"server\.grpc_raw\.{op}\.(\w+)"), "limit: loopback TCP sockets",
               ":", color="k")  # fmt: skip
        _size_ticks(ax, [p[0] for p in shm + grpc])
        _log_y(ax)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(f"kvstore-server {op}", fontsize=11)
        ax.set_xlabel("chunk size (bytes)")
        ax.set_ylabel("GB/s (log)")
        ax.legend(fontsize=8, loc="best", framealpha=0.85)
    fig.suptitle("Data planes: shared memory vs gRPC streaming, each against its limit")
    return _finish(fig, path)


def lookup(recs: Sequence[Rec], path: Path) -> Path | None:
    import matplotlib.pyplot as plt

    by_len = series(recs, r"lookup\.p50\.prompt=(\d+)k", lambda k: int(k) * 1024)
    by_keys = series(recs, r"lookup\.128k\.p50\.keys=([\d,]+)", lambda k: int(k.replace(",", "")))
    if not by_len and not by_keys:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), dpi=100)
    for ax, pts, xlabel, title, k in (
        (axes[0], by_len, "prompt length (tokens)", "p50 vs prompt length", 1024),
        (
            axes[1],
            by_keys,
            "chunk keys in the index",
            "p50 of a 128k-token prompt vs store size",
            1000,
        ),
    ):
        _line(ax, pts, "kvstore lookup", color="tab:blue")
        _limit(ax, pts, "limit: hashing the prompt's chunk keys (chunk_keys)", color="k")
        ax.axhline(1.0, color="tab:red", linestyle=":", linewidth=1, label="target: 1 ms")
        _count_ticks(ax, [p[0] for p in pts], k)
        _log_y(ax)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("ms (log)")
        ax.set_title(title, fontsize=11)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle("Prefix lookup latency (in-process index, 256-token chunks)")
    return _finish(fig, path)


def concurrency(recs: Sequence[Rec], path: Path) -> Path | None:
    import matplotlib.pyplot as plt

    put = series(recs, r"concurrency\.put\.clients=(\d+)", float)
    get = series(recs, r"concurrency\.get\.clients=(\d+)", float)
    if not put:
        return None
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    _line(ax, put, "Client.put (shared memory)", color="tab:red")
    _line(ax, get, "Client.get_into (shared memory)", color="tab:blue")
    _limit(ax, put, "limit: memcpy by as many processes", color="k")
    ax.set_xscale("log", base=2)
    ax.set_xticks([p[0] for p in put], [str(int(p[0])) for p in put])
    ax.xaxis.set_minor_formatter(_null())
    _log_y(ax)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_xlabel("concurrent client processes")
    ax.set_ylabel("aggregate GB/s (log)")
    ax.set_title("One kvstore-server, 4 MiB chunks, N client processes", fontsize=11)
    ax.legend(fontsize=9)
    return _finish(fig, path)


def replay(recs: Sequence[Rec], path: Path) -> Path | None:
    import matplotlib.pyplot as plt

    rounds = series(recs, r"replay\.ttft\.mean\.round=(\d+)", float)
    by = {r["name"]: r for r in recs}
    if not rounds or "replay.ttft.mean.with_kvstore" not in by:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), dpi=100, width_ratios=[3, 2])
    ax = axes[0]
    xs = [p[0] for p in rounds]
    ax.bar(
        [x - 0.2 for x in xs],
        [p[2] or 0 for p in rounds],
        0.4,
        label="without kvstore",
        color="tab:gray",
    )
    ax.bar([x + 0.2 for x in xs], [p[1] for p in rounds], 0.4, label="with kvstore",
           color="tab:blue")  # fmt: skip
    ax.set_xticks(xs, [f"round {int(x)}" for x in xs])
    ax.set_ylabel("mean TTFT (s)")
    ax.set_title("Mean TTFT per round (prompts grow every round)", fontsize=11)
    ax.legend(fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax = axes[1]
    stats = ("mean", "p90")
    wo = [by[f"replay.ttft.{s}.without_kvstore"]["value"] for s in stats]
    w = [by[f"replay.ttft.{s}.with_kvstore"]["value"] for s in stats]
    ax.bar([0 - 0.2, 1 - 0.2], wo, 0.4, label="without kvstore", color="tab:gray")
    ax.bar([0 + 0.2, 1 + 0.2], w, 0.4, label="with kvstore", color="tab:blue")
    for i, (a, b) in enumerate(zip(w, wo, strict=True)):
        ax.annotate(f"{a / b:.2f}x", (i + 0.2, a), textcoords="offset points", xytext=(0, 3),
                    ha="center", fontsize=9)  # fmt: skip
    ax.set_xticks([0, 1], ["mean TTFT", "p90 TTFT"])
    ax.set_ylabel("seconds")
    hit = by.get("replay.hit_rate.with_kvstore")
    title = "All requests"
    if hit:
        title += f": hit rate {hit['value']:.2f} (ideal {hit['limit']:.2f})"
    ax.set_title(title, fontsize=11)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=9)
    fig.suptitle("Multi-round chat replay through vLLM (CPU), prefix caching off in both runs")
    return _finish(fig, path)


FAMILIES: dict[str, Callable[[Sequence[Rec], Path], Path | None]] = {
    "tiers.png": tiers,
    "server_planes.png": server_planes,
    "lookup.png": lookup,
    "concurrency.png": concurrency,
    "replay_ttft.png": replay,
}


def make_all(records: Iterable[Record | Rec], out: Path = PLOTS) -> list[Path]:
    """Every family's PNG that the records allow; the paths written (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        return []
    recs = _as_dicts(records)
    written = []
    for name, draw in FAMILIES.items():
        path = draw(recs, out / name)
        if path is not None:
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {module('plots')}", description=__doc__)
    ap.add_argument("json", help="records written by python -m benchmarks --json")
    ap.add_argument("--out", default=str(PLOTS), help="directory (default: %(default)s)")
    args = ap.parse_args(argv)
    data = json.loads(Path(args.json).read_text())
    if isinstance(data, dict):  # benchmarks/results/results.json
        data = data["records"]
    paths = make_all(data, Path(args.out))
    print("\n".join(str(p) for p in paths) or "nothing to plot (or no matplotlib)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
