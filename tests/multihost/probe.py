"""What ``test_rig.py`` runs inside a rig's hosts, as a script: a TCP server, a TCP client, and a
report of what the process sees of its namespaces. Each prints one JSON line on stdout.

    probe.py serve LABEL [PORT]  listen on 0.0.0.0 (port 0 unless given): prints {"port": N}, then
                                 answers every connection with LABEL and closes it
    probe.py connect HOST PORT TIMEOUT_S
                                 prints {"connected": bool, "reply": str | null, "error": str | null,
                                 "elapsed_s": float}; a server that says nothing within TIMEOUT_S
                                 of the connection leaves connected true, reply null and the
                                 read's timeout as error
    probe.py facts [IP]          prints the pid, the pids in /proc, the PID namespace, /dev/shm's
                                 names, the boot id and whether IP can be bound here

Stdlib only (it runs under ``python -I``). Neighbours: ``test_rig.py``, ``rig.py``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Any


def _say(message: dict[str, Any]) -> None:
    print(json.dumps(message), flush=True)


def serve(label: str, port: int) -> None:
    with socket.create_server(("0.0.0.0", port)) as server:
        _say({"port": server.getsockname()[1]})
        while True:
            conn, _ = server.accept()
            with conn:
                conn.sendall(label.encode() + b"\n")


def connect(host: str, port: int, timeout_s: float) -> None:
    start = time.monotonic()
    connected, reply, error = False, None, None
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            connected = True
            reply = conn.makefile().readline().strip()
    except OSError as e:
        error = f"{type(e).__name__}: {e}"
    _say({"connected": connected, "reply": reply, "error": error, "elapsed_s": time.monotonic() - start})


def facts(address: str | None) -> None:
    can_bind = None
    if address is not None:
        try:
            with socket.create_server((address, 0)):
                can_bind = True
        except OSError:
            can_bind = False
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot_id = f.read().strip()
    _say({"pid": os.getpid(),
          "pids": sorted(int(entry) for entry in os.listdir("/proc") if entry.isdigit() and _is_running(entry)),
          "pid_ns": os.readlink("/proc/self/ns/pid"),
          "shm": sorted(os.listdir("/dev/shm")),
          "boot_id": boot_id,
          "can_bind": can_bind})


def _is_running(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before, or while, it was read
        return False


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "serve":
        serve(args[0], int(args[1]) if len(args) > 1 else 0)
    elif command == "connect":
        connect(args[0], int(args[1]), float(args[2]))
    elif command == "facts":
        facts(args[0] if args else None)
    else:
        sys.exit(f"unknown probe command {command!r}")
