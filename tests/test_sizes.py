"""One rule for byte sizes: ``kvstore.config.parse_size``, wherever a size is read.

``64M`` is 64 MiB (67,108,864 bytes) in a config file, a server flag, the vLLM
connector's settings, ``kvstore bench --size`` and the benchmarks' size labels;
``64MB`` is 64,000,000. A value that is not a size says which units are allowed.
(Before issue 17 the CLI had its own parser, for which ``64M`` was 64,000,000.)
"""

from __future__ import annotations

import contextlib
import io

import pytest

from kvstore.config import parse_size
from kvstore.errors import ConfigError

MIB_64 = 67_108_864
ALLOWED = "K/KiB, M/MiB, G/GiB, T/TiB (powers of 1024) or KB, MB, GB, TB (powers of 1000)"


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("64M", MIB_64),
        ("64m", MIB_64),
        ("64 MiB", MIB_64),
        ("64MB", 64_000_000),
        ("1.5G", 3 << 29),
        ("512K", 512 * 1024),
        ("4096", 4096),
        ("100B", 100),
        ("2T", 2 << 40),
    ],
)
def test_config_units(text: str, nbytes: int) -> None:
    assert parse_size(text) == nbytes, f"{text!r}: K/M/G/T are binary, KB/MB/GB/TB decimal"


@pytest.mark.parametrize("text", ["lots", "64 MiBs", "-1", "1e9", "0x40", ""])
def test_config_rejects_what_is_not_a_size(text: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_size(text, "memory.capacity_bytes")
    assert str(e.value) == (
        f"memory.capacity_bytes: {text!r} is not a size; use bytes or a number with a unit: "
        f"{ALLOWED}"
    ), "the message names the setting, the value and every allowed unit"


def test_cli_bench_size_is_binary() -> None:
    from kvstore.cli.main import build_parser

    args = build_parser().parse_args(["bench", "--size", "64M"])
    assert args.size == MIB_64, f"kvstore bench --size 64M parsed as {args.size:,} bytes"
    assert build_parser().parse_args(["bench", "--size", "64MB"]).size == 64_000_000


def test_cli_bench_bad_size_says_what_is_allowed() -> None:
    from kvstore.cli.main import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        main(["bench", "--size", "lots"])
    assert e.value.code == 2, f"exit {e.value.code}: {err.getvalue()}"
    assert (
        f"argument --size: 'lots' is not a size; use bytes or a number with a unit: {ALLOWED}"
        in (err.getvalue())
    ), err.getvalue()


def test_connector_save_buffer_is_binary() -> None:
    from kvstore.connectors.vllm_config import ConnectorConfig

    cfg = ConnectorConfig.parse({"save_buffer": "64M"})
    assert cfg.save_buffer_bytes == MIB_64, cfg.save_buffer_bytes


def test_benchmarks_read_size_labels_with_the_same_rule() -> None:
    from benchmarks import plots
    from benchmarks.harness import size_label

    assert plots.parse_size is parse_size, "the plots must read sizes with kvstore.config's rule"
    assert parse_size(size_label(MIB_64)) == MIB_64 and parse_size("64M") == MIB_64
