"""Configuration choice for the fused CUTLASS kernels (csrc/ag_gemm/, csrc/gemm_rs/) on one GPU.

``choose_config(op, m, n, k, dtype, out_dtype, device) -> (config, raster, swizzle)``, where
m is the kernel's own rows (ag: all gathered rows; rs: one rank's block), returns in order:
a tuned choice from the kernel cache of this GPU model (the user's file, then the shipped
one in flux/autotune/shipped/), else the analytic default (``analytic_config``).

Cache: kernels-<hash of "kernels|<GPU name>|sm<SMs>">.json in the strategy caches' directories
($FLUX_CACHE_DIR or ~/.cache/flux/; shipped: flux/autotune/shipped/), cache.TuneCache's format, entries keyed
"<op>|<dtype>|<out dtype>|m<M bucket>|n<N>|k<K>" holding {"choice": "c<id>/r<raster>/s<swizzle>",
"config": "<tile/cluster/schedule>", "default": label, "vs_cublas": the choice's score, "runs"?: runs pooled,
"loop_ms": {...}, "graph_ms": {...}}; a
choice whose configuration is no longer built with the same tile, cluster and schedule is ignored.

The configurations are those of the table flux/fused_configs.py that are built for the dtypes
(``kernel_configs``).

CLI (one GPU): python -m flux.autotune.kernels --grid models [--op ag|rs] [--rounds N] [--look N] [--ship]; or, without a GPU,
from a bench/bench_fused_gemm.py JSON: python -m flux.autotune.kernels --from-bench FILE [FILE ...] [--configs SPEC]
[--ship] (SPEC: a FLUX_KERNELS value, default "default": only what that build holds is chosen; several FILEs:
runs of one build pooled per shape, ``entries_from_bench``).
"""
import argparse
import collections
import hashlib
import json
import logging
import math
import os
import re
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from flux.autotune import cache as cache_mod
from flux.autotune.cache import GENERATION, TuneCache
from flux.autotune.kernel_configs import OPS, KernelConfig, _dt, _op, config_source, kernel_configs  # noqa: F401
from flux.autotune.kernel_configs import reset as kernel_configs_reset
from flux.autotune.space import MARGIN, m_bucket

log = logging.getLogger("flux")


# ---- analytic default -------------------------------------------------------------------
# A roofline per wave of a persistent kernel on ``sm`` SMs. Constants are H100/H200 SXM class:
# ~780 TFLOP/s sustained bf16 on 132 SMs, ~3.3 TB/s sustained HBM.
SM_FLOPS = 780e12 / 132
HBM_BW = 3.3e12
# The tuner's tile orders: bands of cluster_m * swizzle M tiles, N fastest inside a band (the
# analytic default models each for AG, below). CUTLASS's scheduler bands at most 8 tiles (a larger
# max_swizzle_size runs as 8).
SWIZZLES = (1, 2, 4, 8)
# A weight larger than this much of L2 is read from HBM once per band of M tiles (the tiles run N
# fastest inside a band, so a band sweeps the whole weight before the next one starts): measured
# at 1024 x 8192 x 14336, 128x176 tiles with a 2x1 cluster and no band read 4x the weight, 128x128
# with bands of 4 once (bench/results/fused_ncu-h200-clock.json).
L2_OPERAND_BYTES = 25e6
# At its power cap an H200 clocks down as a kernel's HBM traffic grows (ours, with bands of 1 on the
# wide layers, 7-17% below cuBLAS's clock at the same 700 W; bench/results/fused_power-h200-*.json):
# modelled time grows by this fraction per TB/s of HBM traffic (fitted over the shipped bench files:
# 0.02-0.045 all gave the analytic choice within 5% of the tuned one on 12-14 more shapes).
POWER_SLOPE = 0.03
SATURATING_SM_SHARE = 0.5  # the share of SMs whose loads in flight saturate HBM
# Fitted to the H200 bench files (bench/results/fused_gemm-h200-*.json; docs/tuning.md): a tile
# taller than the rows runs slower than the model's terms say, by this factor per halving of the
# rows (RS blocks of 32-64 rows: 128-row tiles 1.02-1.59x the time of 64-row ones the model had equal);
# a stream-K launch costs a fixed few microseconds more (its workspace memset, no PDL overlap).
PADDED_TILE_PENALTY = 1.3
# The RS cooperative epilogue loads each subtile of the peer's partial, then adds and stores it,
# after the tile's mainloop: it runs at about 1 / 1.4 of the rate of the bytes it moves. Fitted over
# the shipped bench files of both GPUs: on the H200 (RS 0, 128x256 cooperative, in
# bench/results/fused_gemm-h200-rs-wide.json) 1.4-2 gave the analytic choice within 5% of the tuned one
# on 3 more shapes than 1; on the H100, where RS 0 is the tuned choice from 512 rows per rank down to
# K = 3584 (bench/results/fused_gemm-h100-rs.json), 1.4 on 7-8 more than 2. Re-checked with RS 0's source
# loaded ahead (bench/results/fused_gemm-h100-rs-retune.json): 1.2 one H100 shape fewer, two H200 more.
RS_COOP_EPILOGUE = 1.4
# A stream-K launch's fixed cost (its workspace memset, no PDL overlap): 7 us or more puts the analytic
# choice at 256 x 16384 x 2304 (AG, M x K x N) on the split-K tile that both GPUs' files time fastest,
# where 5 us chose stream-K (1.10-1.13x the tuned time); on no other grid shape does it choose stream-K.
STREAM_K_FIXED_S = 8e-6
# The L2 reads of the operands (``_l2_reads``, which credits no reuse between CTAs but the cluster's
# multicast) at most at this rate: an effective bound, fitted over the shipped bench files (8-8.5
# TB/s put the analytic choice within 5% of the tuned one on 3-5 more shapes than no bound, 7.5 and
# 9 on fewer). It ranks the tiles that re-read an operand many times: at 128 rows on 8192 columns,
# RS with 64x128 tiles read the weight at the HBM bound where a 2x1 cluster multicast it and
# 1.2-1.3x slower without (bench/results/fused_gemm-h200-rs-64x128.json), and AG at 1024 x 4096 x
# 1536 with 64x96 tiles (A read 16 times) took 1.25x the 128x96 ones' time. Not a hardware figure:
# neighbouring CTAs reading the same tile share much of it (RS 64x128 tiles in bands of 8 run at
# 15 TB/s by this count); the bound does not depend on the band, whose choice the weight's re-reads
# from HBM and the clock decide (``_traffic``, ``_power``).
L2_SM_BW = 8.5e12
# A ping-pong tile of 128 rows and 144-192 columns (one consumer warpgroup's whole tile, fewer operand
# bytes per MMA than the 128x256 cooperative tile's two groups): this share of the wide tiles' mainloop
# rate. Fitted over both GPUs' bench files: at 1.0 the analytic choice took the ping-pong tile with bands
# of 2-4 where the tuned one, the 128x256 tile, ran 1.06-1.39x faster on the H100 at 4096-16384 rows
# (bench/results/fused_gemm-h100-ag-16384.json; on the H200 within 5%); 0.98 put 6 fewer H100 shapes
# and 1 fewer H200 shape over 5% of the tuned time (0.97 and 0.99: fewer on the H100, more on the H200).
PINGPONG_WIDE_EFF = 0.98
# Split-K's reduction pass, beyond its HBM traffic: a second launch, mostly hidden behind the
# GEMM's tail under programmatic dependent launch.
SPLIT_K_FIXED_S = 2e-6


