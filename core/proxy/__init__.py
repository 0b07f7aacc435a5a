"""``tidekv proxy``: an OpenAI-compatible router for prefill/decode disaggregation (``server``)
and its routing policies (``routing``)."""

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
from tidekv.proxy.server import ProxyServer, add_parser

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
