"""pipemetrics.sim: real torch.distributed worlds laid out like a pipeline-parallel trainer.

Public API::

    from pipemetrics.sim import Scenario, Setup, WorldSpec, ModelLayout, Step, MoeCall, WorldPool

    setup = Setup(world=WorldSpec(pp=2, dp=2), layout=ModelLayout(num_layers=4, mtp_num_layers=1))
    scenario = Scenario(setup=setup, steps=[Step(records=..., calls=[MoeCall(loss_scale=0.5)])])
    with WorldPool() as pool:
        run = pool.run(scenario)          # WorldRun: outcome + what every rank did
        print(run.outcome.kind, run.outcome.message)

See docs/internals/flow.md for how a scenario flows through the simulator.
"""

from pipemetrics.sim.collectives.coordinator import Outcome
from pipemetrics.sim.model.calls import (
    BroadcastCall,
    BufferSpec,
    CallSpec,
    MoeCall,
    MtpCall,
    RoundUpCall,
    TrackNamesCall,
)
from pipemetrics.sim.model.layout import (
    EvenSplit,
    ExplicitSplit,
    FirstLastSplit,
    ModelLayout,
    Setup,
    WorldSpec,
)
from pipemetrics.sim.model.records import (
    MoeRecord,
    MtpRecord,
    RankPlace,
    StepRecords,
    TrackerSnapshot,
)
from pipemetrics.sim.model.scenario import (
    Scenario,
    ScenarioFileError,
    Step,
    load_scenario,
    save_scenario,
)
from pipemetrics.sim.worlds.pool import WorldPool
from pipemetrics.sim.worlds.world import World, WorldRun, WorldStartError

__all__ = [
    "BroadcastCall",
    "BufferSpec",
    "CallSpec",
    "EvenSplit",
    "ExplicitSplit",
    "FirstLastSplit",
    "ModelLayout",
    "MoeCall",
    "MoeRecord",
    "MtpCall",
    "MtpRecord",
    "Outcome",
    "RankPlace",
    "RoundUpCall",
    "Scenario",
    "ScenarioFileError",
    "Setup",
    "Step",
    "StepRecords",
    "TrackNamesCall",
    "TrackerSnapshot",
    "World",
    "WorldPool",
    "WorldRun",
    "WorldSpec",
    "WorldStartError",
    "load_scenario",
    "save_scenario",
]
