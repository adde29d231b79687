"""flux.autotune.placement: the GPCs of a GPU learnt from clustered launches. On the CPU against a
made-up GPU whose clusters land at random inside its GPCs; on a GPU of compute capability 9.0 or later,
against fresh launches of clusters (a cluster's CTAs always share a GPC)."""
import random

import pytest
import torch

from flux.autotune import placement


def _machine():
    """A made-up GPU: 8 GPCs of 16-18 SMs whose SM numbers interleave (TPC j of GPC g is SM pair
    2 * (8 * j + g)), 4 SMs of TPCs that sit in GPC 0 and 1."""
    gpcs = [[] for _ in range(8)]
    for j in range(8):
        for g in range(8):
            sm = 2 * (8 * j + g)
            gpcs[g] += [sm, sm + 1]
    gpcs[0] += [128, 129]
    gpcs[1] += [130, 131]
    return [sorted(g) for g in gpcs]


def _record(gpcs, seed=0, largest=8):
    """cluster_sms as the made-up GPU runs it: every launch fills each GPC with as many whole clusters
    as fit, on SMs drawn at random there (clusters of more than ``largest`` CTAs do not launch)."""
    rng = random.Random(seed)

    def record(size, rounds):
        if size > largest:
            return None
        out = []
        for _ in range(rounds):
            launch = []
            for g in gpcs:
                sms = rng.sample(g, len(g))
                for i in range(len(g) // size):
                    launch += sms[i * size:(i + 1) * size]
            out.append(launch)
        return out
    return record


def test_join_merges_overlapping_lists_largest_first():
    assert placement.join([[3, 1], [1, 7], [4], [5, 6], []]) == [[1, 3, 7], [5, 6], [4]]
    assert placement.clusters_of([4, 5, -1, -1, 9, 2, 6], 2) == [[4, 5], [9, 2]]


def test_learn_recovers_every_gpc_of_a_made_up_gpu():
    gpcs = _machine()
    got = placement.learn(_record(gpcs), 132)
    assert sorted(got) == sorted(gpcs)
    assert [len(g) for g in got] == sorted((len(g) for g in gpcs), reverse=True)


def test_learn_reaches_the_sms_a_fixed_placement_leaves_idle():
    """Launches that always fill a GPC from its first SMs leave its last ones idle at every size that
    divides 16: an 18-SM GPC's last TPC is joined only by a size such as 9."""
    gpcs = _machine()

    def record(size, rounds):
        launch = []
        for g in gpcs:
            for i in range(len(g) // size):
                launch += g[i * size:(i + 1) * size]
        return [launch] * rounds
    assert sorted(placement.learn(record, 132)) == sorted(gpcs)
    partial = placement.learn(record, 132, sizes=(16, 8, 4, 2))
    assert len(partial) == 10 and sorted(len(g) for g in partial)[:2] == [2, 2]


def test_learn_never_joins_two_gpcs_and_keeps_unreached_sms():
    """With clusters of 2 only, launched on TPC pairs, nothing crosses a TPC: every SM is still in
    exactly one group, no group spans two GPCs."""
    gpcs = _machine()
    tpc_pairs = [[sm, sm + 1] for sm in range(0, 132, 2)]

    def record(size, rounds):
        return [sum(tpc_pairs, [])] if size == 2 else None
    got = placement.learn(record, 132)
    assert sorted(sm for g in got for sm in g) == list(range(132))
    gpc_of = {sm: i for i, g in enumerate(gpcs) for sm in g}
    assert all(len({gpc_of[sm] for sm in g}) == 1 for g in got)
    assert len(got) == 66


def test_deal_table_gives_each_group_a_run_of_slots_and_the_rest_to_one_more():
    words = placement.deal_table([[4, 5, 0, 1], [2, 3, 7], [9], [11]], 10)
    per_sm, groups = words[:10], words[10:]
    assert len(groups) == placement.MAX_GROUPS
    # Group 0 holds two clusters (slots 0-1), group 1 one (slot 2: 3 SMs hold one 2-CTA cluster); a
    # lone SM holds none, and SM 11 is beyond the GPU.
    g0, g1 = 0 | 2 << 6 | 0 << 16, 1 | 1 << 6 | 2 << 16
    assert per_sm == [g0, g0, g1, g1, g0, g0, -1, g1, -1, -1]
    assert groups[:2] == [0 | 2 << 16, 2 | 1 << 16] and groups[-1] == 3 | 7 << 16  # the rest: from slot 3 on
    assert groups[2:-1] == [0] * (placement.MAX_GROUPS - 3)
    many = placement.deal_table([[2 * i, 2 * i + 1] for i in range(100)], 200)
    assert max(w & 63 for w in many[:200] if w >= 0) == placement.MAX_GROUPS - 2 and many[199] == -1
    assert many[-1] == 63 | (200 - 63) << 16  # the rest after 63 runs


def test_gpc_groups_without_a_gpu_raises_naming_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="gpc_groups: needs a CUDA GPU"):
        placement.gpc_groups()


def _sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        return False
    try:
        from flux.runtime.extension import cuda_kernels_available
        return cuda_kernels_available() and hasattr(torch.ops.flux, "cluster_sms")
    except (ImportError, AttributeError, RuntimeError):
        return False


gpu = pytest.mark.skipif(not _sm90(), reason="needs flux._C and a GPU of compute capability 9.0 or later")


@gpu
def test_gpu_gpc_groups_partition_the_sms_and_hold_every_cluster():
    """Every SM in exactly one group; in fresh launches of clusters of 2, 4 and 8 CTAs (not those the
    map was learnt from) every cluster's SMs lie in one group; a cluster of 8 fits some group."""
    n = torch.cuda.get_device_properties(0).multi_processor_count
    groups = placement.gpc_groups()
    assert sorted(sm for g in groups for sm in g) == list(range(n))
    group_of = {sm: i for i, g in enumerate(groups) for sm in g}
    for size in (2, 4, 8):
        sms = torch.ops.flux.cluster_sms(size, 3, 0).cpu().tolist()
        for launch in sms:
            assert len(launch) % size == 0 and min(launch) >= 0 and len(set(launch)) == len(launch)
            for c in placement.clusters_of(launch, size):
                assert len({group_of[s] for s in c}) == 1, (size, c)
    assert len(groups[0]) >= 8
    assert placement.gpc_groups() == groups  # cached


@gpu
def test_gpu_cluster_sms_checks_its_arguments():
    for args, msg in (((0, 1, 0), "the cluster size must be 1 to 16"), ((2, 0, 0), "rounds must be 1 to 64"),
                      ((2, 1, 99), "no CUDA device 99")):
        with pytest.raises(RuntimeError, match=f"flux.cluster_sms: {msg}"):
            torch.ops.flux.cluster_sms(*args)
