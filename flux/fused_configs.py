"""The fused GEMM kernels' configurations: one table for the build, the C++ dispatch and Python.

Each op ("ag": fused AllGather+GEMM, csrc/ag_gemm/; "rs": fused GEMM+ReduceScatter own block,
csrc/gemm_rs/) has configurations, each a CUTLASS sm90 warp-specialized persistent GEMM: a tile
of M x N x K elements, a cluster of CTAs (cluster_m x cluster_n), a schedule ("cooperative": two
consumer warpgroups split each tile's rows, tile_m >= 128; "pingpong": each consumer warpgroup
runs whole tiles, alternating, for 64-row tiles and small problems) and a tile scheduler
("persistent": one CTA per tile, whole K; "streamk": CUTLASS's stream-K, cooperative only, which
splits K among CTAs where there are fewer tiles than SMs and reduces the partials in a workspace
before the tile's one epilogue; "streamk-all": the same on every shape; "splitk": the persistent
kernel over ``splits`` equal slices of K as one batched launch into fp32 partials, then one pass
summing them in slice order with the bias (and, for "rs", the peer's partial):
csrc/common/split_k.cuh). Each is built for its ``default`` dtype variants (inputs -> output, fp32
accumulation; bias and the peer's partial in the output dtype): bf16, fp16, bf16_fp32, fp16_fp32.

setup.py reads this file by path (no import of flux, no torch) and generates one translation
unit per (op, config, dtype) and the dispatch over them; ``torch.ops.flux.fused_kernels_built()``
says which were compiled (``built()`` below). Configuration ids are stable: tuned choices name them.

FLUX_KERNELS (build setting): "default", "all" (every configuration, all four dtypes), "minimal"
(config 0 of each op, bf16, no grouped GEMM), "streamk" / "splitk" (every stream-K / split-K
configuration, bf16), or a comma list of those and of terms op:id[:dtype] and gmm:id[:kind]
(grouped GEMMs, GROUPED below) with "*" wildcards, e.g. "default,ag:*:fp16,gmm:1".
"""
from typing import NamedTuple

DTYPES = ("bf16", "fp16", "bf16_fp32", "fp16_fp32")  # index = the C++ dtype variant id
DTYPE_IO = {"bf16": ("bf16", "bf16"), "fp16": ("fp16", "fp16"),
            "bf16_fp32": ("bf16", "fp32"), "fp16_fp32": ("fp16", "fp32")}
ALL = DTYPES
# The default build's configurations tuned in bf16 are built in fp16 too: such a call takes its shape's bf16
# choice (same tensor-core rate; docs/tuning.md), where with AG 0, 2 and RS 3 alone it ran AG at 1.16x cuBLAS.
H = ("bf16", "fp16")
# fp32 output of a tile whose AG split-K GEMM is built: that GEMM is the tile's fp32-output instantiation
# (setup.py compiles the two in one unit, once), so these cost the build nothing; the split-K
# configurations themselves take every output dtype (their reduction writes it).
O = ("bf16_fp32", "fp16_fp32")


class FusedConfig(NamedTuple):
    id: int
    tile: tuple  # (M, N, K) elements
    cluster: tuple  # (cluster_m, cluster_n) CTAs
    schedule: str  # "cooperative" | "pingpong"
    default: tuple  # dtype variants built by default
    scheduler: str = "persistent"  # "persistent" | "streamk" | "streamk-all" (cooperative only) | "splitk"
    splits: int = 1  # slices of K ("splitk" only)
    loads: str = "cutlass"  # "cutlass": A then B each stage; "multicast-first": the multicast one first
    # "auto": CUTLASS's epilogue, its buffers as EpiPick sizes them; "ahead" (rs only): more of the next
    # tile's source (the peer's partial) loaded during its mainloop, in the buffers the mainloop's stages
    # leave (csrc/common/fused_gemm.cuh SourceAhead)
    source: str = "auto"
    # "ab": CUTLASS's problem is the layer's (rows of A along the tile's M); "swapped": out^T = weight @ a^T
    # (csrc/common/fused_gemm.cuh Sm90FusedGemm), the warpgroup MMA's 64-row side along the layer's
    # columns and its 8..256-wide side along A's rows. `tile` and `cluster` still name (rows, columns) of
    # out; the cooperative schedule then splits the columns between its two consumer warp groups.
    operands: str = "ab"

    @property
    def tile_m(self):
        return self.tile[0]

    @property
    def cluster_m(self):
        return self.cluster[0]

    def describe(self):
        m, n, k = self.tile
        sk = {"persistent": "", "streamk": ", stream-K", "streamk-all": ", stream-K always",
              "splitk": f", split-K into {self.splits}"}[self.scheduler]
        lo = "" if self.loads == "cutlass" else ", multicast load first"
        src = "" if self.source == "auto" else ", source loaded ahead"
        sw = "" if self.operands == "ab" else ", operands swapped"
        return f"{m}x{n}x{k} tile, cluster {self.cluster[0]}x{self.cluster[1]}, {self.schedule}{sk}{lo}{src}{sw}"

    def applies(self, m, n, k):
        """Whether this configuration runs an m x n x k problem: split-K cuts K into equal slices
        whose rows stay 16-byte aligned (K a multiple of 8 * splits), and its fp32 partials
        (splits * m * n * 4 bytes) stay within SPLIT_K_MAX_PARTIALS (split-K serves problems of few
        tiles; 16384 x 53248 in 8 slices would take 28 GB)."""
        return self.splits == 1 or (k % (8 * self.splits) == 0 and 4 * self.splits * m * n <= SPLIT_K_MAX_PARTIALS)


