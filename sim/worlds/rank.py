"""The rank process: one per rank of a simulated world.

Importing this module imports torch and megatron-core, so a fork server that preloads it makes
every later rank start in milliseconds. `rank_main` joins the world (gloo over a FileStore in
the world's private directory, groups from megatron's own ``initialize_model_parallel``),
reports its place, then serves tasks until told to shut down. The same `serve` loop runs under
torchrun (see `pipemetrics.commands.torchrun`).
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from types import ModuleType
from typing import Any, NoReturn, cast

import numpy
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from pipemetrics.sim.collectives.interpose import Interposer
from pipemetrics.sim.collectives.own_lines import ENDED, FATAL, OwnLines, record_exits
from pipemetrics.sim.collectives.protocol import (
    Abort,
    Call,
    CallError,
    CallReport,
    CollectiveCall,
    ComposedNames,
    Done,
    Ready,
    RunMode,
    Shutdown,
    Task,
)
from pipemetrics.sim.mcore import installed_features
from pipemetrics.sim.megatron.trackers import (
    GroupsByRole,
    apply_moe_records,
    apply_mtp_records,
    cpu_current_device,
    reset_trackers,
    snapshot,
    switch_mtp_acceptance,
)
from pipemetrics.sim.model.calls import (
    NEW_GROUP,
    BroadcastCall,
    CallSpec,
    MoeCall,
    MtpCall,
    RoundUpCall,
    ScaledCall,
    TrackNamesCall,
)
from pipemetrics.sim.model.layout import LayoutSplit, Setup, WorldSpec
from pipemetrics.sim.model.records import RankPlace
from pipemetrics.sim.model.scenario import Scenario, Step
from pipemetrics.sim.model.target import TargetLoadError, call_with_accepted, load_target
from pipemetrics.sim.model.topology import BroadcastRole
from pipemetrics.sim.model.values import describe_tensor, encode, make_tensor

WATCHDOG_PERIOD_S = 0.1


class SimAbort(BaseException):
    """Raised inside a rank's blocked collective when the controller has reached an outcome.

    A BaseException, so an implementation's ``except Exception`` cannot swallow it.
    """


def live_groups() -> dict[str, dist.ProcessGroup]:
    """Megatron's process groups of this rank, by role (the roles of `RankPlace.groups`)."""
    ps = parallel_state
    return {
        "world": dist.group.WORLD,
        "tp": ps.get_tensor_model_parallel_group(),
        "pp": ps.get_pipeline_model_parallel_group(),
        "cp": ps.get_context_parallel_group(),
        "dp": ps.get_data_parallel_group(with_context_parallel=False),
        "dp_cp": ps.get_data_parallel_group(with_context_parallel=True),
        "tp_cp": ps.get_tensor_and_context_parallel_group(),
        "tp_dp_cp": ps.get_tensor_and_data_parallel_group(with_context_parallel=True),
        "ep": ps.get_expert_model_parallel_group(),
    }


def place_of(rank: int, groups: GroupsByRole) -> RankPlace:
    ps = parallel_state
    return RankPlace(
        rank=rank,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(with_context_parallel=False),
        groups={role: tuple(dist.get_process_group_ranks(g)) for role, g in groups.items()},
    )


def join_world(spec: WorldSpec) -> dict[str, dist.ProcessGroup]:
    """Build megatron's groups on the already initialised default process group."""
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        context_parallel_size=spec.cp,
        expert_model_parallel_size=spec.ep,
        create_gloo_process_groups=False,
    )
    return live_groups()


