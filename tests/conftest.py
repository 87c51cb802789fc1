"""Shared test set-up: one thread per process, so several ranks share 2 cores fairly; and the
reaper, which kills the processes a failed (timed-out) test left running."""

import os

from reaper import pytest_runtest_makereport, pytest_sessionfinish

__all__ = ["pytest_runtest_makereport", "pytest_sessionfinish"]

os.environ.setdefault("OMP_NUM_THREADS", "1")
