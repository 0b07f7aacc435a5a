"""``mooncake.http_metadata_server`` and the ``mooncake_http_metadata_server`` console script,
served by ``tidekv.compat.mooncake_metadata_server``."""

import sys

from tidekv.compat.mooncake_metadata_server import KVBootstrapServer, KVPoll, main, parse_args

__all__ = ["KVBootstrapServer", "KVPoll", "main", "parse_args"]

if __name__ == "__main__":
    sys.exit(main())
