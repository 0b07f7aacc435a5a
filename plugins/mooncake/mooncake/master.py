"""The ``mooncake_master`` console script: Mooncake's master flags, served by a tidekv master
(``tidekv.compat.mooncake_master``)."""

import sys

from tidekv.compat.mooncake_master import main

if __name__ == "__main__":
    sys.exit(main())