C = FusedConfig
# Ids keep their meaning across releases; new shapes get new ids.
# The default set (25 fused instantiations, the split-K configurations of one tile sharing one;
# setup.py compiled them four to a translation unit (five since), about 45 s of a core per unit and 6 s per
# instantiation) is the greedy choice over an H200 measurement of every bf16 persistent
# configuration on the model grid (bench/results/fused_gemm-h200-grid-bf16.json): each
# configuration added where it most lowered the geometric mean over the shapes of the best built
# one's time relative to cuBLAS, in loop and in graph timing; plus AG's best stream-K configuration
# on the grid's 256- and 1024-row shapes, in place of ag 8 (64x256 ping-pong, the least served).
# Not built by default: ag 16 (stream-K on every shape; 0.4% on the grid's geometric mean in
# bench/results/fused_gemm-h200-models.json) and RS's stream-K configurations (1-2 of 72 shapes,
# by under 1%). Then AG 25, 28 and 29, the greedy choice in the same way among the tile widths of
# bench/results/fused_gemm-h200-ag.json (AG 26, 27, 30 and 31: 0.6% more for about three more
# minutes of a 2-core build). Then AG's split-K tiles 128x64, 128x96, 128x144 and 128x160
# (bench/results/fused_gemm-h200-ag-splitk.json: at 256 rows the best built configuration's worst
# shape went from 1.20x to 1.05x cuBLAS in loop timing); not 128x128 (AG 38, 39: best on no shape)
# nor RS's (best on 3 of the 36 shapes of bench/results/fused_gemm-h200-rs-splitk.json, by 3-7%).
# Then AG 60 (64x96, 2x1 cluster) in place of the split-K 128x144 unit (AG 40): over the 256- and
# 1024-row shapes of bench/results/fused_gemm-h200-ag-tiles.json the best built configuration's
# geometric mean went from 0.980 / 1.047 to 0.968 / 1.038 x cuBLAS (loop / graph); AG 59, 61, 62
# added 0.5% more. Clusters along N (AG 43-58, RS 19-26) were best on almost no shape
# (bench/results/fused_gemm-h200-{ag,rs}-cluster-n*.json). Then RS 4 (64x256 ping-pong): with bands of
# 2 and 4 M tiles timed too, the best built configuration's geometric mean over the RS shapes of 1024+
# rows per rank went from 0.957 / 0.978 to 0.950 / 0.971 x cuBLAS (bench/results/fused_gemm-h200-rs-swizzle.json).
# Then RS 27 and 28 (64x64 ping-pong): see their entries. Then AG 72-75 (ping-pong, 80-192 wide; see
# their entries) in place of AG 9 (128x64 ping-pong), AG 25 (128x160 cooperative) and RS 4, which the
# shipped H200 choices then no longer named (re-made without them: the same choice on every shape).
# Then RS 37 (64x128 ping-pong, 2x1) and RS 0 (128x256 cooperative, 2x1): see their entries. Then AG 0
# and 2 in fp16 and with fp32 output in place of AG 5 and 14 (bf16): see AG 0. Then every configuration
# of the default build in fp16 (H above), once setup.py compiled several instantiations per unit. Then fp32
# output, from bf16 and fp16, on AG's split-K configurations and the tiles of their GEMMs (AG 9, 25, 29; O
# above), which adds no GEMM to compile (41 fused GEMMs in all). Then AG 31 (128x208 cooperative), bf16 and fp16:
# see its entry (43 fused GEMMs; the units hold 4 or fewer each, so the build's units stay 12). Then AG 0 and 2
# from fp16 to fp32 (see AG 0; 45 fused GEMMs: 13 units of four, 823 s of a 2-core build, so setup.py puts five
# to a unit since: 11 units, 728-759 s, up to 8.3 GB each). Then RS 46 (32x64 ping-pong, swapped operands), bf16
# and fp16: see its entry (47 fused GEMMs, 12 units).
# The others are built with FLUX_KERNELS=all or by name ("streamk" / "splitk": every one, bf16).
CONFIGS = {
    "ag": (
        # AG 0 and 2 are built in fp16 and with fp32 output too: such calls take their shape's bf16 choice
        # where it is one of them, else the analytic choice between them. AG 0 alone held those dtypes before: on an H100, timed at each band, AG 0
        # alone ran 1.30 / 1.32x cuBLAS (loop / graph) in fp16 over the AG grid, AG 2 alone 1.24 / 1.25
        # (faster at 256-1024 rows, slower from 4096), the analytic choice between the two 1.155 / 1.166;
        # with fp32 output 1.29 / 1.32, 1.23 / 1.24 and 1.161 / 1.177
        # (bench/results/fused_gemm-h100-ag-general-fp16.json, -fp32out.json). Their two more instantiations
        # replace AG 5 and 14 in the default build, the bf16 configurations whose absence costs least
        # (0.04-0.09% and 0-0.07% of the best built configuration's geometric mean over the grid files).
        # From fp16 to fp32 too (all four variants): without them such calls ran AG at 1.122 / 1.151x cuBLAS
        # on an H100, bf16 -> fp32 1.059 / 1.092 on the same machine, where the tuned bf16 -> fp32 choice, which
        # fp16 -> fp32 calls take, is AG 0 or 2 on most shapes (bench/results/fused_gemm-h100-ag-fp16-fp32out-served-fb3fa5a.json);
        # with them, the same choice as bf16 -> fp32 on every shape: 1.055 / 1.073x, bf16 -> fp32 1.049 / 1.070 in
        # the same run (bench/results/fused_gemm-h100-ag-fp16-fp32out-served-286fd3c.json).
        C(0, (128, 256, 64), (2, 1), "cooperative", ALL),
        C(1, (256, 128, 64), (2, 1), "cooperative", ()),
        C(2, (128, 128, 64), (2, 1), "pingpong", ALL),
        C(3, (256, 128, 64), (1, 2), "cooperative", ()),  # cuBLAS's shape on big GEMMs
        C(4, (128, 128, 64), (1, 1), "cooperative", ()),
        C(5, (128, 192, 64), (1, 1), "cooperative", ()),  # N = 1536, 2304, 3072: whole tiles
        C(6, (128, 256, 64), (1, 2), "cooperative", ()),
        C(7, (64, 128, 64), (1, 1), "pingpong", ()),  # few rows, narrow N: 2x the tiles of 128x128
        C(8, (64, 256, 64), (1, 1), "pingpong", ()),  # few rows, wide N
        C(9, (128, 64, 64), (1, 1), "pingpong", O),  # few rows, narrow N; fp32 output: AG 32-34's GEMM
        C(10, (128, 128, 64), (1, 2), "pingpong", ()),
        C(11, (64, 128, 128), (1, 1), "pingpong", ()),
        # Stream-K: fewer tiles than SMs and deep K (256..1024 rows of the narrow layers).
        C(12, (128, 128, 64), (1, 1), "cooperative", (), "streamk"),
        C(13, (128, 256, 64), (1, 1), "cooperative", (), "streamk"),
        C(14, (128, 128, 64), (2, 1), "cooperative", (), "streamk"),
        # Narrow tiles for the fewest-tile shapes (256 rows, N 768..3072: 24..96 tiles of 128x64).
        C(15, (128, 64, 64), (1, 1), "cooperative", (), "streamk"),
        # Stream-K on every shape: CUTLASS's heuristic keeps whole tiles where the last wave is at
        # least half full (80 tiles of 128x128 on 132 SMs: 52 idle), which these split.
        C(16, (128, 128, 64), (1, 1), "cooperative", (), "streamk-all"),
        C(17, (128, 256, 64), (1, 1), "cooperative", (), "streamk-all"),
        C(18, (128, 64, 64), (1, 1), "cooperative", (), "streamk-all"),
        # Ids 102, 103 named AG 0's and AG 14's tiles (2x1 cluster) with stream-K on every shape, for the wide
        # layers at 1024 rows (3.2-6.3 waves of whole tiles, the last one partly idle): on an H100 the best
        # stream-K tile (these, AG 14, 16, 17) was slower than the served persistent one on all 54 AG shapes of
        # 256-4096 rows, 1.00-2.45x its time (the worse of loop and graph; geometric mean 1.18;
        # bench/results/fused_gemm-h100-ag-streamk.json, -streamk-4096.json); removed.
        # A tile width between 128 and 64 for narrow layers at 1024 rows: 1024 x 1280 is 112 tiles of
        # 128x96 on 132 SMs (80 of 128x128, 160 of 128x64); its cooperative twin is AG 29.
        C(20, (128, 96, 64), (2, 1), "pingpong", ()),
        # Cooperative tiles whose width makes whole waves of SMs on the narrow layers (two consumer
        # warp groups of 64 rows: N / 2 accumulators per thread, where a ping-pong consumer holds N):
        # 1280 = 8 x 160 = 16 x 80, 2304 / 4608 = 16 / 32 x 144, 2560 / 5120 = 16 / 32 x 160,
        # 3584 / 7168 = 16 / 32 x 224, 768 / 1536 / 3072 = 8 / 16 / 32 x 96; 128-row tiles then
        # give 8 x 16 = 128 tiles at 1024 rows on 132 SMs. Each K step is one warpgroup MMA of the
        # tile's full width (setup.py enables CUTLASS's extended MMA shapes). The epilogue's subtile
        # is gcd(32, N) columns (16 for 80 and 144: a wider one does not divide the accumulator
        # fragments).
        C(25, (128, 160, 64), (2, 1), "cooperative", O),  # fp32 output: AG 41-42's GEMM
        C(26, (128, 160, 64), (1, 1), "cooperative", ()),
        C(27, (128, 144, 64), (2, 1), "cooperative", ()),
        C(28, (128, 224, 64), (2, 1), "cooperative", H),
        C(29, (128, 96, 64), (2, 1), "cooperative", H + O),  # fp32 output: AG 35-37's GEMM
        C(30, (128, 80, 64), (2, 1), "cooperative", ()),
        # 13312 / 26624 / 53248 = 64 / 128 / 256 x 208: on an H100 at 256 and 1024 rows of those layers (K = 16384)
        # 0.92-0.98x cuBLAS on five of the six where the served tiles took 0.98-1.04x (the worse of loop and graph;
        # bench/results/fused_gemm-h100-ag-streamk.json); served there since, 0.94-1.03x on another H100
        # (bench/results/fused_gemm-h100-ag-31-82b22a2.json).
        C(31, (128, 208, 64), (2, 1), "cooperative", H),
        # Split-K, as cuBLAS runs the narrow layers at 256 rows (256 x 8192 x 1280: 2 x 20 tiles of
        # 128x64 leave 92 of 132 SMs idle for a 128-step K loop): the tiles times the slices fill
        # a wave, each slice a quarter or half of K, without stream-K's workspace memset and
        # in-kernel serial reduction. The configurations sharing a tile share one instantiation
        # (its fp32-output GEMM); the slice count is the launch's.
        C(32, (128, 64, 64), (1, 1), "pingpong", ALL, "splitk", 2),
        C(33, (128, 64, 64), (1, 1), "pingpong", ALL, "splitk", 4),
        C(34, (128, 64, 64), (1, 1), "pingpong", ALL, "splitk", 8),
        C(35, (128, 96, 64), (2, 1), "cooperative", ALL, "splitk", 2),
        C(36, (128, 96, 64), (2, 1), "cooperative", ALL, "splitk", 4),
        C(37, (128, 96, 64), (2, 1), "cooperative", ALL, "splitk", 8),
        C(38, (128, 128, 64), (2, 1), "pingpong", (), "splitk", 2),
        C(39, (128, 128, 64), (2, 1), "pingpong", (), "splitk", 4),
        C(40, (128, 144, 64), (2, 1), "cooperative", (), "splitk", 4),
        C(41, (128, 160, 64), (2, 1), "cooperative", ALL, "splitk", 2),
        C(42, (128, 160, 64), (2, 1), "cooperative", ALL, "splitk", 4),
        # Clusters along N (1x2: two CTAs of one row of tiles, A multicast to both) and 2x2. The
        # operands' L2 -> SM traffic is M*N*K*2 bytes * (1 / (tile_n * cluster_n) + 1 / (tile_m *
        # cluster_m)): narrow tiles re-read A once per column of tiles, so a cluster along N halves
        # the larger term (1024 x 8192 x 1280 in 128x80 tiles: 436 MB with 1x1, 353 with 2x1, 302
        # with 1x2, 219 with 2x2). Measured no faster (bench/results/fused_gemm-h200-*-cluster-n*.json):
        # that traffic is not what limits these tiles. Kept, built by name, to reproduce the runs.
        C(43, (128, 64, 64), (1, 2), "pingpong", ()),
        C(44, (128, 80, 64), (1, 2), "cooperative", ()),
        C(45, (128, 96, 64), (1, 2), "cooperative", ()),
        C(46, (128, 144, 64), (1, 2), "cooperative", ()),
        C(47, (128, 160, 64), (1, 2), "cooperative", ()),
        C(48, (128, 192, 64), (1, 2), "cooperative", ()),
        C(49, (128, 224, 64), (1, 2), "cooperative", ()),
        C(50, (128, 128, 64), (2, 2), "cooperative", ()),
        C(51, (128, 256, 64), (2, 2), "cooperative", ()),
        C(52, (128, 80, 64), (2, 2), "cooperative", ()),
        C(53, (128, 160, 64), (1, 2), "cooperative", (), "splitk", 2),
        C(54, (128, 160, 64), (1, 2), "cooperative", (), "splitk", 4),
        C(55, (128, 96, 64), (1, 2), "cooperative", (), "splitk", 2),
        C(56, (128, 96, 64), (1, 2), "cooperative", (), "splitk", 4),
        C(57, (128, 64, 64), (1, 2), "pingpong", (), "splitk", 2),
        C(58, (128, 64, 64), (1, 2), "pingpong", (), "splitk", 4),
        # Split-K on AG 60's tile (64x96, 2x1 ping-pong) for the narrowest 256-row layers: 256 x 4096 x 1536 is
        # 64 tiles of 64x96 for 132 SMs (AG 60 served there at 1.25-1.4x cuBLAS on H100s), 128 CTAs in 2 slices;
        # 256 x 4096 x 768 is 32 tiles, 128 CTAs in 4. Best on no 256-row shape on one H100 (1.27x cuBLAS in graph
        # timing at 256 x 4096 x 1536 against AG 60's 1.18: bench/results/fused_gemm-h100-ag-256-tiles-c52bc9e.json).
        C(104, (64, 96, 64), (2, 1), "pingpong", (), "splitk", 2),
        C(105, (64, 96, 64), (2, 1), "pingpong", (), "splitk", 4),
        # 64-row tiles N / 32 wide: at 256 rows 4 x 32 = 128 tiles for 132 SMs, one whole wave with no slice of K,
        # as cuBLAS's 64x96 on 256 x 3072: 1536 = 32 x 48, 2560 = 32 x 80, 3584 = 32 x 112, 7168 = 32 x 224 (AG 60,
        # 75 and 2 served there at 1.06-1.42x cuBLAS on H100s; the epilogue subtile 16 columns, 32 for 224). Timed
        # once at 256 rows on one H100 (the file above, graph timing): 107 and 108 best on the shapes they were cut for
        # (256 x 8192 x 2560: 1.13x cuBLAS against AG 60's 1.18; 256 x 4096 x 3584: 1.09 against AG 75's 1.16) and no
        # other; 106 and 109 on none. A second H100 (bench/results/fused_gemm-h100-ag-107-108-cdb2236.json): 108 again
        # best at 256 x 4096 x 3584 (1.10 against 1.18), 107 within 1% of AG 60 at 256 x 8192 x 2560, neither best at
        # 1024 rows. On an H200 (bench/results/fused_gemm-h200-ag-107-108-7550bdd.json) 108 again best there (1.08
        # against AG 75's 1.15), 107 again within 1% of AG 60. Built by name: in the default build (bf16, fp16) 108
        # would make the build's units 13, about a minute more of a 2-core install, for one shape of 72.
        C(106, (64, 48, 64), (2, 1), "pingpong", ()),
        C(107, (64, 80, 64), (2, 1), "pingpong", ()),
        C(108, (64, 112, 64), (2, 1), "pingpong", ()),
        C(109, (64, 224, 64), (2, 1), "pingpong", ()),
        # cuBLAS's tiles on layers it runs faster (its kernel names under the profiler, in this
        # table's terms): 128x176 with a 2x1 cluster at 1024 rows of N = 14336 (82 columns x 8 rows
        # = 4.97 waves of 132 SMs), and 64x96 with a 2x1 cluster on 256 x 3072 and 1024 x 768 (4 x 32
        # and 16 x 8 tiles: 128). Not its 128x168 (1024 x 26624): an 8-column epilogue subtile
        # does not compile.
        C(59, (128, 176, 64), (2, 1), "cooperative", ()),
        C(60, (64, 96, 64), (2, 1), "pingpong", H, loads="multicast-first"),  # (ids 94-101 below)
        C(61, (64, 96, 64), (1, 1), "pingpong", ()),
        C(62, (64, 128, 64), (2, 1), "pingpong", ()),
        # Ping-pong tiles wider than 128 columns: each consumer warp group holds a whole 128 x N tile
        # (N fp32 accumulators per thread, within the 232 registers CUTLASS gives a ping-pong
        # consumer up to N = 192), so one group's epilogue runs while the other's MMAs do, where a
        # cooperative tile's epilogue stalls both groups. cuBLAS's own kernels on the narrow and
        # 1024-row layers are of this kind (128x176, 128x80; its cooperative kernels are marked so).
        # Ids 63-70 named configurations of earlier measurements, since removed.
        C(71, (128, 176, 64), (2, 1), "pingpong", ()),
        C(72, (128, 160, 64), (2, 1), "pingpong", H),
        C(73, (128, 192, 64), (2, 1), "pingpong", H),
        C(74, (128, 144, 64), (2, 1), "pingpong", H),
        C(75, (128, 80, 64), (2, 1), "pingpong", H, loads="multicast-first"),
        C(76, (128, 80, 64), (1, 2), "pingpong", ()),
        # Ids 77-82 (and RS 32, 33) named AG 0, 2, 72, 73, 5, 25 (RS 6, 4) with L2 eviction hints on the
        # mainloop's loads, measured slower and removed (bench/results/fused_gemm-h200-*-l2hint.json).
        # Ids 83-90 named two kinds of tile measured slower and removed: split-K in 2 / 4 of the 128x80
        # ping-pong tile (83, 84; each consumer warp group its own slice where the whole tile leaves one
        # idle): 1.40-1.99x cuBLAS on the narrow 1024-row layers, where the whole tile ran 1.05-1.55x
        # (bench/results/fused_gemm-h200-ag-splitk80.json); K steps of 128 in place of 64 (85-90, twins of
        # AG 75, 20, 2, 60, 74, 72): 1.02-1.13x their twins' time (geometric means over 54 shapes), their
        # fewer stages outweighing the halved barrier waits (bench/results/fused_gemm-h200-ag-k128.json).
        # Id 91 named the 128x96 ping-pong tile with a 1x2 cluster, cuBLAS's kernel at 1024 x 4096 x 1536
        # (bench/results/fused_ncu-h200-misses.json): 1.06 / 1.25x cuBLAS there (loop / graph) against AG 29's
        # 0.97 / 1.12, and slower than the served tile on all seven narrow layers timed
        # (bench/results/fused_gemm-h200-ag-91.json); removed.
        # Ids 92, 93 named AG 60's and AG 75's tiles with a 2x2 cluster (A multicast along N as well as the
        # weight along M: 0.71x and 0.62x their L2 -> SM bytes): correct, 1.1-1.6x the 2x1 tiles' time on
        # the narrow 1024-row layers, ties at 256 rows of N = 768 and 3584 (bench/results/fused_gemm-h100-ag-2x2.json);
        # removed.
        # Ids 94-101 named the twins of AG 60, 75, 73, 28, 72, 0, 2 and 74 whose producer issues each stage's
        # multicast load (the weight, shared by the 2x1 cluster) before A's, the order of cuBLAS's kernels on
        # the narrow layers (CUTLASS issues A first). On an H100 (bench/results/fused_gemm-h100-ag-mcfirst*.json)
        # AG 75's twin took 0.94-1.02x its time (geometric mean about 0.97, two runs), AG 60's 0.98-1.01x, the
        # others 0.98-1.04x (geometric means 0.99-1.00) on the layers where they are served: AG 60 and 75 took
        # that order, the twins were removed.
        # Swapped operands (out^T = weight @ a^T), the order of cuBLAS's kernels on these layers: tiles of 32 and
        # 64 rows without padding the MMA's 64-row side (256 x 4096 x 1536: 8 x 12 tiles of 32x128), their
        # split-K for the fewest tiles, and cuBLAS's 128x256 tile of the big layers with its 2x1 cluster (the
        # weight multicast to the two CTAs of one column of tiles). Built by name: on an H100 at 256 and 1024 rows
        # none was faster than the served tile, 1.00-1.77x its time (the worse of loop and graph;
        # bench/results/fused_gemm-h100-ag-swapped-small-7e57d9e.json): each row of tiles re-reads the weight.
        C(110, (32, 128, 64), (1, 1), "cooperative", (), operands="swapped"),
        C(111, (64, 128, 64), (1, 1), "cooperative", (), operands="swapped"),
        C(112, (64, 64, 64), (1, 1), "pingpong", (), operands="swapped"),
        C(113, (128, 256, 64), (2, 1), "cooperative", (), operands="swapped"),
        C(114, (32, 64, 64), (1, 1), "pingpong", (), operands="swapped"),
        C(115, (32, 128, 64), (1, 1), "cooperative", (), "splitk", 2, operands="swapped"),
        C(116, (32, 128, 64), (1, 1), "cooperative", (), "splitk", 4, operands="swapped"),
    ),
    "rs": (
        # cuBLAS's tile from 512 rows per rank. Under warmed-up timing, with bands of up to 8 M tiles
        # (bench/results/fused_gemm-h200-rs-wide.json, 512-8192 rows per rank; the worse of loop and
        # graph against cuBLAS, each configuration's best band): where K >= 7168 and the rows per rank
        # >= 2048, 1.00-1.04x against RS 6's 0.99-1.10x, faster on 9 of those 10 shapes (the epilogue
        # is a small share there); 1.09-1.62x RS 6's time where K <= 2048 (the cooperative epilogue,
        # adding the peer's partial, does not overlap the MMAs). Built by default since then.
        # Its epilogue loads 3 of the next tile's 8 source subtiles during the mainloop, CUTLASS's buffers 2
        # (source="ahead": 0.97x the time over the RS shapes of 512-8192 rows per rank on an H100, 0.90-1.02
        # per shape and band; bench/results/fused_gemm-h100-rs-ahead.json, as id 40).
        C(0, (128, 256, 64), (2, 1), "cooperative", H, source="ahead"),
        C(1, (256, 128, 64), (2, 1), "cooperative", ()),
        C(2, (256, 128, 64), (1, 2), "cooperative", ()),  # cuBLAS's shape on big GEMMs
        C(3, (128, 128, 64), (1, 1), "cooperative", ("bf16", "fp16", "bf16_fp32")),  # the general-purpose one
        C(4, (64, 256, 64), (1, 1), "pingpong", ()),  # 128..512 rows per rank; wide N from 1024 rows
        C(5, (64, 128, 64), (1, 1), "pingpong", H),  # few rows per rank
        C(6, (128, 128, 64), (2, 1), "pingpong", H),
        C(7, (128, 192, 64), (1, 1), "cooperative", ()),
        C(8, (128, 128, 64), (1, 1), "cooperative", (), "streamk"),
        C(9, (128, 256, 64), (1, 1), "cooperative", (), "streamk"),
        C(10, (128, 128, 64), (2, 1), "cooperative", (), "streamk"),
        C(11, (128, 64, 64), (1, 1), "cooperative", (), "streamk"),  # as AG 15
        C(12, (128, 128, 64), (1, 1), "cooperative", (), "streamk-all"),  # as AG 16
        # Split-K (as AG 32-42) for 128-512 rows per rank and deep K: 128 x 4096 is 32 tiles of 128x128.
        C(13, (128, 128, 64), (1, 1), "cooperative", (), "splitk", 2),
        C(14, (128, 128, 64), (1, 1), "cooperative", (), "splitk", 4),
        C(15, (64, 128, 64), (1, 1), "pingpong", (), "splitk", 2),
        C(16, (64, 128, 64), (1, 1), "pingpong", (), "splitk", 4),
        C(17, (128, 256, 64), (1, 1), "cooperative", (), "splitk", 2),
        C(18, (128, 256, 64), (1, 1), "cooperative", (), "splitk", 4),
        # Clusters along N (as AG 43-58): few rows per rank make many columns of tiles re-reading A.
        C(19, (128, 128, 64), (1, 2), "cooperative", ()),
        C(20, (64, 128, 64), (1, 2), "pingpong", ()),
        C(21, (128, 128, 64), (1, 2), "pingpong", ()),
        C(22, (128, 128, 64), (2, 2), "pingpong", ()),
        C(23, (128, 128, 64), (1, 2), "cooperative", (), "splitk", 2),
        C(24, (128, 128, 64), (1, 2), "cooperative", (), "splitk", 4),
        C(25, (64, 128, 64), (1, 2), "pingpong", (), "splitk", 2),
        C(26, (64, 128, 64), (1, 2), "pingpong", (), "splitk", 4),
        # cuBLAS's tile at 128 rows per rank and fewer (128 x 7168 x 4096: 2 x 64 tiles of 64x64, 13
        # stages), the cluster along N (A multicast: 32 and 64 rows, one tile row) or along M (B
        # multicast: 128 rows). bench/results/fused_gemm-h200-rs-64x64.json: at 128 rows per rank the
        # best configuration against mm + add went from 0.86-1.18x to 0.79-1.06x in graph timing. As
        # AG tiles at 256 rows (1x2 and 2x1) they were best on 1 of the 18 shapes, by 4%: not kept
        # (bench/results/fused_gemm-h200-ag-64x64.json).
        C(27, (64, 64, 64), (1, 2), "pingpong", H),
        C(28, (64, 64, 64), (2, 1), "pingpong", H),
        # Ping-pong tiles wider than 128 columns (as AG 71-74): one warp group's epilogue, adding the
        # peer's partial, runs while the other's MMAs do.
        C(29, (128, 176, 64), (2, 1), "pingpong", ()),
        C(30, (128, 160, 64), (2, 1), "pingpong", ()),
        C(31, (128, 192, 64), (2, 1), "pingpong", ()),
        # Ids 34-36 named K steps of 128 (twins of RS 6, 5, 27), measured and removed as AG 85-90:
        # 1.12x, 1.06x and 0.98x their twins' time, the best per shape unchanged in graph timing
        # (bench/results/fused_gemm-h200-rs-k128.json).
        # cuBLAS's tile at 128 rows per rank where N >= 8192 (128 x 14336 x 8192: 2 x 64 tiles of 64x128
        # with the cluster along M, so the weight is multicast; bench/results/fused_ncu-h200-cluster.json):
        # RS 5's tile with RS 28's cluster. bench/results/fused_gemm-h200-rs-64x128.json (32-512 rows per
        # rank): the best configuration on 8 of 36 shapes in graph timing; against mm then add, shapes not
        # faster 6 -> 4 (128 x 14336 x 8192: 1.048 -> 0.974, 256 x 3584 x 4096: 1.026 -> 0.930).
        C(37, (64, 128, 64), (2, 1), "pingpong", H),
        # Ids 38-41 named twins of RS 0 and 6 whose epilogue loads more of the next tile's source during its
        # mainloop, measured and removed (bench/results/fused_gemm-h100-rs-prefetch.json, -rs-ahead.json):
        # all 8 subtiles at the cost of a mainloop stage (38, 39: 0.99x and 1.02x their twins' time), or
        # those the stages leave room for (40, 41: 0.97x and 0.99x). RS 0 took the last (source="ahead").
        # Swapped operands (as AG 110-116): 32-row tiles for 32-128 rows per rank, and cuBLAS's 128x256 tile
        # with its 2x1 cluster on the big layers. On an H100 (bench/results/fused_gemm-h100-rs-swapped-small-7e57d9e.json)
        # RS 46 ran 32 and 64 rows per rank at 0.997-1.005x cuBLAS in graph timing where the served 64-row tiles took
        # up to 1.17x (0.82-0.98x mm then add); RS 42-44 and 47-48 were best on no shape by more than 1%, RS 45 4-8%
        # slower than RS 0 and 6 (bench/results/fused_gemm-h100-rs-swapped-big-7e57d9e.json). RS 46 is built by default
        # (bf16, fp16; the analytic choice rates it where M fits two of its tile rows: flux/autotune/kernels.py),
        # the others by name.
        C(42, (32, 128, 64), (1, 1), "cooperative", (), operands="swapped"),
        C(43, (64, 128, 64), (1, 1), "cooperative", (), operands="swapped"),
        C(44, (64, 64, 64), (1, 1), "pingpong", (), operands="swapped"),
        C(45, (128, 256, 64), (2, 1), "cooperative", (), operands="swapped"),
        C(46, (32, 64, 64), (1, 1), "pingpong", H, operands="swapped"),
        C(47, (32, 128, 64), (1, 1), "cooperative", (), "splitk", 2, operands="swapped"),
        C(48, (32, 128, 64), (1, 1), "cooperative", (), "splitk", 4, operands="swapped"),
    ),
}
OPS = tuple(CONFIGS)
SCHEDULERS = ("persistent", "streamk", "streamk-all", "splitk")
SOURCES = ("auto", "ahead")
OPERANDS = ("ab", "swapped")
MAX_SPLITS = 16
SPLIT_K_MAX_PARTIALS = 1 << 30  # bytes

