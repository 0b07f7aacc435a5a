"""``tidekv proxy``: an OpenAI-compatible router for prefill/decode disaggregation (``server``),
its routing policies (``routing``) and its command line (``cli``)."""

from tidekv.proxy.routing import (
    PrefixIndex,
    ProxyConfig,
    ProxyError,
    Router,
    RoutingPolicy,
    decode_request,
    normalize_url,
    prefill_request,
    prompt_text,
)
from tidekv.proxy.cli import add_parser
from tidekv.proxy.server import ProxyServer

__all__ = [
    "PrefixIndex",
    "ProxyConfig",
    "ProxyError",
    "ProxyServer",
    "Router",
    "RoutingPolicy",
    "add_parser",
    "decode_request",
    "normalize_url",
    "prefill_request",
    "prompt_text",
]
