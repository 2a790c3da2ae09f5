"""``--distributed-executor-backend ray``: the ranks other than 0 as Ray actors.

The engine process (rank 0) joins the running Ray cluster (``RAY_ADDRESS``, else ``auto``:
the cluster ``ray start --head`` started on this node), reserves one bundle of
``CPU: 1`` per other rank in a placement group (``PACK``: on as few nodes as fit) and starts
one actor in each, which runs ``tensor_parallel.run_rank``: it joins the group over
``torch.distributed`` at this node's Ray address, loads its part and runs the steps. Ray
only places and supervises the processes; the steps travel over the group's gloo (NCCL for
CUDA) connections. Ray is not a dependency of FreeToken: ``pip install ray``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from freetoken_core.config import EngineConfig
from freetoken_core.errors import ModelLoadError


class RankActor:
    """One rank in a Ray worker process."""

    def run(self, spec: Any) -> None:
        from freetoken_core.engine.tensor_parallel import run_rank

        run_rank(spec)


@dataclass
class RayRanks:
    """Ranks 1.. as actors: their ``run`` calls end only when a rank stops; ``addr`` is
    where the group meets (this node's Ray address)."""

    actors: list[Any]
    runs: list[Any]
    placement: Any
    addr: str

    def failure(self) -> str | None:
        """The error of a rank whose ``run`` has ended (it failed to load or stopped)."""
        import ray

        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0.5)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as exc:  # noqa: BLE001 (the rank's own error, reported)
                return str(exc).strip().splitlines()[-1]
            return "a rank stopped"
        return None

    def stop(self) -> None:
        import ray

        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001,S110 (already gone)
                pass
        ray.util.remove_placement_group(self.placement)


def start_ray_ranks(config: EngineConfig, port: int) -> RayRanks:
    """Start ranks 1.. of ``config``'s group as actors in a placement group."""
    try:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError as exc:
        raise ModelLoadError("--distributed-executor-backend ray needs Ray: pip install "
                             "ray, then ray start --head (or set RAY_ADDRESS)") from exc
    from freetoken_core.engine.tensor_parallel import RankSpec

    if not ray.is_initialized():
        try:
            ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=True)
        except (ConnectionError, RuntimeError) as exc:
            raise ModelLoadError(f"cannot join a Ray cluster ({exc}); start one with "
                                 "`ray start --head` or set RAY_ADDRESS") from exc
    world = config.tensor_parallel_size
    group = placement_group([{"CPU": 1}] * (world - 1), strategy="PACK")
    if not group.wait(timeout_seconds=config.distributed_timeout):
        ray.util.remove_placement_group(group)
        raise ModelLoadError(
            f"the Ray cluster has no room for {world - 1} rank(s) of 1 CPU each within "
            f"{config.distributed_timeout:g} s ({ray.available_resources()} available)")
    addr = ray.util.get_node_ip_address()
    actor_class = ray.remote(num_cpus=1)(RankActor)
    actors, runs = [], []
    for rank in range(1, world):
        actor = actor_class.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=rank - 1)).remote()
        actors.append(actor)
        runs.append(actor.run.remote(RankSpec(config, rank, addr, port, False, None)))
    return RayRanks(actors, runs, group, addr)

