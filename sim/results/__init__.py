"""What a run must return, and how a run is told.

Holds the oracle, an independent model of what every rank must return (`oracle`), the
plain-text picture of a world and of where each rank stood (`picture`), the one
human-readable account of a run every command shows (`summary`), and whether two runs of one
scenario agree (`differential`, the process tier against the in-process tier).

May import: every other room of `pipemetrics.sim`; nothing in `pipemetrics.sim` imports it.
"""
