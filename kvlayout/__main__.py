"""``python -m kvlayout``: the command line (see :mod:`kvlayout.cli`)."""

import sys

from kvlayout.cli import main

sys.exit(main())
