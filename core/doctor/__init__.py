"""``tidekv doctor``: what a user runs when something does not work.

``report`` gathers what is true here (version, host facts, each transport's state and why, the
effective settings and their sources) and ``selftest`` moves a few MiB between two processes over
every available transport; ``cli`` prints it (or one JSON document) and sets the exit status.
"""
