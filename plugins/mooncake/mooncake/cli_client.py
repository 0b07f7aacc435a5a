"""The ``mooncake_client`` console script: Mooncake's standing client (dummy-client mode), served
by a tidekv store client (``tidekv.compat.mooncake_client``)."""

import sys

from tidekv.compat.mooncake_client import main

if __name__ == "__main__":
    sys.exit(main())