class RankServer:
    """Serves tasks for one rank over a connection to the controller."""

    def __init__(
        self,
        rank: int,
        conn: Connection | None,
        groups: dict[str, dist.ProcessGroup],
        interposer: Interposer | None = None,
        own_lines: OwnLines | None = None,
    ) -> None:
        """``interposer``: the in-process tier passes its own (see `pipemetrics.sim.worlds.inprocess`);
        by default collectives are gated through ``conn``. ``own_lines``: the process's (the
        in-process tier's ranks share their host's); by default one of this rank's own."""
        self.rank = rank
        self.conn = conn
        self.groups = groups
        self.place = place_of(rank, groups)
        self.interposer = interposer or Interposer(rank, self._gate)
        self.own_lines = own_lines or OwnLines()
        self.interposer.own_lines = self.own_lines
        self.new_groups: dict[tuple[int, ...], Any] = {}
        """The current task's ``new_group`` groups by members (a non-member holds torch's
        ``GroupMember.NON_GROUP_MEMBER``); destroyed when the task ends."""

    def _gate(self, call: CollectiveCall) -> None:
        assert self.conn is not None, "a gated task needs a controller connection"
        self.conn.send(Call(call=call))
        reply = self.conn.recv()
        if isinstance(reply, Abort):
            raise SimAbort(reply.reason)

    def serve(self) -> bool:
        """Serve until `Shutdown` (returns True) or until the controller vanishes (False)."""
        assert self.conn is not None
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                return False
            if isinstance(message, Shutdown):
                return True
            if isinstance(message, Task):
                self.conn.send(self.run(message))

    def run(self, task: Task, scenario: Scenario | None = None) -> Done:
        """Run ``task`` (``scenario``: the task's, already parsed)."""
        if self.interposer.exchange is None:
            self.interposer.gate = self._gate if task.mode is RunMode.GATED else None
        try:
            return self._run(task, scenario)
        finally:
            self._destroy_new_groups()

    def load(self, target: str) -> ModuleType:
        """The target's module, executed afresh for this task."""
        return load_target(target)

    def _run(self, task: Task, parsed: Scenario | None) -> Done:
        reports: list[CallReport] = []
        try:
            scenario = parsed or Scenario.model_validate_json(task.scenario_json)
            reset_trackers()
            self._create_new_groups(scenario)
            try:
                target = self.load(scenario.target)
            except TargetLoadError as exc:
                return Done(rank=self.rank, reports=[], load_error=_error(exc))
            self.own_lines.follow(target)
            with megatron_pipeline_layout(scenario.setup, self.place.pp_rank):
                fill = self._filler(scenario)
                totals: dict[str, Any] = {}
                for step_index, step in enumerate(scenario.steps):
                    fill(step_index, step)
                    for call_index, spec in enumerate(step.calls):
                        if isinstance(spec, BroadcastCall) and self._broadcast_role(spec) is None:
                            continue  # outside every broadcasting group: this rank does not call
                        report = self._invoke(
                            target, scenario, spec, step_index, call_index, totals
                        )
                        reports.append(report)
                        if report.error is not None:
                            return Done(rank=self.rank, reports=reports)
        except SimAbort:
            return Done(rank=self.rank, reports=reports, aborted=True)
        except BaseException as exc:  # a harness fault must reach the controller, not kill us
            return Done(rank=self.rank, reports=reports, harness_error=_error(exc))
        return Done(rank=self.rank, reports=reports)

    def _filler(self, scenario: Scenario) -> Callable[[int, Step], None]:
        setup = scenario.setup
        if scenario.mode == "router":
            from pipemetrics.sim.megatron.router_fill import RouterStage

            with cpu_current_device():
                stage = RouterStage(setup, self.place.pp_rank, scenario.seed)

            def fill_routers(step_index: int, step: Step) -> None:
                with cpu_current_device():
                    switch_mtp_acceptance(setup.layout.mtp_acceptance)
                    for microbatch in range(setup.layout.microbatches):
                        stage.forward_microbatch(microbatch, step_index)
                        stage.record_mtp(microbatch, step_index)
                    stage.finish_step()

            return fill_routers

        def fill_records(step_index: int, step: Step) -> None:
            if step.records is None:
                return
            with cpu_current_device():
                switch_mtp_acceptance(setup.layout.mtp_acceptance)
                apply_moe_records(step.records.moe.get(self.rank, []), self.groups)
                apply_mtp_records(step.records.mtp.get(self.rank, []), self.groups)

        return fill_records

    def _invoke(
        self,
        target: ModuleType,
        scenario: Scenario,
        spec: CallSpec,
        step: int,
        index: int,
        totals: dict[str, Any],
    ) -> CallReport:
        if isinstance(spec, ScaledCall | BroadcastCall):
            spec = cast(CallSpec, spec.for_rank(self.rank))
        composed: ComposedNames | None = None
        if isinstance(spec, MoeCall) and spec.composed:
            composed = composed_names(target, scenario, spec)
            spec = spec.model_copy(update={"track_names": composed.passed})
        before = snapshot()
        function = getattr(target, spec.function, None)
        base = CallReport(
            step=step, call=index, function=spec.function, snapshot=before, composed=composed
        )
        if not callable(function):
            return base.model_copy(
                update={
                    "error": CallError(
                        type="AbsentFunction",
                        message=f"the target does not define {spec.function}",
                        traceback="",
                    )
                }
            )
        arguments = self._arguments(scenario.setup, spec, totals)
        sent = (
            describe_tensor(arguments["tensor"])
            if isinstance(spec, BroadcastCall)
            and arguments["src_rank"] == self.rank
            and arguments["tensor"] is not None
            else None
        )
        begin = time.monotonic()
        value: Any = None
        error: CallError | None = None
        returned_from: str | None = None
        with self.interposer.active() as calls, cpu_current_device():
            try:
                value, returned_from = self.own_lines.returning(
                    lambda: self._call(function, spec, arguments)
                )
            except SimAbort:
                raise
            except BaseException as exc:  # the target's fault, reported as such
                error = _error(exc, self.own_lines.raised_at(exc.__traceback__))
        return base.model_copy(
            update={
                "value": encode(value, buffer=arguments.get("tensor")),
                "error": error,
                "seconds": time.monotonic() - begin,
                "collectives": list(calls),
                "total_loss_dict": (
                    {k: float(torch.as_tensor(v).double().item()) for k, v in totals.items()}
                    if isinstance(spec, MoeCall) and spec.use_total_loss_dict
                    else None
                ),
                "buffer": (
                    encode(arguments["tensor"])
                    if isinstance(spec, BroadcastCall) and self.rank in spec.buffers
                    else None
                ),
                "sent": sent,
                "returned_from": returned_from,
            }
        )

    def _arguments(self, setup: Setup, spec: CallSpec, totals: dict[str, Any]) -> dict[str, Any]:
        if isinstance(spec, MoeCall):
            kwargs: dict[str, Any] = {
                "loss_scale": loss_scale_argument(spec, setup),
                "per_layer_logging": spec.per_layer_logging,
                "num_layers": spec.num_layers,
                "mtp_num_layers": spec.mtp_num_layers,
                "track_names": list(spec.track_names) if spec.track_names is not None else None,
            }
            if spec.use_total_loss_dict:
                kwargs["total_loss_dict"] = totals
            if spec.num_moe_layers is not None:
                kwargs["num_moe_layers"] = spec.num_moe_layers
            return kwargs
        if isinstance(spec, MtpCall):
            if spec.loss_scale_form == "default":
                return {}
            return {"loss_scale": loss_scale_argument(spec, setup)}
        if isinstance(spec, BroadcastCall):
            return self._broadcast_arguments(spec)
        if isinstance(spec, TrackNamesCall):
            from pipemetrics.sim.megatron.router_fill import build_transformer_config, config_object

            config = spec.config
            return {
                "model_config": build_transformer_config(setup)
                if config is None
                else config_object(setup, config)
            }
        return {"value": spec.value, "multiple": spec.multiple}

    # -- broadcast groups ---------------------------------------------------------------------

    def _create_new_groups(self, scenario: Scenario) -> None:
        """Create the task's ``new_group`` groups, before any call: every rank of the world
        creates every one (torch requires it, even of non-members), in the same order (first
        appearance in the scenario), so that their names agree across ranks."""
        for step in scenario.steps:
            for spec in step.calls:
                if isinstance(spec, BroadcastCall) and spec.group == NEW_GROUP:
                    assert spec.members is not None
                    members = tuple(spec.members)
                    if members not in self.new_groups:
                        self.new_groups[members] = dist.new_group(ranks=list(members))
        # gloo connects a new group's pairs as it creates it; a member that raced ahead and
        # destroyed the group (its call failing at once) closed a pair its peer was still
        # connecting ("connectFullMesh failed ... Connection closed by peer"). A barrier of
        # the members, outside the interposer, ends creation together.
        for members, group in self.new_groups.items():
            if self.rank in members:
                dist.barrier(group=group)

    def _destroy_new_groups(self) -> None:
        """Destroy the task's new groups (local: no collective), so none outlives its task."""
        groups, self.new_groups = self.new_groups, {}
        for group in groups.values():
            dist.destroy_process_group(group)

    def _broadcast_role(self, spec: BroadcastCall) -> BroadcastRole | None:
        """This rank's group and its source for ``spec``; None when this rank does not call."""
        members = spec.group_of(self.place.groups)
        source = spec.source_in(members)
        if self.rank not in members or source is None:
            return None
        return BroadcastRole(members, source)

    def _broadcast_arguments(self, spec: BroadcastCall) -> dict[str, Any]:
        role = self._broadcast_role(spec)
        assert role is not None, "only a rank of a broadcasting group calls"
        group = (
            self.new_groups[role.members] if spec.group == NEW_GROUP else self.groups[spec.group]
        )
        tensor: torch.Tensor | None = None
        if self.rank == role.source:
            if not spec.source_passes_none:
                seed = spec.fill_seed_for(role.source)
                tensor = make_tensor(
                    spec.shape, spec.dtype, seed, spec.non_contiguous, spec.strided
                )
        elif self.rank in spec.buffers:
            buf = spec.buffers[self.rank]
            device = "cpu" if buf.device == "default" else buf.device
            tensor = torch.zeros(buf.shape, dtype=getattr(torch, buf.dtype), device=device)
        return {"tensor": tensor, "src_rank": role.source, "group": group}

    @staticmethod
    def _call(function: Callable[..., Any], spec: CallSpec, arguments: dict[str, Any]) -> Any:
        if isinstance(spec, MoeCall | MtpCall):
            return call_with_accepted(function, **arguments)
        if isinstance(spec, BroadcastCall):
            return function(arguments["tensor"], arguments["src_rank"], arguments["group"])
        if isinstance(spec, TrackNamesCall):
            return function(arguments["model_config"])
        assert isinstance(spec, RoundUpCall)
        return function(arguments["value"], arguments["multiple"])


