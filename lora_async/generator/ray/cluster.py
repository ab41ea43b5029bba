"""Ray itself: joining or starting a cluster, the replicas' placement group, creating the actors.

Everything else in `generator/ray/` goes through these few functions, so the Ray API the project
depends on is in one place.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Any

from ...errors import RunError

RAY_EXTRA = "pip install 'lora-async[ray]'"
PLACEMENT_TIMEOUT_S = 120.0  # how long to wait for the cluster to have room for every bundle


class RayError(RunError):
    """Ray is missing, unreachable, or cannot place the replicas (one line for the user)."""


def ray_installed() -> bool:
    return importlib.util.find_spec("ray") is not None


def require_ray() -> None:
    """Ray imports here (a missing or broken install fails in one line, before any model loads)."""
    try:
        import ray  # noqa: F401
    except Exception as exc:
        why = "is not installed" if not ray_installed() else f"does not import ({type(exc).__name__}: {exc})"
        raise RayError(f'generator.type = "ray" needs Ray, which {why}: {RAY_EXTRA}') from None


@dataclass
class Cluster:
    """A connection to Ray and the placement group holding one bundle per replica."""

    connected_here: bool  # this run called ray.init: it disconnects (and stops a local Ray it started)
    group: Any
    use_gpu: bool
    cpus_per_replica: int

    def bundle_strategy(self, index: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index)

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.group)
        except Exception as exc:  # the cluster may be gone already
            logging.getLogger(__name__).debug("placement group: %s", exc)
        if self.connected_here:
            ray.shutdown()


def connect(address: str | None, namespace: str, object_store_gb: float | None, replicas: int, device: str,
            cpus_per_replica: int, strategy: str) -> Cluster:
    """Join the cluster at `address` (None: start a local Ray sized for the replicas), and
    reserve one bundle per replica: a GPU and a core each, or `cpus_per_replica` cores."""
    require_ray()
    import ray
    from ray.util.placement_group import placement_group

    connected_here = False
    if not ray.is_initialized():
        # Ray's own start-up warnings are hidden; the replicas' errors still reach this console.
        kwargs: dict[str, Any] = dict(namespace=namespace, include_dashboard=False, logging_level=logging.ERROR,
                                      configure_logging=True, log_to_driver=True)
        if address is None:  # "local": a new Ray even where `ray start` left one running (None would join it)
            kwargs["address"] = "local"
            kwargs["num_cpus"] = max(replicas * cpus_per_replica, len(os.sched_getaffinity(0)))
            if object_store_gb:
                kwargs["object_store_memory"] = int(object_store_gb * (1 << 30))
        else:
            kwargs["address"] = address
        try:
            ray.init(**kwargs)
        except Exception as exc:
            where = "a local Ray" if address is None else f"the Ray cluster at {address!r} (ray.address)"
            raise RayError(f"could not start or join {where}: {exc}") from exc
        connected_here = True
    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0))
    use_gpu = device == "gpu" or (device == "auto" and gpus >= replicas)
    if use_gpu and gpus < replicas:
        _stop(connected_here)
        raise RayError(f"generator.replicas = {replicas} with generator.device = 'gpu' needs {replicas} GPUs; "
                       f"the cluster has {gpus}")
    bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": cpus_per_replica}
    cpus = int(resources.get("CPU", 0))
    need = replicas * bundle["CPU"]
    if need > cpus:
        _stop(connected_here)
        raise RayError(f"generator.replicas = {replicas} x {bundle['CPU']} CPU needs {need} CPUs; the cluster has "
                       f"{cpus} (lower generator.replicas or generator.cpus_per_replica, or add nodes)")
    group = placement_group([dict(bundle) for _ in range(replicas)], strategy=strategy,
                            name=f"lora-async-{os.getpid()}")
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except Exception as exc:
        _stop(connected_here)
        raise RayError(f"Ray could not place {replicas} bundles of {bundle} ({strategy}) within "
                       f"{PLACEMENT_TIMEOUT_S:.0f} s: {exc}") from exc
    return Cluster(connected_here, group, use_gpu, bundle["CPU"])


def create_replica(cluster: Cluster, actor_class: type, index: int, max_restarts: int, *args: Any) -> Any:
    """One replica actor in bundle `index`; Ray restarts it up to `max_restarts` times."""
    import ray

    remote = ray.remote(actor_class)
    options: dict[str, Any] = dict(num_cpus=cluster.cpus_per_replica, num_gpus=1 if cluster.use_gpu else 0,
                                   max_restarts=max_restarts, max_task_retries=0, max_concurrency=4096,
                                   scheduling_strategy=cluster.bundle_strategy(index),
                                   name=f"lora-async-replica-{os.getpid()}-{index}")
    return remote.options(**options).remote(*args)


def actor_errors() -> tuple[type[BaseException], ...]:
    """What a call to a dead, restarting or unreachable actor raises."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError

    return (RayActorError, ActorDiedError, ActorUnavailableError, GetTimeoutError)


def _stop(connected_here: bool) -> None:
    import ray

    if connected_here:
        ray.shutdown()