# The grouped GEMMs of the MoE experts (csrc/moe/grouped_gemm.cuh; flux.grouped_mm with
# impl="cutlass"): CUTLASS sm90 ptr-array kernels, bf16, one instantiation per (configuration,
# kind). Kinds: "nk" / "kn" (rows grouped by expert times a [E, N, K] / [E, K, N] weight: the
# forward and the input gradient) and "wgrad" (the weight gradient, K grouped).
GROUPED_KINDS = ("nk", "kn", "wgrad")  # index = the C++ kind id


class GroupedConfig(NamedTuple):
    id: int
    tile: tuple  # (M, N, K) elements
    cluster: tuple  # (cluster_m, cluster_n) CTAs
    schedule: str  # "cooperative" | "pingpong"
    default: tuple  # kinds built by default

    def describe(self):
        m, n, k = self.tile
        return f"{m}x{n}x{k} tile, cluster {self.cluster[0]}x{self.cluster[1]}, {self.schedule}"


# Chosen over an H200 measurement against torch._grouped_mm on the MoE layer's products
# (bench/bench_grouped_mm.py; flux/ops/grouped_mm.py's rule picks among the built ones).
GROUPED = (
    GroupedConfig(0, (64, 256, 64), (1, 1), "pingpong", ("nk", "kn")),  # <= 1024 rows per expert
    GroupedConfig(1, (128, 256, 64), (1, 1), "cooperative", ()),
    GroupedConfig(2, (128, 128, 64), (2, 1), "pingpong", ("wgrad",)),  # wgrad, > 256 rows per expert
    GroupedConfig(3, (128, 256, 64), (2, 1), "cooperative", ("wgrad",)),  # wgrad, <= 256 rows per expert
)


