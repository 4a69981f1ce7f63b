"""Launch through Ray: one actor per worker, placed with a placement group (extra `ray`).

Local by default (`ray.init(num_cpus=…)` on this machine); with `RAY_ADDRESS` set it
joins that cluster and spreads the bundles over its nodes. Rank 0's actor reports its
node address and a free port, which become `MASTER_ADDR`/`MASTER_PORT` of every worker;
the fault channel is the launcher's own store (`PEERFLOW_FAULT_STORE`). A worker task
that fails or an actor that dies is reported to every rank; the launcher then waits up to
`fault_timeout` for the others to exit, kills what is left and raises.

Ctrl-C (or SIGTERM) is the local launcher's graceful stop (`LauncherStopHandler`): the
first asks every rank, through the fault store, to stop at the next step boundary and the
launcher waits for the actors to finish (within `stop_grace`, then it stops them at
once); a second stops them at once.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from typing import Any

from peerflow.distributed.init import free_port
from peerflow.distributed.stop import LauncherStopHandler
from peerflow.errors import EngineNotInstalledError, RunInterruptedError, WorkerFailedError
from peerflow.launch.elastic import failure_message, stop_outcome
from peerflow.launch.entry import WorkerCommand, worker_entry
from peerflow.launch.watch import FaultStore

_PASS_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "HF_HUB_OFFLINE", "PYTHONPATH",
             "PEERFLOW_PLUGINS", "PEERFLOW_DISABLE_PLUGIN_AUTOLOAD", "OMP_NUM_THREADS")


def local_ray_auth() -> None:
    """A local Ray the launcher starts takes callers with a fresh token only.

    Ray's services (GCS, raylet, workers) listen on every interface whatever address
    they are given; with `RAY_AUTH_MODE=disabled` anyone who reached the machine could
    join as a driver and run code in it. So unless the operator chose a mode, the
    launcher starts Ray with `RAY_AUTH_MODE=token` and a random `RAY_AUTH_TOKEN` (kept if
    set), which its own actors inherit.
    """
    if "RAY_AUTH_MODE" in os.environ:
        return
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    if "ray._raylet" in sys.modules:  # Ray read its settings when imported: again
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


class RayWorker:
    """The actor body: reports where it runs, then runs `worker_entry` with an environment."""

    def node(self) -> tuple[str, str, int]:
        """`(node id, node ip, a free port on it)`."""
        import ray

        port = free_port("")
        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), ray.util.get_node_ip_address(), port

    def run(self, env: dict[str, str], args: tuple[Any, ...]) -> int:
        """Sets the torch.distributed environment, runs the worker; its exit status."""
        os.environ.update(env)
        try:
            worker_entry(*args)
        except SystemExit as exc:  # a graceful stop: the launcher reads the stop record
            return int(exc.code or 0)
        return 0


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise EngineNotInstalledError(
            "--launcher ray needs Ray, which is not installed: pip install 'peerflow[ray]'."
        ) from None
    return ray


def _start_ray(ray: Any, cluster: bool, num_cpus: int | None) -> bool:
    """Joins `RAY_ADDRESS`'s cluster, or starts a local Ray with token auth (`local_ray_auth`).

    Returns whether this call started Ray (and so must shut it down); `False` when the
    caller had already initialised it.
    """
    if ray.is_initialized():
        return False
    if cluster:
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
    else:
        local_ray_auth()
        ray.init(num_cpus=num_cpus or os.cpu_count() or 1, include_dashboard=False,
                 log_to_driver=True)
    return True


def launch_ray(command: WorkerCommand, *, nprocs: int, num_cpus: int | None = None) -> None:
    """Runs `nprocs` workers as Ray actors in one placement group.

    Raises:
        EngineNotInstalledError: Ray is not installed.
        RunInterruptedError: the run was stopped (Ctrl-C, SIGTERM; says where, and whether
            a checkpoint was written at the stop).
        WorkerFailedError: a worker failed (naming its rank, host and stage).
    """
    cluster = bool(os.environ.get("RAY_ADDRESS"))
    if cluster:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # the cluster's own setting
    ray = _import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    started = _start_ray(ray, cluster, num_cpus)
    cpus = float(ray.cluster_resources().get("CPU", 1))
    per_worker = min(1.0, cpus / nprocs)
    group = placement_group([{"CPU": per_worker}] * nprocs,
                            strategy="SPREAD" if cluster else "PACK")
    actors: list[Any] = []
    store: FaultStore | None = None
    stopper: LauncherStopHandler | None = None
    try:
        ray.get(group.ready(), timeout=max(60.0, command.fault_timeout))
        actor_cls = ray.remote(RayWorker)
        actors = [actor_cls.options(
            num_cpus=per_worker, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=i)).remote()
            for i in range(nprocs)]
        nodes = ray.get([a.node.remote() for a in actors], timeout=max(60.0, command.fault_timeout))
        master = "127.0.0.1" if not cluster else nodes[0][1]
        store = FaultStore(world_size=nprocs,
                           host="127.0.0.1" if not cluster else ray.util.get_node_ip_address())
        store.start_watching()
        stopper = LauncherStopHandler(
            store=store.store, grace=command.stop_grace,
            interrupt=lambda signum: RunInterruptedError(
                f"interrupted ({stopper.reason}); every worker was stopped at once"),
        ).install()
        passed = {k: os.environ[k] for k in _PASS_ENV if k in os.environ}
        args = command.args()
        seen: dict[str, int] = {}
        refs = {}
        for rank, (node_id, _, _) in enumerate(nodes):
            local = seen[node_id] = seen.get(node_id, -1) + 1
            env = dict(passed, RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(local),
                       MASTER_ADDR=master, MASTER_PORT=str(nodes[0][2]),
                       **store.environment)
            refs[actors[rank].run.remote(env, args)] = rank
        try:
            _wait(ray, refs, store, command.fault_timeout, command.logs_dir)
        except WorkerFailedError:
            stopped = stop_outcome(store, stopper, command.stop_grace)
            if stopped is None:
                raise
            raise stopped from None
        stopped = stop_outcome(store, stopper, command.stop_grace)
        if stopped is not None:
            raise stopped
    finally:
        if stopper is not None:
            stopper.uninstall()
        for actor in actors:
            try:
                ray.kill(actor)
            except Exception:  # already dead
                pass
        remove_placement_group(group)
        if store is not None:
            store.stop()
        if started:
            ray.shutdown()


def _wait(ray: Any, refs: dict[Any, int], store: FaultStore, fault_timeout: float,
          run_dir: str) -> None:
    pending = list(refs)
    failed: dict[int, str] = {}
    deadline = None
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        # in slices: the main thread runs the stop handler (Ctrl-C) between them
        ready, pending = ray.wait(pending, num_returns=1, timeout=min(left or 1.0, 1.0))
        if not ready and left is not None and left <= 1.0:  # survivors did not exit in time
            break
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as exc:
                rank = refs[ref]
                failed[rank] = type(exc).__name__
                if store.failure() is None:
                    store.report(rank, f"Ray reports {type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0] if str(exc) else ''}")
                deadline = deadline or time.monotonic() + fault_timeout + 10
    if failed:
        raise WorkerFailedError(failure_message(store, run_dir=run_dir) + "\n" + "\n".join(
            f"  rank {r}: {what}" for r, what in sorted(failed.items())))
