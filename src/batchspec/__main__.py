"""``python -m batchspec ...``: the ``batchspec`` command where no console script is installed."""

import sys

from batchspec.cli import main

sys.exit(main())
