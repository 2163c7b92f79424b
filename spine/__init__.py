"""spine: a layered gRPC middleware stack collapsed into the inference process, stage by stage.

This package is the command line (`spine ...`), its client helpers and its tools. Importing
it changes nothing in the process: what a serving process sets for itself (huge pages,
threads) each entry point sets first thing (`monolith.runtime_env`).
"""