def composed_names(target: ModuleType, scenario: Scenario, spec: MoeCall) -> ComposedNames:
    """The ``track_names`` a trainer wires into ``get_moe_metrics``: the target's own
    ``get_aux_loss_track_names`` for the layout's TransformerConfig (the config the routers run
    with), or, where that form cannot be made (`ComposedStatus`), the router's names the call
    holds. Deterministic: every rank of a world derives the same."""
    fallback = list(spec.track_names) if spec.track_names is not None else None
    function = getattr(target, "get_aux_loss_track_names", None)
    if not callable(function):
        return ComposedNames(status="absent", passed=fallback)
    from pipemetrics.sim.megatron.router_fill import build_transformer_config

    with cpu_current_device():
        config = build_transformer_config(scenario.setup)
    try:
        returned = function(config)
    except Exception as exc:  # the names property judges the function itself
        return ComposedNames(status="raised", passed=fallback, note=f"{type(exc).__name__}: {exc}")
    if not isinstance(returned, list) or not all(isinstance(n, str) for n in returned):
        return ComposedNames(status="raised", passed=fallback, note=f"returned {returned!r}"[:200])
    names = list(returned)
    mirrored = set(names) == set(fallback or [])
    if scenario.profile != "strict" and not mirrored:
        return ComposedNames(status="not_mirrored", returned=names, passed=fallback)
    return ComposedNames(status="composed", returned=names, passed=list(names))


