"""An alpha-beta model of the collectives PyTorch's engines issue, with figures per interconnect.

Ring algorithms (Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication
Operations in MPICH", IJHPCA 2005; NCCL's default for large messages), over a group of ``p``
ranks, for a message of ``n`` bytes:

* all-gather (``n`` = the gathered output) and reduce-scatter (``n`` = the input):
  ``p - 1`` steps, each rank moves ``(p - 1) / p * n`` bytes;
* all-reduce: ``2 (p - 1)`` steps, ``2 (p - 1) / p * n`` bytes;
* send/recv: 1 step, ``n`` bytes.

``seconds = base + steps_inside_nodes * alpha_intra + steps_across_nodes * alpha_inter +
bytes / bandwidth``. The split of the steps and the per-collective ``base`` follow NCCL's own
tuning model (``src/graph/tuning.cc``, ``ncclTopoTuneModel``: ring latency
``baseLat + (nsteps - nInterSteps) * intraLat + nInterSteps * interLat`` with
``nInterSteps = 2 (nodes - 1)`` for all-reduce, ``nodes - 1`` for all-gather/reduce-scatter).

Bandwidth of a group that spans nodes: every link of a ring carries the same bytes, so the
slowest hop sets the rate. A node's network is shared by the groups that run the same
collective at the same time (a data-parallel all-reduce in a 2-way tensor-parallel layout runs
two groups per node side by side), so a group gets ``node network bytes/s / concurrent groups
per node``, never more than the link inside the node.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .devices import PCIE_PRACTICAL_BYTES_PER_S

__all__ = ["Link", "LINKS", "NETWORKS", "Group", "Cluster", "collective_seconds", "load_link"]

GB = 10**9
US = 1e-6
Op = Literal["all_gather", "reduce_scatter", "all_reduce", "send_recv"]

# "Practical" bandwidth is 80% of the line rate throughout, the factor devices.py applies to a
# pinned PCIe copy (NVIDIA's bandwidthTest); nccl-tests' bus bandwidths are in that range.
_PRACTICAL = 0.8


@dataclass(frozen=True)
class Link:
    """Figures of one kind of link (SI units).

    Attributes:
        name: the ``--interconnect`` key.
        bytes_per_s: bandwidth one rank gets in one direction (``scope="gpu"``), or that a whole
            node's network gets, shared by its GPUs (``scope="node"``).
        alpha_s: latency of one ring step over this link, seconds.
        base_s: fixed cost of launching one collective, seconds.
        scope: ``"gpu"`` (one such link per GPU) or ``"node"`` (one per node).
        network: whether it joins nodes (InfiniBand, Ethernet) rather than GPUs in one node.
        source: where the figures come from.
    """

    name: str
    bytes_per_s: float
    alpha_s: float
    base_s: float = 0.0
    scope: Literal["gpu", "node"] = "gpu"
    network: bool = False
    source: str = ""


# NCCL src/graph/tuning.cc, ring with the Simple protocol (the one large messages use):
# baseLat 8.4 us per collective; hwLat per step NVLink 3.4 us, PCI 5.7 us, NET 9.6 us.
_NCCL_BASE = 8.4 * US

DEFAULT_LINK = "pcie"
"""The link assumed between the ranks when the ``interconnect`` option is unset: the slower of the
links inside one node in :data:`LINKS` (a conservative default)."""

LINKS: dict[str, Link] = {
    # NVIDIA H100 SXM datasheet: NVLink 4, 900 GB/s per GPU both directions = 450 GB/s each way;
    # 80% practical (nccl-tests report 460-480 GB/s all-reduce bus bandwidth on 8xH100 with
    # NVLink SHARP, so this is on the safe side).
    "nvlink": Link(
        "nvlink",
        450 * GB * _PRACTICAL,
        3.4 * US,
        _NCCL_BASE,
        source="H100 SXM datasheet (NVLink 4, 450 GB/s each way) x 0.8; NCCL tuning.cc latencies",
    ),
    # PCIe Gen4 x16 between GPUs (no NVLink): the practical pinned-copy rate of devices.py
    # (NVIDIA bandwidthTest, ~80% of 31.5 GB/s raw).
    "pcie": Link(
        "pcie",
        PCIE_PRACTICAL_BYTES_PER_S[4],
        5.7 * US,
        _NCCL_BASE,
        source="PCIe Gen4 x16 practical 25 GB/s (devices.py); NCCL tuning.cc latencies",
    ),
    # InfiniBand HDR: 200 Gb/s = 25 GB/s per port each way (IBTA HDR); one NIC per GPU, as in
    # NVIDIA's DGX A100 (8 ConnectX-6 HDR ports for the compute fabric); 80% practical.
    "ib-200g": Link(
        "ib-200g",
        25 * GB * _PRACTICAL,
        9.6 * US,
        _NCCL_BASE,
        scope="gpu",
        network=True,
        source="InfiniBand HDR 200 Gb/s, one NIC per GPU (DGX A100 layout) x 0.8; NCCL tuning.cc NET latency",
    ),
    # 25 Gigabit Ethernet (IEEE 802.3by): 3.125 GB/s each way, one NIC per node (a common cloud
    # instance), TCP sockets; 80% practical. Latency: nominal 50 us per step for NCCL's socket
    # transport (kernel TCP round trips; not from a datasheet).
    "eth-25g": Link(
        "eth-25g",
        3.125 * GB * _PRACTICAL,
        50 * US,
        _NCCL_BASE,
        scope="node",
        network=True,
        source="25GbE (3.125 GB/s), one NIC per node, x 0.8; latency nominal 50 us per step (TCP)",
    ),
}
NETWORKS = tuple(k for k, v in LINKS.items() if v.network)


def load_link(path: str | Path) -> Link:
    """The link measured by ``python -m offload_compiler calibrate --collectives`` (its JSON).

    Raises:
        ValueError: naming the file when it cannot be read or lacks positive ``alpha_s`` and
            ``bytes_per_s``.
    """
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as exc:
        raise ValueError(f"collectives calibration {str(p)!r} cannot be read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"collectives calibration {str(p)!r} is not JSON: {exc}") from None
    fit = data.get("link") if isinstance(data, dict) else None
    if not isinstance(fit, dict):
        raise ValueError(
            f"collectives calibration {str(p)!r} has no 'link' object (write it with calibrate --collectives)"
        )
    try:
        bw, alpha = float(fit["bytes_per_s"]), float(fit["alpha_s"])
        base = float(fit.get("base_s", 0.0))
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"collectives calibration {str(p)!r}: 'link' needs numeric bytes_per_s and alpha_s") from None
    if not (bw > 0 and alpha >= 0 and base >= 0):
        raise ValueError(f"collectives calibration {str(p)!r}: bytes_per_s must be > 0, alpha_s and base_s >= 0")
    return Link(
        str(fit.get("name", f"calibrated ({p.name})")),
        bw,
        alpha,
        base,
        source=f"measured by calibrate --collectives ({p})",
    )


@dataclass(frozen=True)
class Group:
    """A process group of ``size`` ranks, ``per_node`` of them in each node it spans."""

    size: int
    per_node: int

    @property
    def nodes(self) -> int:
        return max(1, -(-self.size // max(1, self.per_node)))


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``gpus_per_node`` GPUs; ``intra`` joins the GPUs of a node, ``inter``
    the nodes (``None`` for one node)."""

    gpus_per_node: int
    nodes: int
    intra: Link
    inter: Link | None = None

    def group_bandwidth(self, group: Group) -> float:
        """Bytes/s one rank of ``group`` gets (see the module docstring)."""
        if group.nodes <= 1 or self.inter is None:
            return self.intra.bytes_per_s
        node_bw = self.inter.bytes_per_s * (self.gpus_per_node if self.inter.scope == "gpu" else 1)
        concurrent = max(1, self.gpus_per_node // max(1, group.per_node))
        return min(self.intra.bytes_per_s, node_bw / concurrent)

    def seconds(self, op: Op, nbytes: float, group: Group) -> float:
        """Predicted seconds of collective ``op`` over ``group`` (see :func:`collective_seconds`)."""
        return collective_seconds(op, nbytes, group, self)


def collective_seconds(op: Op, nbytes: float, group: Group, cluster: Cluster) -> float:
    """Seconds of one ring collective (module docstring): ``op`` of ``nbytes`` bytes (the
    gathered output for all-gather, the input for reduce-scatter and all-reduce, the message for
    send/recv) over ``group`` on ``cluster``. 0 for a group of one rank.

    Raises:
        ValueError: for an unknown ``op`` or a negative size.
    """
    if nbytes < 0:
        raise ValueError(f"collective_seconds: nbytes must be >= 0, got {nbytes}")
    p = group.size
    if op == "send_recv":
        if p <= 1:
            return 0.0
        spans = group.nodes > 1
        link = cluster.inter if spans and cluster.inter is not None else cluster.intra
        return link.base_s + link.alpha_s + nbytes / cluster.group_bandwidth(group)
    if p <= 1:
        return 0.0
    if op == "all_reduce":
        steps, inter_steps, volume = 2 * (p - 1), 2 * (group.nodes - 1), 2 * (p - 1) / p * nbytes
    elif op in ("all_gather", "reduce_scatter"):
        steps, inter_steps, volume = p - 1, group.nodes - 1, (p - 1) / p * nbytes
    else:
        raise ValueError(f"unknown collective {op!r}; one of all_gather, reduce_scatter, all_reduce, send_recv")
    inter = cluster.inter if cluster.inter is not None else cluster.intra
    if cluster.inter is None:
        inter_steps = 0
    latency = cluster.intra.base_s + (steps - inter_steps) * cluster.intra.alpha_s + inter_steps * inter.alpha_s
    return latency + volume / cluster.group_bandwidth(group)