def _check_schedulers():
    for op, cfgs in CONFIGS.items():
        for c in cfgs:  # CUTLASS's sm90 ping-pong kernel has no stream-K variant
            if c.scheduler not in SCHEDULERS or (c.scheduler.startswith("streamk") and c.schedule != "cooperative"):
                raise ValueError(f"flux.fused_configs: {op} configuration {c.id}: bad scheduler {c.scheduler!r}")
            if c.source not in SOURCES or (c.source != "auto" and (op != "rs" or c.scheduler == "splitk")):
                raise ValueError(f"flux.fused_configs: {op} configuration {c.id}: source {c.source!r} (\"ahead\": "
                                 f"rs configurations that add the source in their epilogue)")
            rows, cols = c.tile[0], c.tile[1]
            if c.operands not in OPERANDS or (c.operands == "swapped" and (
                    c.scheduler.startswith("streamk") or c.loads != "cutlass" or rows % 8 or not 8 <= rows <= 256
                    or cols % (128 if c.schedule == "cooperative" else 64))):
                raise ValueError(f"flux.fused_configs: {op} configuration {c.id}: operands {c.operands!r} (swapped: "
                                 f"persistent or split-K, CUTLASS's loads, 8..256 rows in steps of 8, columns a "
                                 f"multiple of 128 cooperative or 64 ping-pong)")
            if (c.scheduler == "splitk") != (c.splits > 1) or not 1 <= c.splits <= MAX_SPLITS:
                raise ValueError(f"flux.fused_configs: {op} configuration {c.id}: splits {c.splits} "
                                 f"with scheduler {c.scheduler!r} (split-K: 2..{MAX_SPLITS} slices)")
        # Tuned choices name a configuration by tile, cluster, schedule and scheduler
        # (flux.autotune.kernel_configs.KernelConfig.desc), not by how its mainloop issues its loads or its
        # epilogue stages the source: two configurations alike in those would share cached choices.
        seen = {}
        for c in cfgs:
            key = (c.tile, c.cluster, c.schedule, c.scheduler, c.splits, c.operands)
            if key in seen:
                raise ValueError(f"flux.fused_configs: {op} configurations {seen[key]} and {c.id} differ only in "
                                 f"their loads ({c.loads!r}) or source ({c.source!r}); cached choices could not tell "
                                 f"them apart")
            seen[key] = c.id


