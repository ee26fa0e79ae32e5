"""``pipemetrics prove``: every case of a bound, run and judged by the conformance suite's
properties, with a certificate.

Holds the prover (`prover`), the cases it enumerates (`cases`) and the families that enumerate
them (`families`).

May import: `pipemetrics.properties` (the catalogue, the generators, the judges) and
`pipemetrics.sim`; only `pipemetrics.commands` (and `bench`) import it.
"""
