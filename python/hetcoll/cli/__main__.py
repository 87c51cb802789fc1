"""``python -m hetcoll.cli``: the ``hetcoll`` command."""

import sys

from hetcoll.cli import main

sys.exit(main())
