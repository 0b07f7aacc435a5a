"""Benchmarks beyond ``tidekv bench``: real engines, other systems, probes of this host.

Run one as a module from the repo root, ``python -m benchmarks.<name>`` (the ones on real vLLM
and SGLang import the integration harness as the package ``integration``, and each other as
``benchmarks.<name>``); the others also run as ``python benchmarks/<name>.py``. Each module's
docstring says what it measures and how to run it. Neighbours: ``tidekv.bench`` (the benches of
the ``tidekv`` command), ``integration/`` (the harness these drive real engines with).
"""