@contextmanager
def megatron_pipeline_layout(setup: Setup, pp_rank: int) -> Iterator[None]:
    """Megatron's virtual pipeline state for the scenario, restored afterwards.

    With virtual stages (``setup.vpp > 1``) ``parallel_state`` holds what
    ``initialize_model_parallel(virtual_pipeline_model_parallel_size=vpp)`` sets: the virtual
    world size ``vpp`` and the virtual rank 0 (megatron-core 0.19 never moves it: its schedules
    pass ``vp_stage`` explicitly). For a flexible layout, the decoder layers ``setup`` says this
    rank holds are held to what megatron-core's own ``PipelineParallelLayerLayout.
    get_layer_id_list`` gives (the controller computes them without megatron:
    `pipemetrics.sim.model.pipeline_layout`); a disagreement is a harness fault, raised before
    anything is recorded.
    """
    names = ("_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK")
    before = [getattr(parallel_state, name) for name in names]
    try:
        if setup.vpp > 1:
            for name, value in zip(names, (setup.vpp, 0), strict=True):
                setattr(parallel_state, name, value)
        _check_layers_with_megatron(setup, pp_rank)
        yield
    finally:
        for name, value in zip(names, before, strict=True):
            setattr(parallel_state, name, value)


def _check_layers_with_megatron(setup: Setup, pp_rank: int) -> None:
    split = setup.layout.split
    if not isinstance(split, LayoutSplit):
        return
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    layout = PipelineParallelLayerLayout(split.layout, setup.world.pp)
    # 0.13 validates without mtp_num_layers (and refuses MTP in a layout); before 0.15 the
    # layer list reads the pipeline rank from parallel_state, which is this rank's pp_rank
    features = installed_features()
    if features.layout_takes_mtp:
        layout.validate_layer_layout(setup.layout.num_layers, setup.layout.mtp_num_layers)
    else:
        layout.validate_layer_layout(setup.layout.num_layers)
    rank_arg = (pp_rank,) if features.layout_ids_take_pp_rank else ()
    megatron = [
        tuple(n + 1 for n in layout.get_layer_id_list(LayerType.decoder, v, *rank_arg))
        for v in range(layout.virtual_pipeline_model_parallel_size)
    ]
    ours = setup.stage_chunks[pp_rank]
    if megatron != ours:
        raise RuntimeError(
            f"pipeline rank {pp_rank}: megatron-core's layout {split.layout!r} gives decoder "
            f"layers {megatron} per chunk, pipemetrics computed {ours}"
        )


