"""``python -m hetcoll``: the ``hetcoll`` command (the console script's entry point,
:func:`hetcoll.cli.main`)."""

import sys

from hetcoll.cli import main

sys.exit(main())