_check_schedulers()


def config(op, cid):
    """The configuration ``cid`` of ``op`` ("ag" or "rs"), or None."""
    for c in CONFIGS.get(op, ()):
        if c.id == cid:
            return c
    return None


def _expand_grouped(term):
    """The (config id, kind) pairs of the grouped GEMMs a FLUX_KERNELS term names."""
    if term == "all":
        return {(c.id, k) for c in GROUPED for k in GROUPED_KINDS}
    if term == "default":
        return {(c.id, k) for c in GROUPED for k in c.default}
    if term != "gmm" and not term.startswith("gmm:"):
        return set()
    parts = term.split(":")
    cid, kind = (parts[1:] or ["*"])[0], (parts[2:] or ["*"])[0]
    ids = [c.id for c in GROUPED] if cid == "*" else [int(cid)] if cid.isdigit() else [-1]
    kinds = GROUPED_KINDS if kind == "*" else [kind]
    if len(parts) > 3 or any(i not in {c.id for c in GROUPED} for i in ids) or any(
            k not in GROUPED_KINDS for k in kinds):
        raise ValueError(f"FLUX_KERNELS: {term!r} names no grouped GEMM (gmm:id[:kind], ids "
                         f"{[c.id for c in GROUPED]}, kinds {GROUPED_KINDS})")
    return {(i, k) for i in ids for k in kinds}