def _tile_eff(c: KernelConfig, tiles_m: int = 0) -> float:
    """Tensor-core efficiency of a tile's mainloop: 128x256 and 256x128 tiles keep both consumer
    warpgroups on 64+ rows of wide MMAs, and so do cooperative tiles 192-248 wide (one MMA of the
    tile's width per K step; fitted to bench/results/fused_gemm-h200-ag.json: the 224-wide tile
    is the fastest on 9-10 of the 72 AG shapes); a cooperative 128x128 halves each warpgroup's MMA;
    a ping-pong 128x128 gives each warpgroup a whole tile (less operand reuse than 128x256), and
    ping-pong tiles 144-192 wide rate just below the wide cooperative ones (PINGPONG_WIDE_EFF), their
    epilogue then overlapped (AG 72-74, bench/results/fused_gemm-h200-ag-pingpong.json: the fastest on
    34 of its 72 AG shapes; the analytic choice's time over the tuned one's went from 1.025 / 1.030 to
    1.016 / 1.021); a
    ping-pong 64x256 as a cooperative 128x128 (RS 4 is the best configuration only on some shapes
    of 1024+ rows per rank and deep K, bench/results/fused_gemm-h200-rs-swizzle.json, and 1.2-1.5x
    the tuned choice's time where K is 4096 or less: the tuner picks it, the model does not); 64-row
    tiles narrower than 256 0.75 (a 2x1 cluster's weight multicast counts in the L2 reads,
    ``_l2_reads``), 64x64 ones the least and by their cluster (below)."""
    area = c.tile_m * c.tile_n
    # The weight multicast along a 2x1 (or taller) cluster whose CTAs all have rows.
    weight_multicast = 1 < c.cluster_m <= max(tiles_m, 1)
    if area <= 64 * 64:
        # RS 27 / 28 (bench/results/fused_gemm-h200-rs-64x64.json): where a problem has two or more
        # tile rows (``tiles_m``), multicasting B along a 2x1 cluster ran 1.3-1.7x faster than A along
        # 1x2; over one tile row (32, 64 rows) the 2x1 cluster's second CTA has no rows, and 1x2 won.
        return 0.65 if weight_multicast else 0.45
    if c.schedule == "pingpong" and c.tile_m == 128 and c.tile_n > 128:
        return PINGPONG_WIDE_EFF
    if area >= 128 * 256 or (c.schedule == "cooperative" and area >= 128 * 192):
        return 1.0
    if c.tile_m == 64 and area >= 128 * 128:
        return 0.88
    if area >= 128 * 128:
        return 0.93 if c.schedule == "pingpong" else 0.88
    return 0.75


