"""``python -m tidekv`` runs the CLI."""

import sys

from tidekv.cli import main

sys.exit(main())