def _expand(term):
    if term == "gmm" or term.startswith("gmm:"):
        _expand_grouped(term)  # checked; built by select_grouped
        return set()
    if term == "all":
        return {(op, c.id, d) for op in OPS for c in CONFIGS[op] for d in DTYPES}
    if term == "default":
        return {(op, c.id, d) for op in OPS for c in CONFIGS[op] for d in c.default}
    if term == "minimal":
        return {(op, 0, "bf16") for op in OPS}
    if term in ("streamk", "splitk"):
        return {(op, c.id, "bf16") for op in OPS for c in CONFIGS[op] if c.scheduler.startswith(term)}
    parts = term.split(":")
    if not 1 <= len(parts) <= 3 or parts[0] not in OPS:
        raise ValueError(f"FLUX_KERNELS: bad term {term!r} (default, all, minimal, streamk, splitk, op:id[:dtype] "
                         f"with op in {OPS}, or gmm:id[:kind])")
    op, cid, dt = parts[0], (parts[1:] or ["*"])[0], (parts[2:] or ["*"])[0]
    ids = [c.id for c in CONFIGS[op]] if cid == "*" else [int(cid)]
    dts = DTYPES if dt == "*" else [dt]
    out = set()
    for i in ids:
        if config(op, i) is None or any(d not in DTYPES for d in dts):
            raise ValueError(f"FLUX_KERNELS: {term!r} names no configuration (ops {OPS}, dtypes {DTYPES})")
        out.update((op, i, d) for d in dts)
    return out


