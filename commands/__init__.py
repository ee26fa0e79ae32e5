"""pipemetrics.commands: the ``pipemetrics`` command, above `pipemetrics.properties` and
`pipemetrics.sim`.

The entry point (`cli`), each option declared once (`options`) and turned back into argv for the
processes a command starts (`argv`), and one module per command: `check`, `prove` (with
`prove_ray`), `replay`, `demo`, `bench`, `vendor`, and `torchrun` (a scenario under
``torchrun``). Nothing below this package imports it.
"""