def loss_scale_argument(spec: MoeCall | MtpCall, setup: Setup) -> Any:
    """``spec.loss_scale`` as the object of ``spec.loss_scale_form``: a Python float, a numpy
    scalar, or a 0-d tensor on the device a trainer's tensors live on (CUDA under NCCL)."""
    form = spec.loss_scale_form
    if form == "float":
        return float(spec.loss_scale)
    kind, _, dtype = form.partition(".")
    if kind == "numpy":
        return getattr(numpy, dtype)(spec.loss_scale)
    if kind == "tensor":
        device = "cuda" if setup.world.backend == "nccl" else "cpu"
        return torch.tensor(spec.loss_scale, dtype=getattr(torch, dtype), device=device)
    raise ValueError(f"loss_scale_form {form!r} has no argument")


def _error(exc: BaseException, target_site: str | None = None) -> CallError:
    return CallError(
        type=type(exc).__name__,
        message=str(exc)[:4000],
        traceback="".join(traceback.format_exception(exc))[-8000:],
        target_site=target_site,
    )


# -- process plumbing ----------------------------------------------------------------------------


def _controller_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def orphaned_exit(leftovers: list[str]) -> NoReturn:
    """Remove what the vanished controller can no longer remove, and exit."""
    for directory in leftovers:
        shutil.rmtree(directory, ignore_errors=True)
    os._exit(70)


