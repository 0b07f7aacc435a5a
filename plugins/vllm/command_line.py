"""The ``--kv-transfer-config`` on a vLLM server's command line, checked by the plugin in the
API-server process before any model loads.

Why here and why from ``sys.argv``: vLLM 0.32 calls ``vllm.general_plugins`` entry points with no
arguments (``vllm.plugins.load_general_plugins``), the first time in the API-server process from
``AsyncEngineArgs.add_cli_args`` while it builds its argument parser, i.e. before it has parsed
``sys.argv``, and then never again in that process (a global flag). No later hook of vLLM hands a
plugin or a connector class the parsed config in that process: ``VllmConfig`` imports the
connector class there but only asks ``issubclass(cls, SupportsHMA)``, and
``requires_piecewise_for_cudagraph(extra_config)`` only runs with full CUDA graphs (never on CPU
or with ``--enforce-eager``). Left alone, a bad extra config is found by the connector itself
in the engine core, after the model has loaded. So the plugin reads the flag the way vLLM's
``FlexibleArgumentParser`` will: ``--kv-transfer-config JSON`` or ``=JSON``, underscores for
dashes, dotted keys (``--kv-transfer-config.kv_connector_extra_config.master HOST:PORT``, which
replace a JSON given as well, as in vLLM), and a ``--config`` YAML file (read with vLLM's own
reader; the command line wins over it). JSON vLLM cannot parse is left for vLLM to report.

Only server command lines are checked (``vllm serve ...``, ``python -m
vllm.entrypoints.openai.api_server ...``): an offline ``LLM(...)`` gets its config as an
argument, and its script's own arguments are none of our business. Neighbours: ``plugin``
(calls ``check_command_line`` from ``register``), ``tidekv.kvcache.settings`` (the validation
and the "did you mean").
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Collection, Sequence
from typing import Any

from tidekv.errors import ConfigError
from tidekv.kvcache.settings import KVConnectorConfig, did_you_mean

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "TidekvConnector"
CONNECTOR_MODULE = "tidekv_vllm.connector"
_FLAG = "--kv-transfer-config"


def is_server_command_line(argv: Sequence[str]) -> bool:
    """Whether ``argv`` (``sys.argv``) starts a vLLM OpenAI server."""
    if not argv:
        return False
    script = argv[0].replace(os.sep, "/")
    return (len(argv) > 1 and argv[1] == "serve") or script.endswith("vllm/entrypoints/openai/api_server.py")


def kv_transfer_config_from_argv(args: Sequence[str]) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` that vLLM will parse from ``args`` (``sys.argv[1:]``), as a
    dict; None when there is none, or it is not JSON vLLM would accept (vLLM then says why)."""
    args = _with_config_file(list(args))
    whole: Any = None
    dotted: dict[str, Any] = {}
    skip = False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if not arg.startswith("--"):
            continue
        key, has_value, value = arg.partition("=")
        name, _, path = key.partition(".")
        if name.replace("_", "-") != _FLAG:
            continue
        if not has_value:
            if i + 1 >= len(args):
                return None
            value, skip = args[i + 1], True
        if not path:
            try:
                whole = json.loads(value)
            except ValueError:
                return None
            continue
        _set_dotted(dotted, path.split("."), _dotted_value(value))
    # vLLM turns the dotted keys into one more --kv-transfer-config JSON after all the others:
    # the last one wins.
    chosen = dotted if dotted else whole
    return chosen if isinstance(chosen, dict) else None


def check_command_line(argv: Sequence[str], registered: Collection[str]) -> None:
    """Refuses a server command line whose ``--kv-transfer-config`` TidekvConnector cannot take.

    Args:
        argv: ``sys.argv``.
        registered: the KV connector names vLLM's factory knows.

    Raises:
        ConfigError: our connector with a bad ``kv_connector_extra_config`` (the same error the
            connector raises), or a connector name that is not registered but close to ours
            (the message says "did you mean 'TidekvConnector'?").
    """
    if not is_server_command_line(argv):
        return
    config = kv_transfer_config_from_argv(argv[1:])
    if config is None or not isinstance(config.get("kv_connector"), str):
        return
    name: str = config["kv_connector"]
    module = config.get("kv_connector_module_path")
    if module not in (None, CONNECTOR_MODULE):
        return  # someone else's connector
    if name == CONNECTOR_NAME:
        extra = config.get("kv_connector_extra_config")
        KVConnectorConfig.from_mapping(extra if isinstance(extra, dict) else None)
        logger.debug("--kv-transfer-config: TidekvConnector settings are valid")
        return
    hint = did_you_mean(name, [CONNECTOR_NAME])
    if module == CONNECTOR_MODULE:
        raise ConfigError(f"kv_connector {name!r} is not in {CONNECTOR_MODULE}, whose connector "
                          f"is {CONNECTOR_NAME!r}{hint}")
    if name not in registered and hint:
        raise ConfigError(f"kv_connector {name!r} is not a registered KV connector{hint}")


def _with_config_file(args: list[str]) -> list[str]:
    """``args`` with a ``--config FILE`` replaced by the file's arguments, put first (flags win)."""
    for i, arg in enumerate(args):
        path = arg.removeprefix("--config=") if arg.startswith("--config=") else (
            args[i + 1] if arg == "--config" and i + 1 < len(args) else None)
        if path is None:
            continue
        try:
            from vllm.utils.argparse_utils import FlexibleArgumentParser

            from_file = FlexibleArgumentParser().load_config_file(path)
        except Exception:  # noqa: BLE001 - a file vLLM cannot read is vLLM's to report, not ours
            return args
        rest = args[:i] + args[i + (1 if arg.startswith("--config=") else 2):]
        return from_file + rest
    return args


def _dotted_value(text: str) -> Any:
    """A dotted key's value as vLLM reads it: JSON, else a human-readable int ("8g"), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        from vllm.utils.argparse_utils import human_readable_int

        return human_readable_int(text)
    except Exception:  # noqa: BLE001 - not a number either: vLLM keeps the text
        return text


def _set_dotted(target: dict[str, Any], keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        nested = target.get(key)
        if not isinstance(nested, dict):
            nested = target[key] = {}
        target = nested
    target[keys[-1]] = value
