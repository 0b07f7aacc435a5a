"""``mooncake_master``'s flags (``tidekv.compat.mooncake_master``): Mooncake's master flags in
both gflags styles mapped onto ``MasterConfig``, everything else refused naming the flag. The
console script itself runs in ``test_mooncake_shim``."""

from __future__ import annotations

import pytest

from tidekv.compat.mooncake_master import FLAGS, main, master_config, parse_flags
from tidekv.config import MasterConfig
from tidekv.errors import ConfigError


def test_mooncakes_defaults_where_they_differ_from_tidekvs() -> None:
    config = master_config([], {})
    assert (config.port, config.metrics_port, config.lease_ttl_s, config.high_watermark, config.eviction_ratio,
            config.client_ttl_s) == (50051, 9003, 10.0, 0.90, 0.05, 10.0)
    assert config.host == "127.0.0.1" and config.etcd == ""
    assert master_config([], {"TIDEKV_MASTER_LEASE_TTL_S": "3"}).lease_ttl_s == 3.0  # tidekv's variable wins


def test_each_flag_in_both_gflags_styles() -> None:
    argv = ["--rpc_port=7001", "--rpc_address", "10.1.2.3", "-default_kv_lease_ttl=2500",
            "--eviction_high_watermark_ratio", "0.8", "--eviction_ratio=0.1", "-client_ttl", "20",
            "--metrics_port=7002", "--put_start_release_timeout_sec=90"]
    config = master_config(argv, {})
    assert config == MasterConfig(host="10.1.2.3", port=7001, metrics_port=7002, lease_ttl_s=2.5, high_watermark=0.8,
                                  eviction_ratio=0.1, client_ttl_s=20.0, put_timeout_s=90.0, cluster="mooncake_cluster",
                                  disk_write_through="all", disk_promote=False)
    assert master_config(["--port", "7003"], {}).port == 7003  # Mooncake's legacy spelling


@pytest.mark.parametrize(("text", "seconds"), [("10000", 10.0), ("250ms", 0.25), ("2s", 2.0), ("1m", 60.0), ("1h", 3600.0)])
def test_lease_ttl_takes_mooncakes_units(text: str, seconds: float) -> None:
    assert master_config([f"--default_kv_lease_ttl={text}"], {}).lease_ttl_s == seconds


def test_ha_through_etcd() -> None:
    config = master_config(["--enable_ha", "--etcd_endpoints=127.0.0.1:2379;127.0.0.1:2380", "--cluster_id", "c1"], {})
    assert config.etcd == "http://127.0.0.1:2379,http://127.0.0.1:2380" and config.cluster == "c1"
    config = master_config(["--enable_ha=true", "--ha_backend_type=etcd", "--ha_backend_connstring", "h:2379"], {})
    assert config.etcd == "http://h:2379" and config.cluster == "mooncake_cluster"
    assert master_config(["--noenable_ha"], {}).etcd == ""


def test_offload_flags_map_onto_the_disk_tier() -> None:
    assert master_config([], {}).disk_write_through == "all", "Mooncake persists every put eagerly by default"
    assert master_config(["--enable_offload", "--offload_on_evict"], {}).disk_write_through == "off"
    assert master_config(["--enable_offload=true", "--nooffload_on_evict"], {}).disk_write_through == "all"
    assert master_config([], {}).disk_promote is False and master_config(["--promotion_on_hit"], {}).disk_promote


@pytest.mark.parametrize(("argv", "needle"), [
    (["--rpc_thread_num=4"], "flag --rpc_thread_num is not supported"),
    (["--enable_http_metadata_server", "true"], "flag --enable_http_metadata_server is not supported"),
    (["--memory_allocator=cachelib"], "flag --memory_allocator is not supported"),
    (["--offloading_queue_limit=5"], "flag --offloading_queue_limit is not supported"),
    (["--nosuch"], "flag --nosuch is not supported"),
    (["--rpc_port"], "flag --rpc_port needs a value"),
    (["50051"], "unexpected argument '50051'"),
    (["--rpc_port=fifty"], "--rpc_port='fifty' is not an integer"),
    (["--eviction_ratio=lots"], "--eviction_ratio='lots' is not a number"),
    (["--default_kv_lease_ttl=5x"], "--default_kv_lease_ttl='5x' is not a duration"),
    (["--enable_ha=maybe"], "--enable_ha='maybe' is not a boolean"),
    (["--enable_ha"], "--enable_ha needs --etcd_endpoints"),
    (["--etcd_endpoints=h:2379"], "--etcd_endpoints is used only with --enable_ha"),
    (["--enable_ha", "--ha_backend_type=redis", "--etcd_endpoints=h:1"], "through etcd only"),
    (["--eviction_high_watermark_ratio=2"], "high_watermark=2.0 is out of range"),
])
def test_refusals_name_the_flag(argv: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        master_config(argv, {})


def test_main_exits_2_naming_the_flag_and_help_lists_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--rpc_port=1", "--max_threads", "8"]) == 2
    assert "--max_threads is not supported" in capsys.readouterr().err
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"--{name}" in out for name in FLAGS)


def test_parse_flags_keeps_the_last_of_a_repeated_flag() -> None:
    assert parse_flags(["--rpc_port=1", "--rpc_port=2"]) == {"rpc_port": 2}
