"""hetcoll.lab: the laboratory beside the library.

The demo (:mod:`hetcoll.lab.demo`), emulated heterogeneity (:mod:`hetcoll.lab.emulate`), the
calibration of the performance model on this machine (:mod:`hetcoll.lab.calibrate`), its
validation against measured runs (:mod:`hetcoll.lab.validate`, with the emulated runs' own
predictions in :mod:`hetcoll.lab.predict_emulated`) and seed 002's comparison of node-wise
placement with the other splits (:mod:`hetcoll.lab.placement_compare`). Lab modules may import the
library; nothing in the library imports them (only the ``hetcoll`` command loads them, inside
the subcommands that need them). import-linter checks both directions (pyproject.toml).
"""
