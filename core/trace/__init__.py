"""FAST'25 trace tools: reading a trace (``format``), simulating prefix caches over it
(``cache``), the ``tidekv trace analyze`` report (``analyze``), synthesizing prompts from hash
ids (``prompts``), replaying it against a live deployment (``replay``) and reporting that (``replay_report``), and the command line
(``cli``). Nothing here needs an inference engine.
"""

from tidekv.trace.format import TRACE_BLOCK_TOKENS, TraceRequest, load_trace, parse_token_count

__all__ = ["TRACE_BLOCK_TOKENS", "TraceRequest", "load_trace", "parse_token_count"]
