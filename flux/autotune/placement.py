"""Which SMs of a GPU share a GPC, learnt once per device.

The CTAs of one thread-block cluster always run in one GPC, and on Hopper the L2 request
coalescer merges loads of the same sectors only from one GPC: where the fused AG kernel's CTAs that
read the same rows of A sit decides how much of its traffic reaches the L2 slices
(docs/performance.md §9, "A lone launch at cuBLAS's speed"). The SM numbers do not tell the GPCs
(they interleave them), so :func:`gpc_groups` learns them from launches of clusters
(``torch.ops.flux.cluster_sms``): every cluster's SMs are joined, clusters of 16 CTAs where the GPU
allows them and then of 9 down to 2 (``SIZES``), a few launches each. SMs that no cluster joined to another stay
groups of their own, so a group is never larger than its GPC, only possibly smaller.
"""
from typing import Dict, Iterable, List, Optional, Sequence

import torch

# Cluster sizes launched, largest first. Launches of one CTA per SM leave the same SMs of a GPC idle
# each time (on an H100, 16-CTA clusters cover 16 of a GPC's 18 SMs, 8-CTA ones too): sizes that do not
# divide one another (9 covers 18, 7 and 5 leave other remainders) reach them.
SIZES = (16, 9, 8, 7, 6, 5, 4, 3, 2)
ROUNDS = 4  # launches per size

_learnt: Dict[int, List[List[int]]] = {}


def join(groups: Iterable[Sequence[int]]) -> List[List[int]]:
    """The SMs joined by every list in ``groups`` (each the SMs of one GPC): sorted groups, largest
    first (then by their first SM)."""
    parent: Dict[int, int] = {}

    def find(x):
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x
    for sms in groups:
        sms = list(sms)
        if not sms:
            continue
        for other in sms[1:]:
            parent[find(other)] = find(sms[0])
        find(sms[0])
    out: Dict[int, List[int]] = {}
    for sm in parent:
        out.setdefault(find(sm), []).append(sm)
    return sorted((sorted(g) for g in out.values()), key=lambda g: (-len(g), g[0]))


def clusters_of(launch: Sequence[int], size: int) -> List[List[int]]:
    """The SM lists of one launch's clusters: consecutive runs of ``size`` CTAs (SM -1: not run)."""
    out = []
    for i in range(0, len(launch) - size + 1, size):
        sms = [int(s) for s in launch[i:i + size] if int(s) >= 0]
        if sms:
            out.append(sms)
    return out


def learn(record, sm_count: int, sizes: Sequence[int] = SIZES, rounds: int = ROUNDS) -> List[List[int]]:
    """The GPC groups of SMs 0 .. sm_count - 1 from ``record(size, rounds)``, an [rounds, grid] array of
    the SM each CTA of ``rounds`` launches of clusters of ``size`` CTAs ran on (or None where that size
    does not fit the GPU)."""
    found: List[List[int]] = [[sm] for sm in range(sm_count)]
    for size in sizes:
        sms = record(size, rounds)
        if sms is None:
            continue
        for launch in sms:
            found += clusters_of(launch, size)
    return join(found)


def gpc_groups(device: Optional[int] = None) -> List[List[int]]:
    """The SMs of CUDA device ``device`` (the current one by default) grouped by GPC, as far as clustered
    launches show (see the module's docstring); learnt on the first call per device (a few launches of a
    few microseconds), then cached. Raises RuntimeError without a CUDA device of compute capability 9.0
    or later or without flux's CUDA extension."""
    if not torch.cuda.is_available():
        raise RuntimeError("flux.autotune.placement.gpc_groups: needs a CUDA GPU")
    if not hasattr(torch.ops.flux, "cluster_sms"):
        raise RuntimeError("flux.autotune.placement.gpc_groups: flux was built without its CUDA extension")
    try:
        device = torch.cuda.current_device() if device is None else int(device)
        props = torch.cuda.get_device_properties(device)
    except (AssertionError, RuntimeError) as e:
        raise RuntimeError(f"flux.autotune.placement.gpc_groups: no CUDA device ({e})") from None
    if device not in _learnt:

        def record(size, rounds):
            try:
                return torch.ops.flux.cluster_sms(size, rounds, device).cpu().tolist()
            except RuntimeError as e:  # a size this GPU does not launch (16 needs non-portable clusters)
                if "fits device" in str(e):
                    return None
                raise
        _learnt[device] = learn(record, props.multi_processor_count)
    return [list(g) for g in _learnt[device]]


MAX_GROUPS = 64  # csrc/ag_gemm/ag_gemm_fused.cuh AgDealMaxGroups


def deal_table(groups: Sequence[Sequence[int]], sm_count: int) -> List[int]:
    """The int32 words the fused AG kernel's deal by GPC reads (``torch.ops.flux.set_fused_deal``):
    ``sm_count`` words, one per SM, then ``MAX_GROUPS``, one per group. The groups (as given, each
    holding ``len // 2`` 2-CTA clusters) own runs of consecutive slots, one slot per cluster, in
    order (the kernel scales them to a launch with fewer tiles); a cluster takes the next slot of its
    group's run, and one that finds no room there a free slot of another run. SM ``sm`` of group
    ``g`` (run of ``cap`` slots from ``base``) reads ``g | cap << 6 | base << 16``, an SM in no group
    (or in one too small for a cluster) -1; group ``g``'s word is ``base | cap << 16``, and the last
    group (``MAX_GROUPS - 1``) holds the slots beyond all runs, from their total on. Groups past
    ``MAX_GROUPS - 1`` are left out (their clusters take free slots)."""
    per_sm = [-1] * sm_count
    table = [0] * MAX_GROUPS
    base = 0
    runs = [sorted(sm for sm in g if 0 <= sm < sm_count) for g in groups]
    runs = [g for g in runs if len(g) >= 2][:MAX_GROUPS - 1]
    for i, g in enumerate(runs):
        cap = len(g) // 2
        for sm in g:
            per_sm[sm] = i | cap << 6 | base << 16
        table[i] = base | cap << 16
        base += cap
    table[MAX_GROUPS - 1] = base | max(sm_count - base, 0) << 16
    return per_sm + table


def deal_buffers(device: Optional[int] = None):
    """(table, claims, sms): what torch.ops.flux.set_fused_deal takes for CUDA device ``device``
    (the tensors' addresses and its SM count): the table from :func:`gpc_groups` (:func:`deal_table`),
    the claims zeroed (two words per group and two more: csrc/ag_gemm/ag_tile_scheduler.hpp AgDeal's
    layout). The caller keeps both tensors alive while the deal is set."""
    groups = gpc_groups(device)
    dev = torch.device("cuda", torch.cuda.current_device() if device is None else int(device))
    n = torch.cuda.get_device_properties(dev).multi_processor_count
    table = torch.tensor(deal_table(groups, n), dtype=torch.int32, device=dev)
    return table, torch.zeros(2 * (1 + MAX_GROUPS), dtype=torch.int32, device=dev), n