def _grid(c: KernelConfig, m: int, n: int, swizzle: int, sm: int) -> Tuple[int, int, int, int]:
    """(tiles_m, tiles_n, padded tiles, CTAs of one wave): tile rows and columns rounded up to
    whole bands of cluster * swizzle tiles; the grid in whole clusters."""
    tiles_m, tiles_n = math.ceil(m / c.tile_m), math.ceil(n / c.tile_n)
    bm, bn = c.cluster_m * swizzle, c.cluster_n * swizzle
    padded = math.ceil(tiles_m / bm) * bm * math.ceil(tiles_n / bn) * bn
    return tiles_m, tiles_n, padded, (sm // (c.cluster_m * c.cluster_n)) * c.cluster_m * c.cluster_n


def _traffic(c: KernelConfig, op: str, m: int, n: int, k: int, in_bytes: int, out_bytes: int,
             sm: int, swizzle: int = 1) -> Tuple[float, int]:
    """(seconds of one tile's epilogue at an SM's share of HBM, bytes the kernel moves through
    HBM). The epilogue stores (and for rs first loads the peer's partial of) the tile's real rows
    (rs cooperative: at 1 / RS_COOP_EPILOGUE of that rate);
    under split-K it stores each slice's fp32 partials (the reduction pass does the rest). A weight
    over L2_OPERAND_BYTES is read once per band of cluster_m * swizzle M tiles, bands that run in
    one wave of CTAs sharing a read."""
    weight = n * k * in_bytes
    reads = m * k * in_bytes + weight
    if weight > L2_OPERAND_BYTES:
        tiles_m, tiles_n, _, ctas = _grid(c, m, n, swizzle, sm)
        band = c.cluster_m * swizzle
        bands_per_wave = max(1, ctas // (band * tiles_n))
        reads += weight * (math.ceil(math.ceil(tiles_m / band) / bands_per_wave) - 1)
    if c.splits > 1:
        return min(c.tile_m, m) * c.tile_n * 4 / (HBM_BW / sm), reads + c.splits * m * n * 4
    per_elem = out_bytes * (2 if op == "rs" else 1)
    epilogue = min(c.tile_m, m) * c.tile_n * per_elem / (HBM_BW / sm)
    if op == "rs" and c.schedule == "cooperative":
        epilogue *= RS_COOP_EPILOGUE
    return epilogue, reads + m * n * per_elem


def _l2_reads(c: KernelConfig, m: int, n: int, k: int, in_bytes: int) -> float:
    """Bytes the CTAs read from L2 into shared memory, counting no reuse between CTAs but the
    cluster's multicast: each tile its rows of A and its columns of the weight, the whole K deep;
    the weight once per cluster along M, A once per cluster along N (where the cluster has that
    many tiles along it)."""
    tiles_m, tiles_n = math.ceil(m / c.tile_m), math.ceil(n / c.tile_n)
    per_w, per_a = min(c.cluster_m, tiles_m), min(c.cluster_n, tiles_n)
    return k * in_bytes * (n * tiles_m / per_w + m * tiles_n / per_a)


def _power(t: float, hbm: float) -> float:
    """``t`` seconds moving ``hbm`` bytes, at the clock the power cap leaves: t * (1 + POWER_SLOPE *
    TB/s), i.e. POWER_SLOPE seconds more per TB moved."""
    return t + POWER_SLOPE * hbm / 1e12


def predict_s(c: KernelConfig, op: str, m: int, n: int, k: int, swizzle: int = 1, in_bytes: int = 2,
              out_bytes: int = 2, sm: int = 132) -> float:
    """Modelled seconds of one launch of ``c`` (raster along N). Counted: padded tiles as work
    (tile rows and columns are rounded up to whole bands of cluster * swizzle tiles: the AG
    scheduler pads M so, CUTLASS's persistent scheduler both; 8192x8192x5120 AG, 20 N tiles
    padded to 24, ran 1.31x slower with swizzle 8 than with 1 on an H200), whole
    waves of the persistent grid, the epilogue's HBM traffic per tile (cooperative: after its
    mainloop; ping-pong: overlapped with the other warpgroup's mainloop), and the whole
    kernel's HBM traffic at a bandwidth that falls where few CTAs hold useful tiles, no faster
    than the operands' reads from L2 at L2_SM_BW (``_l2_reads``); times
    PADDED_TILE_PENALTY per halving of the rows below the tile's, and slowed by the clock the HBM
    traffic leaves under the power cap (``_power``; the weight re-read per band, ``_traffic``).
    Split-K (``c.splits`` slices): the slices' tiles as more tiles of a K / splits deep loop, then the
    reduction pass (the partials read, the output written, for rs the peer's partial read, at HBM
    bandwidth) and SPLIT_K_FIXED_S."""
    tiles_m, tiles_n, padded, ctas = _grid(c, m, n, swizzle, sm)
    s = c.splits
    padded *= s
    waves = math.ceil(padded / ctas)
    mainloop = 2.0 * c.tile_m * c.tile_n * (k / s) / (SM_FLOPS * _tile_eff(c, tiles_m))
    epilogue, hbm = _traffic(c, op, m, n, k, in_bytes, out_bytes, sm, swizzle)
    if c.schedule == "pingpong":
        t_compute = waves * max(mainloop, epilogue) + min(mainloop, epilogue)
    else:
        t_compute = waves * (mainloop + epilogue)
    real = tiles_m * tiles_n * s
    useful = min(real, ctas) if padded <= ctas else ctas * real / padded
    bw = HBM_BW * min(1.0, useful / (SATURATING_SM_SHARE * ctas))
    t = _power(max(t_compute, hbm / bw, _l2_reads(c, m, n, k, in_bytes) / L2_SM_BW), hbm) * PADDED_TILE_PENALTY ** max(0.0, math.log2(c.tile_m / max(m, 1)))
    if s > 1:
        t += (s * 4 + out_bytes * (2 if op == "rs" else 1)) * m * n / HBM_BW + SPLIT_K_FIXED_S
    return t


# Stream-K: where the best persistent configuration's tiles fill less than WAVE_FRACTION of one
# wave (256..1024 rows of the narrow layers: 1024x1280 in 128x128 tiles is 80 tiles on 132 SMs),
# the idle SMs stay idle for the whole K loop; splitting K among CTAs keeps them busy at the cost of
# reducing fp32 partial tiles. That pays where K is deep: DEEP_K_TILES K tiles or more (K >= 2048
# at 64-deep tiles), so that a 4-way split still leaves each CTA 8+ K tiles to fill its mainloop
# pipeline (4-7 stages) between reductions. Between 0.8 and 1 wave the split would shorten the
# critical path by under 20%, about what the reduction and the workspace memset cost.
WAVE_FRACTION = 0.8
DEEP_K_TILES = 32
L2_BW = 5.5e12  # H100/H200 class L2 read bandwidth, where the stream-K partials are reduced


def _should_use_stream_k(c: KernelConfig, m: int, n: int, k: int, swizzle: int, sm: int) -> bool:
    """Whether the persistent configuration ``c`` leaves SMs idle on a deep K loop (see above)."""
    _, _, tiles, ctas = _grid(c, m, n, swizzle, sm)
    return tiles < WAVE_FRACTION * ctas and math.ceil(k / c.tile_k) >= DEEP_K_TILES


def predict_stream_k_s(c: KernelConfig, op: str, m: int, n: int, k: int, swizzle: int = 1, in_bytes: int = 2,
                       out_bytes: int = 2, sm: int = 132) -> float:
    """Modelled seconds of a stream-K launch of ``c``: the padded tiles' K loops spread evenly
    over the grid, then the reduction of a tile's split partials (each fp32 tile read once from
    L2 by the CTA that finishes the tile) and its epilogue; no less than the kernel's HBM
    traffic; plus STREAM_K_FIXED_S. Whole tiles (predict_s) where CUTLASS's heuristic keeps them
    ("streamk": more tiles than CTAs, or a last wave at least half full; "streamk-all": more tiles
    than CTAs)."""
    tiles_m, _, tiles, ctas = _grid(c, m, n, swizzle, sm)
    if tiles >= ctas or (c.scheduler == "streamk" and 2 * tiles >= ctas):
        return predict_s(c, op, m, n, k, swizzle, in_bytes, out_bytes, sm)
    splits = math.ceil(ctas / tiles)  # units sharing a tile's K loop, at most
    compute = 2.0 * tiles * c.tile_m * c.tile_n * k / (ctas * SM_FLOPS * _tile_eff(c, tiles_m))
    reduction = (splits - 1) * c.tile_m * c.tile_n * 4 / (L2_BW / sm)
    epilogue, hbm = _traffic(c, op, m, n, k, in_bytes, out_bytes, sm, swizzle)
    return _power(max(compute + reduction + epilogue, hbm / HBM_BW, _l2_reads(c, m, n, k, in_bytes) / L2_SM_BW), hbm) + STREAM_K_FIXED_S


def _swizzles(c: KernelConfig, m: int, n: int, big: bool, op: str = "rs") -> Tuple[int, ...]:
    """The bands the model weighs, none of which pads a tile row or column. AG: 1 and each such
    band, by modelled time (the weight's re-reads and the clock); RS: the widest such band (<= 8)
    where the operands exceed L2, else 1 (modelling RS's bands too put the analytic choice over 5%
    from the tuned one on more shapes). Swapped operands: the band of all the tile rows (analytic_config
    models them over one or two), so that the tiles sharing a weight tile run next to each other: at 64 rows
    per rank RS 46 with bands of 2 took 0.56-0.91x its time with none (docs/performance.md §9.9)."""
    tiles_m, tiles_n = math.ceil(m / c.tile_m), math.ceil(n / c.tile_n)
    whole = [s for s in SWIZZLES[1:] if tiles_m % (c.cluster_m * s) == 0 and tiles_n % (c.cluster_n * s) == 0]
    if c.operands == "swapped":
        return (tiles_m,) if tiles_m in whole else (1,)
    if op == "ag":
        return (1, *whole)
    return (whole[-1],) if big and whole else (1,)


def _least(cfgs, predict, op, m, n, k, big, ib, ob, sm):
    """(modelled seconds, id, swizzle) of least modelled time; near-ties (within 2%) go to the
    earlier configuration of the table, then to the narrower band."""
    best = None
    for c in cfgs:
        for swz in _swizzles(c, m, n, big, op):
            t = predict(c, op, m, n, k, swz, ib, ob, sm)
            if best is None or t < best[0] * 0.98:
                best = (t, c.id, swz)
    return best


def analytic_config(op: str, m: int, n: int, k: int, dtype="bf16", out_dtype=None, sm_count: int = 132,
                    configs: Optional[Sequence[KernelConfig]] = None) -> Tuple[int, int, int]:
    """(config, raster, swizzle): among the persistent configurations the one of least modelled
    time; where it leaves SMs idle on a deep K loop (``_should_use_stream_k``) and a stream-K or
    split-K configuration is built (split-K: one whose slices divide this K), the one of least
    modelled time among those instead, if that time is less. Near-ties (within 2%) go to the earlier configuration of the table. Swizzle
    (``_swizzles``): AG the band of least modelled time; RS the widest band (<= 8) that pads no tile
    row or column, where the operands exceed L2 (a band then reuses operand tiles in L2), else 1.
    Raster 1 (along N): the order the fused strategies depend on. Configurations with swapped operands are
    modelled only where M fits two of their tile rows (m <= 2 x tile rows, e.g. 64), with a band of all of
    them; beyond, they are left to the tuner where any other is built."""
    op = _op(op)
    out_dtype = out_dtype if out_dtype is not None else dtype
    cfgs = list(configs) if configs is not None else kernel_configs(op, dtype, out_dtype)
    if not cfgs:
        raise ValueError(f"fused {op}: no configuration built for {_dt(dtype)} -> {_dt(out_dtype)}")
    ib, ob = (4 if _dt(dtype) == "fp32" else 2), (4 if _dt(out_dtype) == "fp32" else 2)
    big = (m * k + n * k) * ib > (60 << 20)
    cfgs = [c for c in cfgs if c.applies(m, n, k)]
    # Swapped operands: modelled where M fits two of their tile rows, the MMA's narrow side holding the rows
    # (RS at 8-64 rows per rank on an H100, 21 shapes: so rated, RS 46 is the model's choice where it was the
    # fastest of every configuration and nowhere else, docs/performance.md §9.9); beyond, only measured choices
    # (the tuner's) serve them, unless nothing else is built (at 96 and 128 rows RS 46 with bands of 1 or 2 took
    # 1.18-2.48x the fastest configuration's time, which the model does not foresee).
    cfgs = [c for c in cfgs if c.operands == "ab" or m <= 2 * c.tile_m] or cfgs
    persistent = [c for c in cfgs if not c.stream_k and c.splits == 1]
    stream_k = [c for c in cfgs if c.stream_k]
    split_k = [c for c in cfgs if c.splits > 1]
    best = _least(persistent, predict_s, op, m, n, k, big, ib, ob, sm_count) if persistent else None
    if (stream_k or split_k) and (best is None or _should_use_stream_k(
            next(c for c in persistent if c.id == best[1]), m, n, k, best[2], sm_count)):
        # Kept only if modelled faster: a 128-row stream-K tile over 32 rows, say, wastes most
        # of its MMA work.
        for alt in (_least(stream_k, predict_stream_k_s, op, m, n, k, big, ib, ob, sm_count) if stream_k else None,
                    _least(split_k, predict_s, op, m, n, k, big, ib, ob, sm_count) if split_k else None):
            if alt is not None and (best is None or alt[0] < best[0]):
                best = alt
    if best is None:
        raise ValueError(f"fused {op}: no configuration built for {_dt(dtype)} -> {_dt(out_dtype)} runs K={k}")
    return best[1], 1, best[2]


# ---- cache and choice -------------------------------------------------------------------
def gpu_key(device=None) -> Tuple[str, int]:
    """(cache key, SM count) of a CUDA device; ('kernels|cpu|sm132', 132) without one."""
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if device is None or torch.device(device).type != "cuda":
        return "kernels|cpu|sm132", 132
    p = torch.cuda.get_device_properties(torch.device(device))
    return f"kernels|{p.name}|sm{p.multi_processor_count}", p.multi_processor_count


def entry_key(op: str, m: int, n: int, k: int, dtype, out_dtype=None) -> str:
    return f"{_op(op)}|{_dt(dtype)}|{_dt(out_dtype if out_dtype is not None else dtype)}|m{m_bucket(m)}|n{n}|k{k}"


def label(config: int, raster: int, swizzle: int) -> str:
    return f"c{config}/r{raster}/s{swizzle}"


def parse_label(s: str) -> Tuple[int, int, int]:
    mm = re.fullmatch(r"c(\d+)/r(\d+)/s(\d+)", s)
    if not mm:
        raise ValueError(f"not a kernel configuration label: {s!r}")
    return int(mm[1]), int(mm[2]), int(mm[3])


def file_name(key: str) -> str:
    """kernels-<hash>.json: beside the strategy caches (tune-<hash>.json), in the same directories."""
    return "kernels-" + hashlib.sha1(key.encode()).hexdigest()[:16] + ".json"


class KernelCache(TuneCache):
    """TuneCache's format and precedence (the user's file over the shipped one) for the kernel
    choices of one GPU model, in files named by ``file_name``."""

    def __init__(self, key: str, directory: Optional[str] = None):
        self.topology_key = key
        self.path = os.path.join(directory or cache_mod.cache_dir(), file_name(key))
        self.shipped = cache_mod._load(os.path.join(cache_mod.SHIPPED_DIR, file_name(key)), key, check_version=False)
        self.user = cache_mod._load(self.path, key, check_version=True)


_caches: Dict[Tuple[str, Optional[str]], KernelCache] = {}
_memo: Dict[tuple, Tuple[int, int, int]] = {}


def kernel_cache(key: str, directory: Optional[str] = None) -> KernelCache:
    if (key, directory) not in _caches:
        _caches[(key, directory)] = KernelCache(key, directory)
    return _caches[(key, directory)]


def reset() -> None:
    """Forget loaded caches, remembered choices and the configuration list (tests, new files)."""
    _caches.clear()
    _memo.clear()
    kernel_configs_reset()


def cached_choice(cache: TuneCache, op, m, n, k, dtype, out_dtype, entry_dtypes=None) -> Optional[Tuple[int, int, int]]:
    """The cached choice for these dtypes (``entry_dtypes``: the entry of those, where its configuration is
    built for these), or None."""
    e = cache.get(entry_key(op, m, n, k, *(entry_dtypes or (dtype, out_dtype))))
    if not e:
        return None
    try:
        cfg, raster, swz = parse_label(e["choice"])
    except (KeyError, ValueError, TypeError):
        return None
    valid = {c.id: c.desc for c in kernel_configs(op, dtype, out_dtype) if c.applies(m, n, k)}
    return (cfg, raster, swz) if valid.get(cfg) == e.get("config") else None


def choose_config(op: str, m: int, n: int, k: int, dtype=torch.bfloat16, out_dtype=None,
                  device=None) -> Tuple[int, int, int]:
    """(config id, raster, swizzle) for the fused ``op`` kernel running m x n x k (m: the
    kernel's rows, ag: all gathered rows, rs: one rank's block) from ``dtype`` to ``out_dtype``
    on ``device``: the cached tuned choice, else (other dtypes than bf16) the shape's choice from bf16 to
    this output dtype, then from bf16 to bf16, where its configuration is built for these dtypes (docs/tuning.md,
    "fp16 inputs and fp32 output"), else the analytic default. Raises ValueError when no configuration is built for these dtypes (the fused
    strategy is then ineligible)."""
    out_dtype = out_dtype if out_dtype is not None else dtype
    key, sm = gpu_key(device)
    mb = m_bucket(m)  # the choice serves every M of its bucket
    memo = (GENERATION[0], _op(op), mb, n, k, _dt(dtype), _dt(out_dtype), key)
    if memo not in _memo:
        cache = kernel_cache(key)
        got = cached_choice(cache, op, mb, n, k, dtype, out_dtype)
        # Then bf16's entries, of this output dtype first (fp16 -> fp32 takes bf16 -> fp32's choice).
        own = (_dt(dtype), _dt(out_dtype))
        for pair in (("bf16", own[1]), ("bf16", "bf16")):
            if got is None and pair != own:
                got = cached_choice(cache, op, mb, n, k, dtype, out_dtype, pair)
        _memo[memo] = got or served_default(op, m, n, k, dtype, out_dtype, sm)
    return _memo[memo]


def served_default(op: str, m: int, n: int, k: int, dtype, out_dtype, sm: int,
                   configs: Optional[Sequence[KernelConfig]] = None) -> Tuple[int, int, int]:
    """The analytic default as ``choose_config`` serves it to every M of m's bucket: ``analytic_config``
    at the bucket's M. The tuner and ``entries_from_bench`` weigh their choices against this one."""
    return analytic_config(op, m_bucket(m), n, k, dtype, out_dtype, sm, configs)


# ---- tuning (one GPU) -----------------------------------------------------------------------
def variants(op: str, m: int, configs: Sequence[KernelConfig], swizzles=SWIZZLES, rasters=(1,),
             n: int = 0) -> List[str]:
    """Labels to time: each configuration with each raster and swizzle whose bands of tiles
    (cluster * swizzle) do not exceed the problem's M (and N, where given): a larger band
    only pads the grid."""
    out = []
    for c in configs:
        for r in rasters:
            for s in swizzles:
                if s == 1 or (m >= c.cluster_m * s * c.tile_m and n >= c.cluster_n * s * c.tile_n):
                    out.append(label(c.id, r, s))
    return out


LOOK = 3  # the tuner's second look: its least few of the first timing re-timed, with the analytic default


def tune(op: str, m: int, n: int, k: int, dtype=torch.bfloat16, out_dtype=None, device=None, quick=False,
         cache: Optional[TuneCache] = None, rounds: int = 0, look: int = LOOK) -> dict:
    """Time every variant of ``op`` alone (all flags set) and cuBLAS (``KernelProblem.cublas``), interleaved,
    in loop and graph timing, and store the entry in ``cache`` (default: this GPU's); the entry: the choice
    by ``entry_from_records``, the rule of ``entries_from_bench``. ``rounds``: at least this many interleaved
    rounds (``plan_sampling`` gives 3 where a sample runs over 5 ms). ``look``: the ``look`` variants of
    least score and the analytic default are timed again, with cuBLAS, and the choice is among them by
    both timings (the least of many single timings is optimistic by about a sample's spread:
    docs/tuning.md); 0: one timing."""
    from flux.autotune.kernel_timing import (DTYPES, KernelProblem, estimate_ms, plan_sampling, time_calls,
                                             tolerance, warm_calls)

    out_dtype = out_dtype if out_dtype is not None else dtype
    key, sm = gpu_key(device)
    cache = cache if cache is not None else kernel_cache(key)
    cfgs = {c.id: c for c in kernel_configs(op, dtype, out_dtype) if c.applies(m, n, k)}
    default = label(*served_default(op, m, n, k, dtype, out_dtype, sm, list(cfgs.values())))
    labs = variants(op, m, list(cfgs.values()), n=n)
    labs = labs + [default] if default not in labs else labs
    prob = KernelProblem(_op(op), m, n, k, DTYPES[_dt(dtype)], DTYPES[_dt(out_dtype)], torch.device(device or "cuda"))
    fns, tol = {}, tolerance(prob)
    for lab in labs:
        f = prob.fused(*parse_label(lab))
        try:
            ok = prob.rel_err(f) <= tol
        except RuntimeError as e:
            log.warning("flux kernel tuner: %s %s failed: %s", op, lab, e)
            ok = False
        if ok:
            fns[lab] = f
    if not fns:
        raise RuntimeError(f"fused {op} {m}x{n}x{k}: no configuration computed the right result")
    t_est = estimate_ms(next(iter(fns.values())))
    calls, rounds = plan_sampling(t_est, quick, rounds)
    cublas = prob.cublas()

    def timed(labels):  # one run's record, in the bench JSON's format (bench_scores reads it)
        t = time_calls({**{lab: fns[lab] for lab in labels}, "cublas": cublas}, calls, rounds, ("loop", "graph"),
                       warm=warm_calls(t_est))
        out = {"cublas": {"ms": t["cublas"]}, "variants": {}}
        for lab in labels:
            c, r, w = parse_label(lab)
            out["variants"][lab] = {"config": c, "raster": r, "swizzle": w, "tile": cfgs[c].desc, "ok": True,
                                    "ms": t[lab]}
        return out
    recs = [timed(list(fns))]
    if look > 0 and len(fns) > 1:
        looked = least_labels(recs[0], cfgs, look)
        looked += [default] if default in fns and default not in looked else []
        recs.append(timed(looked))
    entry = entry_from_records(recs, cfgs, default)
    if entry is None:
        raise RuntimeError(f"fused {op} {m}x{n}x{k}: no configuration timed")
    cache.put(entry_key(op, m, n, k, dtype, out_dtype), entry)
    return entry


def _allowed(spec: str, dtype, out_dtype) -> Dict[str, Dict[int, KernelConfig]]:
    """The configurations a FLUX_KERNELS-style ``spec`` builds for the dtype pair, by op and id."""
    from flux import fused_configs as table

    variant = next(v for v, io in table.DTYPE_IO.items() if io == (_dt(dtype), _dt(out_dtype)))
    ids = {(op, cid) for op, cid, d in table.select(spec) if d == variant}
    out: Dict[str, Dict[int, KernelConfig]] = {op: {} for op in OPS}
    for op, cid in sorted(ids):
        out[op][cid] = KernelConfig.of(op, table.config(op, cid), ((_dt(dtype), _dt(out_dtype)),))
    return out


def bench_scores(r: dict, cfgs: Dict[int, KernelConfig]) -> Tuple[Dict[str, dict], Dict[str, float]]:
    """One shape's record of bench/bench_fused_gemm.py's JSON, its correct variants among ``cfgs``
    (id -> configuration, as built now): ({label: {"ms": {timing: ms}}}, {label: score}), the score
    the worse ratio to cuBLAS, loop or graph (raw times where the record has no cuBLAS timing); the
    tuner's choice is the least (entries_from_bench), and --top-from re-times the least few."""
    samples = {}  # label -> the timings of its correct variants
    for lab, v in r["variants"].items():  # "<label>/pdl0", "<label>/w1": diagnostic copies, not choices
        if (re.fullmatch(r"c\d+/r\d+/s\d+", lab) and v["ok"] and v["config"] in cfgs
                and v["tile"] == cfgs[v["config"]].desc and v["ms"].get("loop") is not None):
            # A band above the largest ran as that one: one more sample of it, averaged in.
            samples.setdefault(label(v["config"], v["raster"], min(v["swizzle"], SWIZZLES[-1])), []).append(v["ms"])
    ok = {lab: {"ms": {t: sum(x[t] for x in xs) / len(xs)
                       for t in ("loop", "graph") if all(x.get(t) is not None for x in xs)}}
          for lab, xs in samples.items()}
    ref = (r.get("cublas") or {}).get("ms") or {}

    def score(v):
        return max(v["ms"][t] / (ref.get(t) or 1.0) for t in ("loop", "graph") if v["ms"].get(t) is not None)
    return ok, {lab: score(v) for lab, v in ok.items()}


def least_labels(record: dict, cfgs: Dict[int, KernelConfig], n: int) -> List[str]:
    """The ``n`` labels of least score (``bench_scores``) in one run's record of a shape, least first (ties by
    label): what a second look re-times (the tuner's, bench_fused_gemm.py --top-from)."""
    _, scores = bench_scores(record, cfgs)
    return sorted(scores, key=lambda lab: (scores[lab], lab))[:n]


def entries_from_bench(doc, configs: str = "default") -> Tuple[str, Dict[str, dict]]:
    """(GPU cache key, entries) from bench/bench_fused_gemm.py's JSON, choosing among the
    configurations that ``configs`` (a FLUX_KERNELS value; default: the table's default build)
    builds for the JSON's dtypes: a choice must be built to be used. Per shape the variant
    (config, raster, swizzle) whose worse ratio to cuBLAS, loop or graph, is least (raw times
    where the JSON has no cuBLAS timing); the analytic default over the same set unless the best
    beats it by more than MARGIN. No GPU needed.

    ``doc`` may be a list of such JSONs: runs of one build on one GPU model and dtypes, pooled. Per
    shape the candidates are the variants timed in the most of the runs that hold it (a --top-from
    run's few beside the first run's many), each scored by the geometric mean of its score over them:
    a second look tempers the first run's winner, whose least time among many variants favours it."""
    docs = list(doc) if isinstance(doc, (list, tuple)) else [doc]
    if not docs:
        raise ValueError("entries_from_bench: no bench JSON")
    what = {(d["device"], d["sm_count"], d["dtype"], d["out_dtype"]) for d in docs}
    if len(what) > 1:
        raise ValueError(f"entries_from_bench: pooled runs must share GPU model and dtypes, got {sorted(what)}")
    first = docs[0]
    key = f"kernels|{first['device']}|sm{first['sm_count']}"
    allowed = _allowed(configs, first["dtype"], first["out_dtype"])
    shapes: Dict[tuple, list] = {}  # (op, m, n, k) -> its records, first appearance first
    for d in docs:
        for r in d["results"]:
            shapes.setdefault((r["op"], r["m"], r["n"], r["k"]), []).append(r)
    entries = {}
    for (op, m, n, k), recs in shapes.items():
        cfgs = {i: c for i, c in allowed[_op(op)].items() if c.applies(m, n, k)}
        default = label(*served_default(op, m, n, k, first["dtype"], first["out_dtype"], first["sm_count"],
                                        list(cfgs.values())))
        entry = entry_from_records(recs, cfgs, default)
        if entry is not None:
            entries[entry_key(op, m, n, k, first["dtype"], first["out_dtype"])] = entry
    return key, entries


def entry_from_records(recs: Sequence[dict], cfgs: Dict[int, KernelConfig], default: str) -> Optional[dict]:
    """One shape's cache entry from its records (bench/bench_fused_gemm.py's format; several: runs pooled),
    choosing among ``cfgs`` (id -> configuration): among the variants timed in the most runs, the least
    geometric mean of their scores (``bench_scores``: the worse ratio to cuBLAS, loop or graph); the
    analytic ``default`` unless that beats it by more than MARGIN. None where no variant ran correctly."""
    runs = [x for x in (bench_scores(r, cfgs) for r in recs) if x[0]]
    if not runs:
        return None
    seen = collections.Counter(lab for _, sc in runs for lab in sc)  # label -> runs that timed it
    most = max(seen.values())
    scores = {lab: math.exp(sum(math.log(sc[lab]) for _, sc in runs if lab in sc) / most)
              for lab, c in seen.items() if c == most}
    best = min(scores, key=scores.get)
    if default in scores and scores[best] >= scores[default] * (1 - MARGIN):
        best = default

    def mean_ms(t):  # each label's time, the mean over the runs that timed it
        got = {}
        for ok, _ in runs:
            for lab, v in ok.items():
                if v["ms"].get(t) is not None:
                    got.setdefault(lab, []).append(v["ms"][t])
        return {lab: sum(xs) / len(xs) for lab, xs in got.items()}
    return {"choice": best, "config": cfgs[parse_label(best)[0]].desc, "default": default,
            "vs_cublas": round(scores[best], 4), **({"runs": len(runs)} if len(runs) > 1 else {}),
            "loop_ms": mean_ms("loop"), "graph_ms": mean_ms("graph")}


def main(argv=None) -> int:
    from flux.autotune.model_grid import model_grid, parse_shapes

    p = argparse.ArgumentParser(prog="python -m flux.autotune.kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", choices=("models",), default=None)
    p.add_argument("--shapes", default=None, help="MxKxN,... (the kernel's own rows, K, N)")
    p.add_argument("--op", choices=OPS, default=None, help="default: both")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--out-dtype", choices=("same", "fp32"), default="same")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=0, help="at least this many rounds per shape (3 by default where "
                   "a sample runs over 5 ms: the 16384-row shapes)")
    p.add_argument("--look", type=int, default=LOOK, help=f"re-time the N least and the analytic default, choose by "
                   f"both timings (default {LOOK}; 0: one timing)")
    p.add_argument("--ship", action="store_true", help="write into flux/autotune/shipped/ instead of the user cache")
    p.add_argument("--from-bench", default=None, metavar="JSON", nargs="+",
                   help="make the entries from bench/bench_fused_gemm.py's output instead of timing (no GPU); "
                        "several: runs of one build, pooled per shape (entries_from_bench)")
    p.add_argument("--configs", default="default", metavar="SPEC",
                   help="--from-bench: choose among the configurations this FLUX_KERNELS value builds "
                        "(default: the table's default build)")
    args = p.parse_args(argv)
    directory = cache_mod.SHIPPED_DIR if args.ship else None
    if args.from_bench:
        docs = []
        for name in args.from_bench:
            with open(name) as f:
                docs.append(json.load(f))
        key, entries = entries_from_bench(docs, args.configs)
        cache = KernelCache(key, directory)
        cache.user = {**(cache.shipped if args.ship else cache.user), **entries}
        print(f"wrote {len(entries)} entries to {cache.save()}")
        return 0
    if not torch.cuda.is_available():
        print("flux.autotune.kernels: needs a CUDA GPU (none visible); nothing tuned")
        return 1
    from flux.runtime.extension import cuda_kernels_available

    if not (cuda_kernels_available() and bool(torch.ops.flux.ag_gemm_fused_supported())):
        print("flux.autotune.kernels: flux._C with the sm_90a fused kernels is not built/loaded; nothing tuned")
        return 1
    ops = [args.op] if args.op else list(OPS)
    probs = (model_grid(ops) if args.grid else []) + [r for op in ops for r in parse_shapes(op, args.shapes or "")]
    out_dtype = args.dtype if args.out_dtype == "same" else "fp32"
    key, _ = gpu_key()
    cache = KernelCache(key, directory)
    if args.ship:
        cache.user = {**cache.shipped, **cache.user}
    done = set()
    for r in probs:
        ek = entry_key(r["op"], r["m"], r["n"], r["k"], args.dtype, out_dtype)
        if ek in done:
            continue
        done.add(ek)
        e = tune(r["op"], m_bucket(r["m"]), r["n"], r["k"], args.dtype, out_dtype, quick=args.quick, cache=cache,
                 rounds=args.rounds, look=args.look)
        print(f"{ek:44s} {e['choice']:>12s} (default {e['default']})", flush=True)
    print(f"wrote {len(done)} entries to {cache.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
