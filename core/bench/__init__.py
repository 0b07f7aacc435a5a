"""The benches of ``tidekv bench`` and the rigs they share with the tests (a local etcd, free ports).

This is the tool layer: it imports the library, and nothing in the library imports it. What
both need lives below it (``tidekv.helper_process``, ``tidekv.report``).
"""
