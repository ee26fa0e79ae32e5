"""pipemetrics.properties: the conformance suite over the simulator's worlds.

Hypothesis strategies that draw pipeline-parallel layouts, recorded values and calls
(`strategies` and its ``strategies_*`` pieces, `synthetic`), the property catalogue with one
judge per property ID (`catalogue`; the judges in ``judges_*``, by function), the engine that runs a property in pooled worlds and shrinks failures
(`engine`), the check's reports (`report`; the ``pipemetrics`` command itself is
`pipemetrics.commands`), and the pytest plugin that runs the same suite inside an adopter's pytest
(`plugin`, `test_conformance`).
"""