def select(spec="default"):
    """The (op, config id, dtype) triples a FLUX_KERNELS value builds, sorted."""
    out = set()
    for term in (spec or "default").replace(" ", "").split(","):
        if term:
            out |= _expand(term)
    return sorted(out, key=lambda t: (OPS.index(t[0]), t[1], DTYPES.index(t[2])))


def select_grouped(spec="default"):
    """The (config id, kind) grouped GEMM instantiations a FLUX_KERNELS value builds, sorted."""
    out = set()
    for term in (spec or "default").replace(" ", "").split(","):
        if term:
            _expand(term)  # every term checked as for the fused kernels
            out |= _expand_grouped(term)
    return sorted(out, key=lambda t: (t[0], GROUPED_KINDS.index(t[1])))


def grouped_config(cid):
    """The grouped GEMM configuration ``cid``, or None."""
    return next((c for c in GROUPED if c.id == cid), None)


def grouped_kernel_name(cid, kind):
    return f"gmm_c{cid}_{kind}"


def grouped_built():
    """The (config id, kind) grouped GEMMs compiled into flux._C (empty without it)."""
    import torch

    from flux.runtime.extension import extension_error

    if extension_error() is not None:
        return frozenset()
    try:
        text = torch.ops.flux.grouped_kernels_built()
    except (AttributeError, RuntimeError):
        return frozenset()
    return frozenset((int(i.split(":")[1]), i.split(":")[2]) for i in text.split())


