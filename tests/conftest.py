"""Shared test set-up: one thread per process, so several ranks share 2 cores fairly."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
