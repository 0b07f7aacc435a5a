"""TransferConfig: validation on creation and parsing of TIDEKV_* environment variables.

Every refusal is a ConfigError whose message names the field (or variable) and the bad value.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tidekv import ConfigError, TransferConfig, TransportKind
from tidekv.config import parse_size

pytestmark = pytest.mark.timeout(30)


def test_defaults() -> None:
    c = TransferConfig()
    assert c.transport is TransportKind.AUTO
    assert (c.connections_per_peer, c.worker_threads, c.slice_size_bytes) == (4, 4, 256 << 10)
    assert (c.io_timeout_s, c.secret, c.enable_cross_memory_attach) == (30.0, None, True)


def test_config_is_frozen_and_hides_the_secret() -> None:
    c = TransferConfig(secret="hunter2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.worker_threads = 8  # type: ignore[misc]
    assert "hunter2" not in repr(c)


OUT_OF_RANGE = [
    ("connections_per_peer", 0, "1..64"),
    ("connections_per_peer", 65, "1..64"),
    ("worker_threads", 0, "1..256"),
    ("worker_threads", 257, "1..256"),
    ("slice_size_bytes", 4095, "4096.."),
    ("slice_size_bytes", (256 << 20) + 1, "4096.."),
    ("io_timeout_s", 0.0, "0.1..3600"),
    ("io_timeout_s", float("nan"), "0.1..3600"),
    ("io_timeout_s", float("inf"), "0.1..3600"),
    ("socket_buffer_bytes", -1, "0.."),
    ("max_regions", 0, "1.."),
    ("unregister_timeout_s", -0.5, "0..600"),
    ("inline_bytes", -1, "0.."),
    ("shm_parallelism", 65, "1..64"),
]


@pytest.mark.parametrize("field,value,allowed", OUT_OF_RANGE)
def test_out_of_range_values_name_field_value_and_range(field: str, value: Any, allowed: str) -> None:
    with pytest.raises(ConfigError) as info:
        TransferConfig(**{field: value})
    message = str(info.value)
    assert field in message and repr(value) in message and allowed in message, message


@pytest.mark.parametrize(
    "field,value",
    [
        ("transport", "tcp"),
        ("secret", ""),
        ("worker_threads", "4"),
        ("worker_threads", 2.5),
        ("io_timeout_s", "30"),
        ("enable_cross_memory_attach", "no"),
    ],
)
def test_wrong_types_are_config_errors(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=field):
        TransferConfig(**{field: value})


@pytest.mark.parametrize(
    "variable,raw,field,expected",
    [
        ("TIDEKV_TRANSPORT", "tcp", "transport", TransportKind.TCP),
        ("TIDEKV_TRANSPORT", " SHM ", "transport", TransportKind.SHM),
        ("TIDEKV_WORKER_THREADS", "16", "worker_threads", 16),
        ("TIDEKV_SLICE_SIZE_BYTES", "0x10000", "slice_size_bytes", 1 << 16),
        ("TIDEKV_STREAM_COPY_BYTES", "16MB", "stream_copy_bytes", 16 << 20),
        ("TIDEKV_SOCKET_BUFFER_BYTES", "2MiB", "socket_buffer_bytes", 2 << 20),
        ("TIDEKV_INLINE_BYTES", "32768", "inline_bytes", 32 << 10),
        ("TIDEKV_IO_TIMEOUT_S", "2.5", "io_timeout_s", 2.5),
        ("TIDEKV_SECRET", "s3cret", "secret", "s3cret"),
        ("TIDEKV_ENABLE_CROSS_MEMORY_ATTACH", "off", "enable_cross_memory_attach", False),
        ("TIDEKV_ENABLE_CROSS_MEMORY_ATTACH", "Yes", "enable_cross_memory_attach", True),
        ("TIDEKV_UNREGISTER_TIMEOUT_S", "0", "unregister_timeout_s", 0.0),
    ],
)
def test_from_env_parses(variable: str, raw: str, field: str, expected: Any) -> None:
    config = TransferConfig.from_env(environ={variable: raw})
    assert getattr(config, field) == expected
    assert type(getattr(config, field)) is type(expected)


@pytest.mark.parametrize(
    "variable,raw",
    [
        ("TIDEKV_TRANSPORT", "rdma"),
        ("TIDEKV_WORKER_THREADS", "four"),
        ("TIDEKV_WORKER_THREADS", "4.0"),
        ("TIDEKV_IO_TIMEOUT_S", "soon"),
        ("TIDEKV_ENABLE_CROSS_MEMORY_ATTACH", "maybe"),
        ("TIDEKV_STREAM_COPY_BYTES", "lots"),
    ],
)
def test_from_env_refuses_unparsable_values(variable: str, raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        TransferConfig.from_env(environ={variable: raw})
    assert variable in str(info.value) and repr(raw) in str(info.value), info.value


@pytest.mark.parametrize(
    "variable,raw,field",
    [
        ("TIDEKV_WORKER_THREADS", "0", "worker_threads"),
        ("TIDEKV_IO_TIMEOUT_S", "-1", "io_timeout_s"),
        ("TIDEKV_SECRET", "", "secret"),
    ],
)
def test_from_env_validates_parsed_values(variable: str, raw: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        TransferConfig.from_env(environ={variable: raw})


def test_from_env_overrides_and_unknown_settings() -> None:
    environ = {"TIDEKV_WORKER_THREADS": "8", "TIDEKV_CONNECTIONS_PER_PEER": "2", "OTHER_WORKER_THREADS": "99"}
    config = TransferConfig.from_env(environ=environ, worker_threads=3)
    assert (config.worker_threads, config.connections_per_peer) == (3, 2)
    assert TransferConfig.from_env(environ={}) == TransferConfig()
    with pytest.raises(ConfigError, match="worker_thread"):
        TransferConfig.from_env(environ={}, worker_thread=3)


def test_from_env_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDEKV_TRANSPORT", "tcp")
    monkeypatch.setenv("TIDEKV_MAX_REGIONS", "12")
    config = TransferConfig.from_env()
    assert (config.transport, config.max_regions) == (TransportKind.TCP, 12)


@pytest.mark.parametrize(("value", "expected"), [
    (4096, 4096), (0, 0), ("4096", 4096), ("4K", 4096), ("4kb", 4096), ("64KiB", 65536), ("16MB", 16 << 20),
    ("16mib", 16 << 20), (" 4gb ", 4 << 30), ("1.5G", 3 << 29), ("2T", 2 << 40), ("100b", 100),
])
def test_parse_size_takes_binary_units_however_written(value: object, expected: int) -> None:
    assert parse_size(value, "global_segment_size") == expected


@pytest.mark.parametrize("value", ["lots", "", "MB", "-1MB", "+1", "1.5.2G", "16XB", None, True, 1.5, "1e"])
def test_parse_size_refuses_non_sizes_naming_the_setting(value: object) -> None:
    with pytest.raises(ConfigError, match=r"global_segment_size=.* is not a size"):
        parse_size(value, "global_segment_size")


def test_parse_size_minimum() -> None:
    with pytest.raises(ConfigError, match="at least 1 bytes"):
        parse_size("0", "size", minimum=1)
