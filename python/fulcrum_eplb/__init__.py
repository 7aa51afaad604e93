"""Fulcrum's expert-parallel load balancer (EPLB) from Python.

The planners, metrics, migration plans, static dispatch and trace simulator of Fulcrum's C++ EPLB core
(src/eplb), the same code the server runs. ``rebalance_experts`` takes DeepSeek EPLB's arguments and returns
its three outputs, so it replaces ``eplb.rebalance_experts`` (and the planners vLLM and SGLang build on it).

Inputs: numpy arrays, anything ``numpy.asarray`` or ``numpy.from_dlpack`` reads (buffer protocol, DLPack on
the CPU), or torch tensors on any device (copied to the CPU, as DeepSeek's ``weight.float().cpu()`` does).
Outputs: numpy arrays, or CPU torch tensors (zero-copy views of them) when the main input was a torch tensor.
Bad input raises ``FulcrumError`` (a ``ValueError``) with a one-line message naming the problem.
"""

from __future__ import annotations

import operator
import sys

import numpy as np

from ._core import FulcrumError
from . import _core

__all__ = [
    "FulcrumError",
    "balancedness",
    "evaluate",
    "gpu_loads",
    "planner_names",
    "plan_migration",
    "rebalance_experts",
    "simulate",
    "static_dispatch",
]

TRANSFER_KINDS = ("local", "intra_node", "inter_node")  # plan_migration()["kind"] indexes this


def planner_names() -> list[str]:
    """The accepted ``algorithm`` values: ``"fulcrum"`` (default) and ``"deepseek"``."""
    return list(_core.planner_names())


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _array(x, dtype, name: str, ndim) -> np.ndarray:
    """`x` as a C-contiguous CPU numpy array of `dtype` with `ndim` (an int or a tuple of ints) dimensions."""
    if _is_torch(x):
        torch = sys.modules["torch"]
        x = x.detach().to(device="cpu", dtype=torch.float64 if dtype == np.float64 else torch.int64).numpy()
    elif not isinstance(x, np.ndarray) and hasattr(x, "__dlpack__") and not hasattr(x, "__array__"):
        x = np.from_dlpack(x)
    try:
        a = np.asarray(x)
    except Exception as err:  # an object numpy cannot read at all
        raise FulcrumError(f"{name}: not an array ({type(x).__name__}): {err}") from None
    allowed = (ndim,) if isinstance(ndim, int) else ndim
    if a.ndim not in allowed:
        wanted = " or ".join(str(n) for n in allowed)
        raise FulcrumError(f"{name} must have {wanted} dimensions, got shape {tuple(a.shape)}")
    if dtype == np.int64 and a.size and not np.issubdtype(a.dtype, np.integer):
        raise FulcrumError(f"{name} must hold integers (logical expert ids), got dtype {a.dtype}")
    if dtype == np.float64 and not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_):
        raise FulcrumError(f"{name} must hold numbers, got dtype {a.dtype}")
    return np.ascontiguousarray(a, dtype=dtype)


def _count(value, name: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise FulcrumError(f"{name} must be an integer, got {value!r}") from None


def _like(arrays, as_torch: bool):
    if not as_torch:
        return arrays
    torch = sys.modules["torch"]
    return tuple(torch.from_numpy(a) for a in arrays)


def rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus, *, algorithm="fulcrum", current=None):
    """Plans a placement: DeepSeek EPLB's ``rebalance_experts`` with Fulcrum's planner by default.

    Parameters:
        weight: [num_layers, num_logical_experts] load per expert (token counts or fractions, >= 0).
        num_replicas: physical expert slots per layer, a multiple of num_gpus, at least num_logical_experts.
        num_groups: expert groups (DeepSeek-V3: 8; Qwen3-MoE has none: 1).
        num_nodes: nodes; num_gpus must be a multiple of it.
        num_gpus: expert-parallel ranks; slot s lives on GPU s // (num_replicas // num_gpus).
        algorithm: "fulcrum" (default) or "deepseek" (DeepSeek's algorithm: the same maps as its eplb.py on
            inputs without equal loads, hierarchical when num_groups % num_nodes == 0, global otherwise).
        current: optional [num_layers, num_replicas] physical_to_logical_map in use now; the fulcrum planner
            then keeps experts in their slots where it can (fewer weight transfers). Ignored by "deepseek".

    Returns ``(physical_to_logical_map, logical_to_physical_map, logical_count)``, int64, as DeepSeek's:
        physical_to_logical_map: [num_layers, num_replicas], the logical expert of each slot.
        logical_to_physical_map: [num_layers, num_logical_experts, max replicas], each expert's slots, -1 padded.
            Replicas are listed in ascending slot order (DeepSeek lists them in the order it created them;
            the set per expert is the same).
        logical_count: [num_layers, num_logical_experts], replicas per expert.
    """
    as_torch = _is_torch(weight)
    w = _array(weight, np.float64, "weight", 2)
    cur = None if current is None else _array(current, np.int64, "current", 2)
    if not isinstance(algorithm, str):
        raise FulcrumError(f"algorithm must be a string ({', '.join(planner_names())}), got {algorithm!r}")
    phy2log = _core.plan(w, _count(num_replicas, "num_replicas"), _count(num_groups, "num_groups"),
                         _count(num_nodes, "num_nodes"), _count(num_gpus, "num_gpus"), algorithm, cur)
    log2phy, logcnt = _core.logical_maps(phy2log, w.shape[1])
    return _like((phy2log, log2phy, logcnt), as_torch)


