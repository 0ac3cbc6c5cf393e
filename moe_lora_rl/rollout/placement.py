"""Where the rollout engine runs (pure): on rank 0's host (the default; shared-memory refit) or on another node of
a slurm allocation (started with `srun --overlap` on that node, reached over HTTP), optionally on given GPUs.

    placement = plan_placement(node=cfg.rollout.node, gpus=cfg.rollout.gpus, this_host=socket.gethostname())
    placements = plan_placements(2, nodes=["n1", "n2"], gpus=[0, 1], this_host=...)   # engine replicas
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Placement:
    launcher: tuple[str, ...] = ()          # prefix of the engine's command line
    bind_host: str = "127.0.0.1"            # the engine server's listening address
    connect_host: str = "127.0.0.1"         # where the driver reaches it
    env: dict = field(default_factory=dict)
    transport: str = "shm"                  # shm: same host; http: across hosts
    watch_parent: bool = True               # the engine exits when the driver's process is gone (same host only)


def plan_placement(*, node: str | None, gpus: list | tuple, this_host: str) -> Placement:
    devices = [int(g) for g in gpus]
    if any(d < 0 for d in devices) or len(set(devices)) != len(devices):
        raise ValueError(f"rollout.gpus={list(gpus)}: device ids must be distinct and >= 0")
    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, devices))} if devices else {}
    if node is None or node in ("", this_host, "localhost"):
        return Placement(env=env)
    if not all(c.isalnum() or c in "-._" for c in node):
        raise ValueError(f"rollout.node={node!r} is not a host name")
    # --gpus-per-node, not --gpus: inside a job submitted with --gpus-per-node=G the step inherits G a node
    # (SLURM_GPUS_PER_NODE), which a --gpus=R request does not override: the engine would hold all G GPUs. 0 asks for
    # none (a CPU engine; on a CPU-only partition slurm refuses any GPU request).
    launcher = ("srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}", f"--gpus-per-node={len(devices)}")
    return Placement(launcher=launcher, bind_host="0.0.0.0", connect_host=node, env=env, transport="http",
                     watch_parent=False)


def plan_placements(n: int, *, nodes, gpus: list | tuple, this_host: str) -> list[Placement]:
    """Where each of n engine replicas runs: engine i on nodes[i % len(nodes)] (nodes: None or one host for all,
    or a list), each node's gpus split evenly between the engines placed on it (none: the engines share the
    host's devices). Ports are chosen per engine, so replicas may share a host."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"rollout.engines={n!r} must be an integer >= 1")
    hosts = [None] if nodes is None or isinstance(nodes, str) and nodes == "" else \
        [nodes] if isinstance(nodes, str) else list(nodes)
    if not hosts:
        raise ValueError("rollout.node=[]: name at least one host, or null for rank 0's host")
    on = [hosts[i % len(hosts)] for i in range(n)]
    devices = list(gpus)
    out = []
    for i, host in enumerate(on):
        peers = [j for j, h in enumerate(on) if h == host]
        mine: list = []
        if devices:
            if len(devices) % len(peers):
                raise ValueError(f"rollout.gpus={devices}: {len(devices)} devices do not split evenly over the "
                                 f"{len(peers)} engines on host {host or this_host!r} (rollout.engines={n})")
            k = len(devices) // len(peers)
            at = peers.index(i)
            mine = devices[at * k:(at + 1) * k]
        out.append(plan_placement(node=host, gpus=mine, this_host=this_host))
    return out
