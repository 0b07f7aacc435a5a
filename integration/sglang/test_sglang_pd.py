"""PD disaggregation through SGLang's own mooncake connector on tidekv.

Two processes (``pd_peer.py``), a prefill and a decode, each run SGLang's real
``MooncakeKVManager`` with ``MooncakeKVSender`` / ``MooncakeKVReceiver`` and the prefill's
``MooncakeKVBootstrapServer``, on SGLang's real ``MHATokenToKVPool`` and ``MetadataBuffers`` (CPU).
``import mooncake.engine`` resolves to the tidekv shim (``plugins/mooncake`` on
``PYTHONPATH``, as ``pip install ./plugins/mooncake`` would make it), so SGLang's
unpatched connector moves the KV pages with ``tidekv.compat.mooncake``. Pages are compared by
digest over every layer's K and V rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import sglang_rig
from tidekv.bench.ports import free_port

SHIM = sglang_rig.REPO / "plugins" / "mooncake"


@pytest.mark.parametrize("force_tcp", [False, True], ids=["mooncake", "mooncake_tcp"])
def test_sglang_mooncake_conn_moves_kv_pages_over_tidekv(tmp_path: Path, force_tcp: bool) -> None:
    port = free_port()
    env = {"PYTHONPATH": str(SHIM), "HF_HUB_OFFLINE": "1", **({"MC_FORCE_TCP": "1"} if force_tcp else {})}
    spec = {"bootstrap_port": port, "pages": 64, "model_dir": str(tmp_path / "model")}
    prefill = sglang_rig.LineChild("pd_peer.py", {**spec, "role": "prefill"}, tmp_path / "prefill.log", env=env,
                                   start_timeout_s=120)
    decode = None
    try:
        decode = sglang_rig.LineChild("pd_peer.py", {**spec, "role": "decode"}, tmp_path / "decode.log", env=env,
                                      start_timeout_s=120)
        for peer in (prefill, decode):
            assert peer.hello["engine_class"] == "tidekv.compat.mooncake.TransferEngine"
        # Two requests in flight at once, each with its own room, pages and aux slot.
        requests = [
            {"room": 2**62 + 11, "src": [3, 4, 5, 9], "dst": [40, 41, 50, 51], "aux": (0, 2), "token": 1234},
            {"room": 987654321, "src": [10, 11], "dst": [7, 8], "aux": (1, 3), "token": 77},
        ]
        sent = {r["room"]: prefill.call("fill", pages=r["src"], seed=r["room"] % 1000)["digests"] for r in requests}
        for r in requests:
            assert prefill.call("sender", room=r["room"], pages=r["src"], aux_index=r["aux"][0],
                                bootstrap_port=port)["ok"]
            assert decode.call("receive", room=r["room"], pages=r["dst"], aux_index=r["aux"][1],
                               bootstrap_port=port)["ok"]
        for r in requests:
            reply = prefill.call("send", room=r["room"], pages=r["src"], aux_index=r["aux"][0], first_token=r["token"])
            assert reply["poll"] == 4, reply  # KVPoll.Success
            got = decode.call("wait", room=r["room"], pages=r["dst"], aux_index=r["aux"][1])
            assert got["poll"] == 4, got
            assert got["digests"] == sent[r["room"]]
            assert got["first_token"] == r["token"]
        transport = "tcp" if force_tcp else "shm"
        assert f"via {transport}" in prefill.log_text()
    finally:
        prefill.stop()
        if decode is not None:
            decode.stop()