def evaluate(weight, physical_to_logical_map, num_gpus, num_nodes=1) -> dict:
    """Balance report of a placement under even splitting of each expert's load over its replicas.

    Returns a dict: balancedness_per_layer [L] (mean GPU load / max GPU load, 1.0 is perfect),
    balancedness_mean, balancedness_min, lower_bound_per_layer [L] (the best balancedness any placement with
    this many slots can reach: (W/G) / max(W/G, water level of the best replication)),
    lower_bound_balancedness_mean, gpu_loads [L, G].
    """
    w = _array(weight, np.float64, "weight", 2)
    m = _array(physical_to_logical_map, np.int64, "physical_to_logical_map", 2)
    return dict(_core.evaluate(w, m, _count(num_gpus, "num_gpus"), _count(num_nodes, "num_nodes")))


def balancedness(weight, physical_to_logical_map, num_gpus) -> np.ndarray:
    """[num_layers] mean GPU load / max GPU load per layer (take ``.mean()`` for DeepSeek's summary number)."""
    return evaluate(weight, physical_to_logical_map, num_gpus)["balancedness_per_layer"]


def gpu_loads(weight, physical_to_logical_map, num_gpus) -> np.ndarray:
    """[num_layers, num_gpus] load each GPU computes, each expert's load split evenly over its replicas."""
    return evaluate(weight, physical_to_logical_map, num_gpus)["gpu_loads"]


def plan_migration(old_map, new_map, num_logical_experts, num_gpus, num_nodes=1) -> dict:
    """The weight transfers that turn placement `old_map` into `new_map` (both [L, P]).

    Every slot whose expert changes is received once, from a slot holding that expert in `old_map`: on the
    same GPU if possible, else the same node, else across nodes. Returns a dict of equal-length int64 arrays
    layer, dst_slot, src_slot, expert, kind (an index into TRANSFER_KINDS), and the counts num_local,
    num_intra_node, num_inter_node, max_received_per_gpu_layer, max_sent_per_gpu_layer.
    """
    old = _array(old_map, np.int64, "old_map", 2)
    new = _array(new_map, np.int64, "new_map", 2)
    return dict(_core.plan_migration(old, new, _count(num_logical_experts, "num_logical_experts"),
                                     _count(num_gpus, "num_gpus"), _count(num_nodes, "num_nodes")))


def static_dispatch(physical_to_logical_map, num_logical_experts, num_gpus, num_nodes=1) -> np.ndarray:
    """[L, G, E] physical slot that source GPU g sends logical expert e's tokens to under static dispatch:
    its own replica if it has one, else one on its node, else the replicas dealt round-robin over sources."""
    m = _array(physical_to_logical_map, np.int64, "physical_to_logical_map", 2)
    return _core.static_dispatch(m, _count(num_logical_experts, "num_logical_experts"), _count(num_gpus, "num_gpus"),
                                 _count(num_nodes, "num_nodes"))


def simulate(windows, num_physical_experts, num_gpus, *, num_nodes=1, num_groups=1, rebalance_every=1,
             algorithm="fulcrum", dispatch="static", batch_tokens=0, batches_per_window=4, top_k=8, seed=0) -> dict:
    """Replays a load trace through a planner and a dispatch algorithm (what ``fulcrum simulate`` does).

    windows: [num_windows, num_layers, num_logical_experts] loads in time order ([L, E] is one window).
    Window 0 runs the trivial placement (slot s holds expert s % E); at every window t > 0 with
    t % rebalance_every == 0 the planner replans from the previous rebalance_every windows, starting from the
    current placement. dispatch: "static", "dynamic" or "balanced". batch_tokens 0 scores expected loads;
    > 0 replays each window as batches_per_window sampled batches of that many tokens (top_k experts each).
    Returns a dict: balancedness_per_window [S], balancedness_mean, balancedness_min, rebalance_windows [R],
    experts_moved [R] ((layer, slot) pairs whose expert changed at each rebalance).
    """
    a = _array(windows, np.float64, "windows", (2, 3))
    if a.ndim == 2:
        a = a[np.newaxis]
    return dict(_core.simulate(a, _count(num_physical_experts, "num_physical_experts"), _count(num_gpus, "num_gpus"),
                               _count(num_nodes, "num_nodes"), _count(num_groups, "num_groups"),
                               _count(rebalance_every, "rebalance_every"), str(algorithm), str(dispatch),
                               _count(batch_tokens, "batch_tokens"), _count(batches_per_window, "batches_per_window"),
                               _count(top_k, "top_k"), _count(seed, "seed")))
