"""Reliability fuzzing: a seeded corpus of damaged media (:mod:`.corpus`), a harness that runs
every case through every public decoder in replaceable worker processes (:mod:`.harness`), and
the one-command runner (``python -m tests.fuzz.run``)."""