def _exit_if_orphaned(controller_pid: int, leftovers: list[str]) -> None:
    if not _controller_alive(controller_pid):
        orphaned_exit(leftovers)


def _die_with(controller_pid: int, leftovers: list[str]) -> None:
    """Never outlive the controller: a watchdog thread polls it, and when it is gone (even
    killed with SIGKILL) removes the directories it can no longer remove and exits."""

    def watch() -> None:
        while True:
            time.sleep(WATCHDOG_PERIOD_S)
            _exit_if_orphaned(controller_pid, leftovers)

    threading.Thread(target=watch, name="pipemetrics-watchdog", daemon=True).start()


def _redirect_output(directory: str, name: str) -> Any:
    """Send this process's stdout/stderr to ``name.log`` in the world directory, and its stack
    dumps (SIGUSR1) to ``name.stacks``."""
    out = os.open(os.path.join(directory, f"{name}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    stacks = open(os.path.join(directory, f"{name}.stacks"), "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    # a fatal signal's traceback: where a crashed rank was (`own_lines.death_line`), at no cost
    # until the signal comes (kept open for the process's life, as faulthandler needs)
    fatal = open(os.path.join(directory, f"{name}{FATAL}"), "w")  # noqa: SIM115
    faulthandler.enable(file=fatal, all_threads=False)
    return stacks


def run_child(
    directory: str,
    name: str,
    controller_pid: int,
    leftovers: list[str],
    body: Callable[[], None],
) -> None:
    """What every child process of a world runs around its ``body`` (a rank, or the in-process
    tier's host): SIGINT ignored (the controller handles Ctrl-C), a watchdog that ends it with
    its controller, its output and stack dumps in ``name.log``/``name.stacks`` of the world
    directory, one torch thread; a body that raises is logged; it never returns (``os._exit``
    skips interpreter teardown: a target may have left non-daemon threads or wedged groups).

    ``leftovers``: directories to remove should the controller die without cleaning up (the
    world directory and the fork server's socket directory).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with(controller_pid, leftovers)
    try:
        stacks = _redirect_output(directory, name)
    except OSError:  # the controller gave up on this world while it was starting
        os._exit(1)
    torch.set_num_threads(1)
    code = 0
    try:
        body()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        stacks.close()
        _exit_if_orphaned(controller_pid, leftovers)
    os._exit(code)


def rank_main(
    rank: int,
    spec_json: str,
    directory: str,
    conn: Connection,
    controller_pid: int,
    leftovers: list[str],
) -> None:
    """Entry point of a rank process started by `pipemetrics.sim.worlds.world.World`."""
    began = time.monotonic()

    def serve() -> None:
        spec = WorldSpec.model_validate_json(spec_json)
        store = dist.FileStore(  # type: ignore[attr-defined]
            os.path.join(directory, "store"), spec.world_size
        )
        dist.init_process_group(
            spec.backend,
            store=store,
            rank=rank,
            world_size=spec.world_size,
            timeout=datetime.timedelta(minutes=10),
        )
        server = RankServer(rank, conn, join_world(spec))
        record_exits(server.own_lines, os.path.join(directory, f"rank{rank}{ENDED}"), lambda: rank)
        conn.send(Ready(place=server.place, pid=os.getpid(), startup_s=time.monotonic() - began))
        if not server.serve():
            orphaned_exit(leftovers)

    run_child(directory, f"rank{rank}", controller_pid, leftovers, serve)
