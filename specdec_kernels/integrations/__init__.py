"""Adapters that plug the package's ops and drafters into inference engines.

Each adapter is thin and pinned to the engine version it was tested with (engines' internals
move between releases); importing this package imports no engine.
"""
