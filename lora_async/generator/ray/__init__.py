"""Scale-out: generator replicas as Ray actors (`generator.type = "ray"`).

`replica.Replica` is the actor: one `VllmGenerator`, the engine code a single node runs.
`generator.RayGenerator` is the router in front of them: it routes requests (least loaded,
groups kept together, resubmits); `versions` registers every version on all of them from Ray's
object store and catches a returning replica up; `health` starts and watches the replicas.
`cluster` holds the few Ray calls: joining or starting a cluster, the placement group, creating
actors. Ray is an optional extra (`lora-async[ray]`).
"""

from .cluster import RAY_EXTRA, RayError, ray_installed, require_ray

__all__ = ["RAY_EXTRA", "RayError", "ray_installed", "require_ray"]
