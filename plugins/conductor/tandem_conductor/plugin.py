"""The entry point: registers the conductor through the core's ``tandem_conductors`` hook."""

from tandem_core.plugins import hookimpl


@hookimpl
def tandem_conductors(register):
    register("tandem", "tandem_conductor.conductor:Conductor")