def kernel_name(op, cid, dtype):
    """The C++ launcher (and generated file stem) of one instantiation. Split-K configurations of
    one tile, cluster and schedule share the launcher of their fp32-output GEMM for the input
    dtype (the slice count and the output dtype are its arguments)."""
    c = config(op, cid)
    if c is not None and c.scheduler == "splitk":
        (tm, tn, tk), (cm, cn) = c.tile, c.cluster
        sched = "pp" if c.schedule == "pingpong" else "coop"
        sw = "_sw" if c.operands == "swapped" else ""
        return f"{op}_split_{tm}x{tn}x{tk}_{cm}x{cn}_{sched}{sw}_{DTYPE_IO[dtype][0]}"
    return f"{op}_fused_c{cid}_{dtype}"


def parse_built(text):
    """``torch.ops.flux.fused_kernels_built()``'s string ("ag:0:bf16 rs:3:fp16 ...") as a set of triples."""
    out = set()
    for item in text.split():
        op, cid, dt = item.split(":")
        out.add((op, int(cid), dt))
    return frozenset(out)


def built():
    """The (op, config id, dtype) kernels compiled into flux._C (empty without it, or with a
    flux._C older than this table)."""
    import torch

    from flux.runtime.extension import extension_error

    if extension_error() is not None:
        return frozenset()
    try:
        return parse_built(torch.ops.flux.fused_kernels_built())
    except (AttributeError, RuntimeError):
        return frozenset()
