"""One side of an SGLang PD pair (prefill or decode) using SGLang's own mooncake connector
(``MooncakeKVManager`` / ``MooncakeKVSender`` / ``MooncakeKVReceiver`` / ``MooncakeKVBootstrapServer``)
over tidekv: the test starts it with the shim (``plugins/mooncake``) on ``PYTHONPATH``, so SGLang's
``from mooncake.engine import TransferEngine`` gets ``tidekv.compat.mooncake``.

Run as ``python pd_peer.py '{"role": "prefill"|"decode", "bootstrap_port": N, "pages": P, ...}'``;
with ``"host"`` (SGLang's ``--host``, where the prefill's bootstrap server listens) the process
runs as on a machine of its own: its transfer engine starts on SGLang's ``get_local_ip_auto()``
($SGLANG_HOST_IP, else the interface that routes out), as SGLang's scheduler starts it; without,
everything is on loopback.
The KV cache is SGLang's real ``MHATokenToKVPool`` on CPU and the aux data its ``MetadataBuffers``;
the process publishes ``ServerArgs`` for its role the way SGLang's scheduler does and states its
ranks (TP 1, no DP/CP/PP), as SGLang's launcher would. Commands (one JSON line each):
prefill: ``fill`` (pages from a seed; answers digests), ``sender`` (create a sender for a room),
``send`` (wait for the decode's metadata, send pages, wait for success; answers digests);
decode: ``receive`` (create a receiver for the prefill's bootstrap server at ``bootstrap_host``,
default loopback, and ``bootstrap_port``; send its metadata), ``wait`` (until success; answers
digests). Digests are per page over every layer's K and V rows, so the bytes compare end to end.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
import traceback
from typing import Any

import sglang_rig

LAYERS, HEADS, HEAD_DIM, PAGE_SIZE = 4, 2, 64, 16


def _model_dir(path: str) -> str:
    """A model directory holding just an HF config (ServerArgs resolution reads it; no weights needed)."""
    os.makedirs(path, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HEADS * HEAD_DIM * 2,
              "num_attention_heads": HEADS * 2, "num_key_value_heads": HEADS, "head_dim": HEAD_DIM,
              "num_hidden_layers": LAYERS, "intermediate_size": 256, "vocab_size": 256,
              "max_position_embeddings": 2048, "torch_dtype": "bfloat16"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def _publish(role: str, host: str, bootstrap_port: int, model_dir: str) -> Any:
    from sglang.srt.runtime_context import get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path=_model_dir(model_dir), disaggregation_mode=role, host=host,
                             disaggregation_transfer_backend="mooncake", disaggregation_bootstrap_port=bootstrap_port,
                             device="cpu", skip_tokenizer_init=True, page_size=PAGE_SIZE)
    publish(server_args, role="scheduler")
    get_parallel().override_permanently(tp_rank=0, attn_tp_rank=0, attn_cp_rank=0, attn_dp_rank=0, pp_rank=0,
                                        dp_rank=0, moe_ep_rank=0, pp_group=None)
    return server_args


def _kv_pool(pages: int) -> Any:
    import torch

    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(pages * PAGE_SIZE, PAGE_SIZE, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu", False,
                            enable_alt_stream=False)


class Peer:
    def __init__(self, spec: dict[str, Any]) -> None:
        import torch

        from sglang.srt.disaggregation.base.conn import KVArgs
        from sglang.srt.disaggregation.mooncake import MooncakeKVBootstrapServer, MooncakeKVManager
        from sglang.srt.disaggregation.utils import (
            DisaggregationMode,
            MetadataBuffers,
            get_kv_transfer_buf_infos,
            setup_state_kv_args,
        )
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            init_mooncake_transfer_engine,
        )
        from sglang.srt.utils.network import get_local_ip_auto

        self.role = spec["role"]
        host = spec.get("host", "127.0.0.1")
        self.server_args = _publish(self.role, host, spec["bootstrap_port"], spec["model_dir"])
        self.pool = _kv_pool(spec["pages"])
        self.metadata = MetadataBuffers(8, 32, torch.float32, max_sampling_mask_tokens=1)
        self.bootstrap = MooncakeKVBootstrapServer(host, spec["bootstrap_port"]) if self.role == "prefill" else None
        engine_host = get_local_ip_auto() if "host" in spec else "127.0.0.1"
        self.te = init_mooncake_transfer_engine(hostname=engine_host, gpu_id=0, ib_device=None)
        args = KVArgs()
        args.engine_rank, args.pp_rank, args.system_dp_rank = 0, 0, 0
        args.kv_cache_dtype_str, args.kv_layout = "bfloat16", None
        args.prefill_start_layer, args.prefill_end_layer = 0, LAYERS
        args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = get_kv_transfer_buf_infos(self.pool)
        args.num_draft_entries, args.kv_layer_ids = 0, []
        args.kv_head_num, args.total_kv_head_num, args.page_size = HEADS, HEADS, PAGE_SIZE
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = self.metadata.get_buf_infos()
        args.ib_device, args.gpu_id = None, 0
        setup_state_kv_args(args, self.pool)
        mode = DisaggregationMode.PREFILL if self.role == "prefill" else DisaggregationMode.DECODE
        self.manager = MooncakeKVManager(args, mode, self.server_args, False)
        self.senders: dict[int, Any] = {}
        self.receivers: dict[int, Any] = {}

    def hello(self) -> dict[str, Any]:
        engine = self.te.engine
        return {"session": self.te.get_session_id(), "engine_class": f"{type(engine).__module__}.{type(engine).__name__}",
                "pid": os.getpid()}

    def digests(self, pages: list[int]) -> list[str]:
        out = []
        for page in pages:
            h = hashlib.sha256()
            rows = slice(page * PAGE_SIZE, (page + 1) * PAGE_SIZE)
            for layer in range(LAYERS):
                for buf in (self.pool.k_buffer[layer], self.pool.v_buffer[layer]):
                    h.update(bytes(buf[rows].contiguous().view(-1).view(__import__("torch").uint8).numpy()))
            out.append(h.hexdigest())
        return out

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        import numpy as np
        import torch

        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.mooncake import MooncakeKVReceiver, MooncakeKVSender

        op, room = cmd["cmd"], cmd.get("room")
        bootstrap_addr = f"{cmd.get('bootstrap_host', '127.0.0.1')}:{cmd.get('bootstrap_port', 0)}"
        if op == "fill":
            gen = torch.Generator().manual_seed(cmd["seed"])
            for page in cmd["pages"]:
                rows = slice(page * PAGE_SIZE, (page + 1) * PAGE_SIZE)
                for layer in range(LAYERS):
                    for buf in (self.pool.k_buffer[layer], self.pool.v_buffer[layer]):
                        buf[rows] = torch.randn(buf[rows].shape, generator=gen).to(buf.dtype)
            return {"digests": self.digests(cmd["pages"])}
        if op == "sender":
            sender = MooncakeKVSender(self.manager, bootstrap_addr, room)
            sender.init(len(cmd["pages"]), cmd["aux_index"])
            self.senders[room] = sender
            return {"poll": int(sender.poll())}
        if op == "send":
            sender = self.senders[room]
            state = _wait(sender, {KVPoll.WaitingForInput}, cmd.get("timeout_s", 30))
            if state != KVPoll.WaitingForInput:
                return {"poll": int(state), "failure": str(_failure(sender))}
            self.metadata.output_ids[cmd["aux_index"]].fill_(cmd["first_token"])
            sender.send(np.asarray(cmd["pages"], dtype=np.int32))
            state = _wait(sender, {KVPoll.Success, KVPoll.Failed}, cmd.get("timeout_s", 30))
            return {"poll": int(state), "failure": str(_failure(sender)) if state == KVPoll.Failed else None,
                    "digests": self.digests(cmd["pages"])}
        if op == "receive":
            deadline = time.monotonic() + 30
            while not self.manager.try_ensure_parallel_info(bootstrap_addr):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"prefill bootstrap server {bootstrap_addr} did not answer")
                time.sleep(0.1)
            receiver = MooncakeKVReceiver(self.manager, bootstrap_addr, room)
            receiver.init(0)
            receiver.send_metadata(np.asarray(cmd["pages"], dtype=np.int32), cmd["aux_index"])
            self.receivers[room] = receiver
            return {"poll": int(receiver.poll())}
        if op == "wait":
            receiver = self.receivers[room]
            state = _wait(receiver, {KVPoll.Success, KVPoll.Failed}, cmd.get("timeout_s", 30))
            return {"poll": int(state), "failure": str(_failure(receiver)) if state == KVPoll.Failed else None,
                    "digests": self.digests(cmd["pages"]),
                    "first_token": int(self.metadata.output_ids[cmd["aux_index"]][0])}
        raise ValueError(f"unknown command {op!r}")


def _wait(party: Any, states: set[Any], timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        state = party.poll()
        if state in states or time.monotonic() > deadline:
            return state
        time.sleep(0.01)


def _failure(party: Any) -> Any:
    try:
        party.failure_exception()
    except Exception as exc:  # noqa: BLE001 - SGLang reports failures by raising
        return exc
    return None


def main() -> int:
    spec = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    sglang_rig.stub_torchvision()
    peer = Peer(spec)
    print(json.dumps(peer.hello()), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            reply = {"ok": True, **peer.handle(cmd)}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
