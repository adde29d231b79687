// The `local` strategy of flux.moe_dispatch / flux.moe_combine (flux/ops/moe/local.py): every
// expert on this GPU (one rank), so a dispatch is a permutation of rows into the expert-major
// layout and a combine the weighted gather back. Kernels, each over the (token, slot) pairs
// p = t * K + k or over the rows of recv_x:
//
//   layout   count_kernel  (one block per P pairs)    per-block, per-expert counts + verdict bits
//                          (P = 256, or the whole tokens within 256: below)
//            scan_kernel   (one block)                exclusive scans: blocks within an expert,
//                                                     experts (unbounded) -> counts, verdict
//            place_kernel  (one block per 256 pairs)  pair_row[p] (its row, -1: none) and
//                                                     send_pairs[row] = p
//   move     scatter_rows_kernel  recv_x[pair_row[t, k]] = x[t], token-major (zeros for padding rows)
//   bounded  bounded_rows_kernel  scan + place + move of a bounded dispatch in one launch (below)
//   combine  combine_kernel       out[t] = sum_k w[t, k] * y[pair_row[t, k]]  (fp32, k = 0 first)
//   backward combine_bwd_kernel   dy[pair_row[t, k]] = w[t, k] * dout[t], dw[t, k] = <dout[t], that row of y>
//
// Row order within an expert is pair order (token, then slot): a pair's rank among its block's
// pairs of the same expert comes from __match_any_sync per warp and a scan over the block's warps
// (block_rank); the blocks' offsets from the column sums of the count blocks before it. So the
// layout is the stable sort by expert that the reference strategy makes, bit for bit, and every
// kernel is deterministic (integer sums in any order are the same sums).
//
// Bounded (capacity C >= 0): expert e's rows are e * C .. e * C + counts[e] - 1 of [E * C] rows;
// the rest are padding (send_pairs = T * K, zero rows when zero_pad). Any verdict bit (an id outside
// [-1, E), an expert twice in a token, or the caller's host_code) makes every count zero and every
// pair rowless: nothing moves, recv_x is zeros, combine gives zeros.
//
// A bounded dispatch takes two launches where blocks * E <= kFusedCounts: count_kernel, then
// bounded_rows_kernel, whose every block reads all the count blocks' counts and codes (L2 / L1
// resident at that size) and derives what scan_kernel would give it: the verdict, the experts'
// totals and its count block's offsets (bounded starts are e * C, so no scan over the experts).
// Blocks come in `split` parts per count block, so that the copy has about as many blocks as the
// rows need, whatever P; each part ranks the count block's pairs again (P index reads) and copies
// its share of the tokens. There, P = 256 - 256 % K: a count block holds whole tokens, so each
// token's row is read once even where K does not divide 256. No block waits for another (nothing
// to deadlock, no counter kept across calls: safe in CUDA graphs and on any stream). The redundant
// reads cost grid * blocks * E ints, bounded through kFusedCounts; past it (and unbounded) the
// three layout kernels run, and bounded the row kernel after them.
//
// The code bits match flux/ops/moe/handle.py: 2 bad id, 4 duplicate; host_code carries the others.
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <cub/block/block_scan.cuh>

#include <unordered_map>

#include "common/check.h"
#include "moe/launch.h"
#include "ops.h"

namespace flux {
namespace {

constexpr int kPairsPerBlock = 256;  // layout blocks: one thread per pair (P <= this many used)
constexpr int kLayoutWarps = kPairsPerBlock / 32;
// scan_kernel: kScanItems experts per thread. A block of T threads gets 65536 / T registers per
// thread at most; 512 threads (128 each) hold the kernel's without spilling, where 1024 threads
// (64 each) do not fit it (a launch failure unbounded, spills under __launch_bounds__).
constexpr int kScanThreads = 512;
constexpr int kScanItems = 2;
constexpr int kScanBatch = 4;  // scan_kernel: count blocks a lane loads before scanning them (32 per step)
constexpr int64_t kMaxLocalExperts = kScanThreads * kScanItems;
constexpr int kRowThreads = 128;  // scatter_rows_kernel
// bounded_rows_kernel: at most this many block counts (blocks * E ints, 64 KB), read by every block.
constexpr int64_t kFusedCounts = 16384;
constexpr int kFusedBlocksPerSm = 8;  // its grid: about this many blocks of kPairsPerBlock per SM
constexpr int kCombineThreads = 256;  // combine_kernel, combine_bwd_kernel (at most)
constexpr int kBadId = 2, kDuplicate = 4;

// The expert of pair p, or -1 (an empty slot, a pair past the end, or a bad id, which sets its
// verdict bit in *code when code is given; so do duplicates).
template <typename Idx>
__device__ __forceinline__ int pair_expert(const Idx* __restrict__ idx, int64_t p, int64_t n, int k,
                                           int64_t num_experts, int* code) {
  if (p >= n) return -1;
  const int64_t e = static_cast<int64_t>(idx[p]);
  if (e < -1 || e >= num_experts) {
    if (code != nullptr) atomicOr(code, kBadId);
    return -1;
  }
  if (e < 0) return -1;
  if (code != nullptr) {
    for (int64_t j = p - p % k; j < p; ++j) {
      if (static_cast<int64_t>(idx[j]) == e) {
        atomicOr(code, kDuplicate);
        break;
      }
    }
  }
  return static_cast<int>(e);
}

// ORs the count blocks' verdict bits into *s_code (shared memory), a stride of blocks per thread.
__device__ __forceinline__ void or_block_codes(const int* __restrict__ blk_code, int blocks, int* s_code) {
  int code = 0;
  for (int b = threadIdx.x; b < blocks; b += blockDim.x) code |= blk_code[b];
  if (code) atomicOr(s_code, code);
}

// The rank of this thread's pair (expert e; -1: none, rank -1) among the earlier pairs of its
// block routed to e: within the warp from __match_any_sync, then the warps before it through
// s_warp [kLayoutWarps, E] (counts per warp, then their exclusive sums over the warps). Every
// thread of the block calls it (it holds barriers); s_warp is free again once every thread has
// returned (a barrier of the caller's).
__device__ __forceinline__ int block_rank(int e, int num_experts, int* s_warp) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int i = threadIdx.x; i < kLayoutWarps * num_experts; i += blockDim.x) s_warp[i] = 0;
  __syncthreads();
  const unsigned peers = __match_any_sync(0xffffffffu, e);  // lanes of this warp with the same expert
  const int in_warp = __popc(peers & ((1u << lane) - 1u));
  if (e >= 0 && in_warp == 0) s_warp[warp * num_experts + e] = __popc(peers);
  __syncthreads();
  for (int x = threadIdx.x; x < num_experts; x += blockDim.x) {
    int run = 0;
    for (int w = 0; w < kLayoutWarps; ++w) {
      const int c = s_warp[w * num_experts + x];
      s_warp[w * num_experts + x] = run;
      run += c;
    }
  }
  __syncthreads();
  return e < 0 ? -1 : s_warp[warp * num_experts + e] + in_warp;
}

// The row of a pair at `place` within its expert (whose rows start at start_e), or -1 past the
// capacity (impossible when T <= C without duplicates, both checked: a bound on the writes).
__device__ __forceinline__ int64_t row_at(int64_t start_e, int64_t place, int64_t capacity) {
  return capacity >= 0 && place >= capacity ? -1 : start_e + place;
}

// blk_counts[b, e]: pairs of block b (pairs [b * per_block, (b + 1) * per_block), per_block <=
// kPairsPerBlock) routed to e; blk_code[b]: the block's verdict bits.
template <typename Idx>
__global__ void __launch_bounds__(kPairsPerBlock)
count_kernel(const Idx* __restrict__ idx, int64_t n, int k, int per_block, int num_experts,
             int* __restrict__ blk_counts, int* __restrict__ blk_code) {
  extern __shared__ int s_count[];  // [num_experts]
  __shared__ int s_code;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) s_count[e] = 0;
  if (threadIdx.x == 0) s_code = 0;
  __syncthreads();
  const int64_t p = static_cast<int64_t>(blockIdx.x) * per_block + threadIdx.x;
  const int e = threadIdx.x < per_block ? pair_expert(idx, p, n, k, num_experts, &s_code) : -1;
  if (e >= 0) atomicAdd(&s_count[e], 1);
  __syncthreads();
  int* out = blk_counts + static_cast<int64_t>(blockIdx.x) * num_experts;
  for (int x = threadIdx.x; x < num_experts; x += blockDim.x) out[x] = s_count[x];
  if (threadIdx.x == 0) blk_code[blockIdx.x] = s_code;
}

// One block of kScanThreads. blk_counts becomes each block's exclusive offset within its expert
// (one warp per expert at a time, 32 blocks per step); info[0, E) the counts, info[E] the verdict;
// start[e] the first row of expert e. send_pairs[0, pad_fill) filled with the padding value first
// (bounded: all E * C rows; unbounded at the worst case: all T * K; place_kernel, which runs
// after, writes the real rows).
__global__ void __launch_bounds__(kScanThreads)
    scan_kernel(int* __restrict__ blk_counts, const int* __restrict__ blk_code, int blocks, int num_experts,
                int64_t capacity, int host_code, int64_t* __restrict__ info, int64_t* __restrict__ start,
                int64_t* __restrict__ send_pairs, int64_t pad_value, int64_t pad_fill) {
  using Scan = cub::BlockScan<int64_t, kScanThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int64_t s_total[kMaxLocalExperts];
  __shared__ int s_code;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) s_code = host_code;
  __syncthreads();
  or_block_codes(blk_code, blocks, &s_code);
  for (int e = warp; e < num_experts; e += kScanThreads / 32) {
    int64_t run = 0;
    for (int b0 = 0; b0 < blocks; b0 += 32 * kScanBatch) {
      int c[kScanBatch];
#pragma unroll
      for (int j = 0; j < kScanBatch; ++j) {  // the loads first: one latency per batch, not per 32 blocks
        const int b = b0 + j * 32 + lane;
        c[j] = b < blocks ? blk_counts[static_cast<int64_t>(b) * num_experts + e] : 0;
      }
#pragma unroll
      for (int j = 0; j < kScanBatch; ++j) {
        const int b = b0 + j * 32 + lane;
        int incl = c[j];
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
          const int v = __shfl_up_sync(0xffffffffu, incl, d);
          if (lane >= d) incl += v;
        }
        if (b < blocks) blk_counts[static_cast<int64_t>(b) * num_experts + e] = static_cast<int>(run) + incl - c[j];
        run += __shfl_sync(0xffffffffu, incl, 31);
      }
    }
    if (lane == 0) s_total[e] = run;
  }
  __syncthreads();
  const bool failed = s_code != 0;
  // Experts blocked over the threads: thread i holds experts i * kScanItems + [0, kScanItems).
  int64_t total[kScanItems], excl[kScanItems];
#pragma unroll
  for (int i = 0; i < kScanItems; ++i) {
    const int e = threadIdx.x * kScanItems + i;
    total[i] = (e < num_experts && !failed) ? s_total[e] : 0;
  }
  Scan(scan_tmp).ExclusiveSum(total, excl);
#pragma unroll
  for (int i = 0; i < kScanItems; ++i) {
    const int e = threadIdx.x * kScanItems + i;
    if (e < num_experts) {
      info[e] = total[i];
      start[e] = capacity >= 0 ? e * capacity : excl[i];
    }
  }
  if (threadIdx.x == 0) info[num_experts] = s_code;
  for (int64_t r = threadIdx.x; r < pad_fill; r += blockDim.x) send_pairs[r] = pad_value;
}

// pair_row[p] and send_pairs[row]; nothing (every pair -1) when the verdict is nonzero. Blocks of
// kPairsPerBlock pairs (count_kernel's with per_block = kPairsPerBlock).
template <typename Idx>
__global__ void __launch_bounds__(kPairsPerBlock)
place_kernel(const Idx* __restrict__ idx, int64_t n, int k, int num_experts, int64_t capacity,
             const int* __restrict__ blk_off, const int64_t* __restrict__ info,
             const int64_t* __restrict__ start, int64_t* __restrict__ pair_row,
             int64_t* __restrict__ send_pairs) {
  extern __shared__ int s_warp[];  // [kLayoutWarps, num_experts] (block_rank)
  const int64_t p = static_cast<int64_t>(blockIdx.x) * kPairsPerBlock + threadIdx.x;
  if (info[num_experts] != 0) {  // uniform over the grid
    if (p < n) pair_row[p] = -1;
    return;
  }
  const int e = pair_expert(idx, p, n, k, num_experts, nullptr);
  const int rank = block_rank(e, num_experts, s_warp);
  if (p >= n) return;
  if (e < 0) {
    pair_row[p] = -1;
    return;
  }
  const int64_t place = static_cast<int64_t>(blk_off[static_cast<int64_t>(blockIdx.x) * num_experts + e]) + rank;
  const int64_t row = row_at(start[e], place, capacity);
  pair_row[p] = row;
  if (row >= 0) send_pairs[row] = p;
}

constexpr int kRowUnroll = 4;  // vectors of a row in flight per thread

// x's row `from` into out's rows rows[0, k) (-1: none), the block's threads over the row's
// vectors: the row is read once for its k copies. rows is the same for every thread (a broadcast
// load; global or shared memory).
template <typename Vec>
__device__ __forceinline__ void copy_to_rows(const Vec* __restrict__ from, const int64_t* rows, int k,
                                             int64_t vecs, Vec* __restrict__ out) {
  for (int64_t v0 = threadIdx.x; v0 < vecs; v0 += kRowUnroll * blockDim.x) {
    Vec buf[kRowUnroll];
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      const int64_t v = v0 + u * blockDim.x;
      if (v < vecs) buf[u] = from[v];
    }
    for (int j = 0; j < k; ++j) {
      const int64_t r = rows[j];
      if (r < 0) continue;
      Vec* to = out + r * vecs;
#pragma unroll
      for (int u = 0; u < kRowUnroll; ++u) {
        const int64_t v = v0 + u * blockDim.x;
        if (v < vecs) to[v] = buf[u];
      }
    }
  }
}

template <typename Vec>
__device__ __forceinline__ void zero_row(Vec* __restrict__ to, int64_t vecs) {
  Vec zero;
  memset(&zero, 0, sizeof(Vec));
  for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) to[v] = zero;
}

// The rows of a dispatch, token-major so that each token's row is read once (x is read once, each
// row of out written once: the HBM traffic of the permutation itself). Items, grid-stride, one
// per block at a time:
//   [0, tokens)                  token t: x[t] -> out[pair_row[t * k + j]] for each j with a row
//   [tokens, tokens + pad_rows)  (padded layouts, zero_pad) row r = item - tokens: zeros where
//                                send_pairs[r] is padding (not a pair of [0, tokens * k))
template <typename Vec>
__global__ void __launch_bounds__(kRowThreads)
scatter_rows_kernel(const Vec* __restrict__ src, const int64_t* __restrict__ pair_row,
                    const int64_t* __restrict__ send_pairs, int64_t tokens, int k, int64_t pad_rows,
                    int64_t vecs, Vec* __restrict__ out) {
  const int64_t num_pairs = tokens * k;
  for (int64_t item = blockIdx.x; item < tokens + pad_rows; item += gridDim.x) {
    if (item < tokens) {
      copy_to_rows(src + item * vecs, pair_row + item * k, k, vecs, out);
    } else {
      const int64_t r = item - tokens;
      const int64_t p = send_pairs[r];
      if (p >= 0 && p < num_pairs) continue;  // a token's row, written above
      zero_row(out + r * vecs, vecs);
    }
  }
}

// Per expert e: s_before[e] += blk_counts[b, e] summed over b < before, s_total[e] += the same over
// every block (both zeroed by the caller, a barrier after). Thread x sums column x % span (span =
// min(E, threads); then + span, ...) over rows x / span, x / span + threads / span, ...: consecutive
// threads read consecutive ints, and each thread adds into shared memory once per column.
__device__ __forceinline__ void column_sums(const int* __restrict__ blk_counts, int blocks, int num_experts,
                                            int before, int* s_before, int* s_total) {
  const int span = min(num_experts, static_cast<int>(blockDim.x));
  const int step = blockDim.x / span, first = threadIdx.x / span;
  if (first >= step) return;  // threads past step * span
  for (int e = threadIdx.x % span; e < num_experts; e += span) {
    int sb = 0, st = 0;
#pragma unroll 8  // loads in flight: the sums are latency-bound reads of L2 / L1
    for (int b = first; b < blocks; b += step) {
      const int c = blk_counts[static_cast<int64_t>(b) * num_experts + e];
      st += c;
      sb += b < before ? c : 0;
    }
    if (st != 0) atomicAdd(&s_total[e], st);
    if (sb != 0) atomicAdd(&s_before[e], sb);
  }
}

// A bounded dispatch after count_kernel (per_block = P, a multiple of k), in one launch: block
// i * split + part takes count block i's pairs (whole tokens) and, of them, the tokens j with
// j % split == part; every block also takes a grid-stride share of the [E * C] rows' padding.
//   1. the verdict (host_code | every block's code), each expert's total and count block i's
//      offset in it (column_sums over blk_counts); block 0 writes info (counts, verdict)
//   2. the rows of count block i's pairs (block_rank, rows from e * C), kept in shared memory
//   3. its tokens' pair_row and send_pairs entries, then their rows (x[t] read once, to K rows)
//   4. its padding rows (row e * C + j with j >= min(total[e], C); every row when the verdict is
//      set): send_pairs = T * K, and zeros in out when zero_pad
template <typename Idx, typename Vec>
__global__ void __launch_bounds__(kPairsPerBlock)
bounded_rows_kernel(const Idx* __restrict__ idx, int64_t n, int k, int per_block, int num_experts, int64_t capacity,
                    const int* __restrict__ blk_counts, const int* __restrict__ blk_code, int blocks, int split,
                    int host_code, bool zero_pad, const Vec* __restrict__ src, int64_t vecs,
                    int64_t* __restrict__ info, int64_t* __restrict__ pair_row, int64_t* __restrict__ send_pairs,
                    Vec* __restrict__ out) {
  extern __shared__ int s_dyn[];  // s_warp [kLayoutWarps, E], s_before [E], s_total [E]
  __shared__ int64_t s_row[kPairsPerBlock];
  __shared__ int s_code;
  int* s_warp = s_dyn;
  int* s_before = s_warp + kLayoutWarps * num_experts;
  int* s_total = s_before + num_experts;
  const int unit = blockIdx.x / split, part = blockIdx.x % split;
  for (int x = threadIdx.x; x < 2 * num_experts; x += blockDim.x) s_before[x] = 0;  // s_before, s_total
  if (threadIdx.x == 0) s_code = host_code;
  __syncthreads();
  or_block_codes(blk_code, blocks, &s_code);
  column_sums(blk_counts, blocks, num_experts, unit, s_before, s_total);
  __syncthreads();
  const bool failed = s_code != 0;  // uniform over the grid
  if (blockIdx.x == 0) {
    for (int x = threadIdx.x; x < num_experts; x += blockDim.x) info[x] = failed ? 0 : s_total[x];
    if (threadIdx.x == 0) info[num_experts] = s_code;
  }
  const int64_t p0 = static_cast<int64_t>(unit) * per_block, p = p0 + threadIdx.x;
  const bool in_unit = threadIdx.x < per_block && p < n;
  const int e = in_unit && !failed ? pair_expert(idx, p, n, k, num_experts, nullptr) : -1;
  const int rank = block_rank(e, num_experts, s_warp);
  s_row[threadIdx.x] = e < 0 ? -1 : row_at(e * capacity, static_cast<int64_t>(s_before[e]) + rank, capacity);
  __syncthreads();
  if (in_unit && (threadIdx.x / k) % split == part) {
    const int64_t row = s_row[threadIdx.x];
    pair_row[p] = row;
    if (row >= 0) send_pairs[row] = p;
  }
  const int64_t t0 = p0 / k;
  const int tokens = failed ? 0 : static_cast<int>(max(int64_t{0}, min(n - p0, static_cast<int64_t>(per_block))) / k);
  for (int j = part; j < tokens; j += split) copy_to_rows(src + (t0 + j) * vecs, s_row + j * k, k, vecs, out);
  const int64_t rows = num_experts * capacity;
  auto padding = [&](int64_t r) {
    const int64_t ex = r / capacity;
    return failed || r - ex * capacity >= min(static_cast<int64_t>(s_total[ex]), capacity);
  };
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < rows; r += threads) {
    if (padding(r)) send_pairs[r] = n;
  }
  if (zero_pad) {
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
      if (padding(r)) zero_row(out + r * vecs, vecs);
    }
  }
}

// N elements of T at once (16 bytes, or 1 element when rows are not 16-byte aligned).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ void load_f32(const T* p, float (&f)[N]) {
  const Pack<T, N> pk = *reinterpret_cast<const Pack<T, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) f[i] = static_cast<float>(pk.v[i]);
}

template <typename T, int N>
__device__ __forceinline__ void store_from_f32(T* p, const float (&f)[N]) {
  Pack<T, N> pk;
#pragma unroll
  for (int i = 0; i < N; ++i) pk.v[i] = static_cast<T>(f[i]);
  *reinterpret_cast<Pack<T, N>*>(p) = pk;
}

constexpr int kMaxTopk = 64;
static_assert(kCombineThreads >= kMaxTopk, "combine_kernel stages a token's K rows, one per thread");
static_assert(kCombineThreads <= 32 * 32, "combine_bwd_kernel reduces one partial per warp in s_part[32]");

// out[t] = sum over k with pair_row[t, k] >= 0 of w[t, k] * y[pair_row[t, k]] (w null: 1), fp32,
// k = 0 first; one block per token (grid-stride), N elements per thread access.
template <typename T, int N>
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(const T* __restrict__ y, const float* __restrict__ w,
                               const int64_t* __restrict__ pair_row, int64_t tokens, int k, int64_t h,
                               T* __restrict__ out) {
  __shared__ int64_t s_row[kMaxTopk];
  __shared__ float s_w[kMaxTopk];
  const int64_t groups = h / N;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    __syncthreads();  // the previous token's readers are done with s_row / s_w
    if (threadIdx.x < k) {
      s_row[threadIdx.x] = pair_row[t * k + threadIdx.x];
      s_w[threadIdx.x] = w != nullptr ? w[t * k + threadIdx.x] : 1.0f;
    }
    __syncthreads();
    for (int64_t g = threadIdx.x; g < groups; g += blockDim.x) {
      float acc[N];
#pragma unroll
      for (int i = 0; i < N; ++i) acc[i] = 0.0f;
      // One slot's load at a time: measured on an H200 (T 4096, K 8, H 7168), issuing 2 or 4
      // slots' loads before their sums took 1.16x / 1.36x the time of this (135 us, 3.9 TB/s):
      // more registers per thread, fewer threads resident to cover HBM latency.
      for (int j = 0; j < k; ++j) {
        if (s_row[j] < 0) continue;
        float v[N];
        load_f32<T, N>(y + s_row[j] * h + g * N, v);
        const float wj = s_w[j];
#pragma unroll
        for (int i = 0; i < N; ++i) acc[i] = fmaf(wj, v[i], acc[i]);
      }
      store_from_f32<T, N>(out + t * h + g * N, acc);
    }
  }
}

// Combine's backward, token-major so that dout[t] comes from HBM once (its later slots hit L1).
// Items, one per block at a time:
//   [0, tokens)               token t, slot by slot (j = 0 first), for each slot with a row r:
//                             dy[r] = w[t, j] * dout[t]; with dw: dw[t, j] = <dout[t], y[r]> (fp32,
//                             a fixed-order block reduction)
//   [tokens, tokens + rows)   row r: zeros in dy where send_pairs[r] is padding (bounded layouts)
template <typename T, int N>
__global__ void __launch_bounds__(kCombineThreads)
combine_bwd_kernel(const T* __restrict__ dout, const float* __restrict__ w,
                   const int64_t* __restrict__ pair_row, const int64_t* __restrict__ send_pairs,
                   const T* __restrict__ y, int64_t tokens, int k, int64_t rows, int64_t h,
                   T* __restrict__ dy, float* __restrict__ dw) {
  __shared__ float s_part[32];
  const int64_t groups = h / N, num_pairs = tokens * k;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int64_t item = blockIdx.x; item < tokens + rows; item += gridDim.x) {
    if (item >= tokens) {
      const int64_t r = item - tokens;
      const int64_t p = send_pairs[r];
      if (p >= 0 && p < num_pairs) continue;  // a pair's row, written by its token
      float zero[N];
#pragma unroll
      for (int i = 0; i < N; ++i) zero[i] = 0.0f;
      for (int64_t g = threadIdx.x; g < groups; g += blockDim.x) store_from_f32<T, N>(dy + r * h + g * N, zero);
      continue;
    }
    const T* src = dout + item * h;
    for (int j = 0; j < k; ++j) {
      const int64_t r = pair_row[item * k + j];  // uniform over the block
      if (r < 0) continue;
      const float wj = w != nullptr ? w[item * k + j] : 1.0f;
      float dot = 0.0f;
      for (int64_t g = threadIdx.x; g < groups; g += blockDim.x) {
        float d[N], o[N];
        load_f32<T, N>(src + g * N, d);
#pragma unroll
        for (int i = 0; i < N; ++i) o[i] = wj * d[i];
        store_from_f32<T, N>(dy + r * h + g * N, o);
        if (dw != nullptr) {
          float v[N];
          load_f32<T, N>(y + r * h + g * N, v);
#pragma unroll
          for (int i = 0; i < N; ++i) dot = fmaf(d[i], v[i], dot);
        }
      }
      if (dw != nullptr) {
#pragma unroll
        for (int d = 16; d > 0; d >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, d);
        if (lane == 0) s_part[warp] = dot;
        __syncthreads();
        if (threadIdx.x == 0) {
          float sum = 0.0f;
          for (int i = 0; i < static_cast<int>(blockDim.x / 32); ++i) sum += s_part[i];
          dw[item * k + j] = sum;
        }
        __syncthreads();
      }
    }
  }
}

int grid_for(int64_t items, int per_sm) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(items, static_cast<int64_t>(sms) * per_sm)));
}

bool aligned16(const at::Tensor& t, int64_t row_bytes) {
  return row_bytes % 16 == 0 && is_aligned(t.data_ptr(), 16);
}

// `count` int64 elements of `base` (an int64 tensor) from element `offset`, as a 1-D tensor on its
// storage, made without the dispatcher: a narrow() costs a dispatch (2-4 us of host time each on
// an H200 machine's host), and a dispatch returns five of these.
at::Tensor int64_slice(const at::Tensor& base, int64_t offset, int64_t count) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(base.storage()), base.key_set(), base.dtype());
  impl->set_storage_offset(base.storage_offset() + offset);
  impl->set_sizes_contiguous({count});
  return at::Tensor(std::move(impl));
}

// The first `rows` rows of a 2-D tensor, as a tensor on its storage made without the dispatcher
// (as int64_slice).
at::Tensor first_rows(const at::Tensor& base, int64_t rows) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(base.storage()), base.key_set(), base.dtype());
  impl->set_storage_offset(base.storage_offset());
  impl->set_sizes_contiguous({rows, base.size(1)});
  return at::Tensor(std::move(impl));
}

// The event a read dispatch waits on, one per (host thread, device): recorded after the counts'
// copy, before the rows' kernel, so the host reads the counts while the rows move.
cudaEvent_t read_event(int device) {
  thread_local std::unordered_map<int, cudaEvent_t> events;
  cudaEvent_t& ev = events[device];
  if (ev == nullptr) C10_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  return ev;
}

// A dispatch's index tensors and the layout kernels' scratch, in one int64 allocation: info
// [E + 1] (counts, verdict), pair_row [T * K], send_pairs ([E * C] bounded; [T * K] unbounded, its
// first sum(counts) entries hold the rows), then the scratch: start (int64 [E]), blk_counts
// (int32 [blocks, E]) and blk_code (int32 [blocks]). The outputs are views of it (one allocation
// in place of three; the scratch, E + blocks * (E + 1) / 2 words, lives as long as they do).
struct Layout {
  at::Tensor info, pair_row, send_pairs;
  int64_t* start;
  int* blk_counts;
  int* blk_code;
  int blocks;     // count blocks
  int per_block;  // pairs per count block
};

// The pairs per count block: kPairsPerBlock, or (fused) the most whole tokens that fit in it.
Layout layout_buffers(const at::Tensor& topk_idx, int64_t num_experts, int64_t capacity, int per_block) {
  const int64_t n = topk_idx.numel();
  const int64_t blocks = std::max<int64_t>(1, (n + per_block - 1) / per_block);
  FLUX_CHECK(blocks <= moe_launch::kMaxGridX, "moe_local_dispatch", "T * K = ", n,
             " pairs is too many for one dispatch");
  const int64_t rows = capacity >= 0 ? num_experts * capacity : n;
  const int64_t blk_ints = blocks * (num_experts + 1);
  const int64_t head = num_experts + 1 + n + rows;
  at::Tensor all = at::empty({head + num_experts + (blk_ints + 1) / 2}, topk_idx.options().dtype(at::kLong));
  Layout l;
  l.info = int64_slice(all, 0, num_experts + 1);
  l.pair_row = int64_slice(all, num_experts + 1, n);
  l.send_pairs = int64_slice(all, num_experts + 1 + n, rows);
  l.start = all.data_ptr<int64_t>() + head;
  l.blk_counts = reinterpret_cast<int*>(l.start + num_experts);
  l.blk_code = l.blk_counts + blocks * num_experts;
  l.blocks = static_cast<int>(blocks);
  l.per_block = per_block;
  return l;
}

template <typename Idx>
void launch_count(const char* op, const Idx* idx, int64_t n, int k, int num_experts, const Layout& l,
                  cudaStream_t stream) {
  const size_t smem = num_experts * sizeof(int);
  moe_launch::check(op, "count_kernel", count_kernel<Idx>, l.blocks, kPairsPerBlock, smem);
  count_kernel<Idx><<<l.blocks, kPairsPerBlock, smem, stream>>>(idx, n, k, l.per_block, num_experts, l.blk_counts,
                                                                l.blk_code);
  FLUX_CHECK_LAUNCH();
}

// scan_kernel and place_kernel after count_kernel (per_block = kPairsPerBlock).
template <typename Idx>
void launch_scan_place(const char* op, const Idx* idx, int64_t n, int k, int num_experts, int64_t capacity,
                       int64_t host_code, Layout& l, cudaStream_t stream) {
  const size_t place_smem = kLayoutWarps * num_experts * sizeof(int);
  int64_t* info = l.info.data_ptr<int64_t>();
  int64_t* send_pairs = l.send_pairs.data_ptr<int64_t>();
  moe_launch::check(op, "scan_kernel", scan_kernel, 1, kScanThreads, 0);
  moe_launch::check(op, "place_kernel", place_kernel<Idx>, l.blocks, kPairsPerBlock, place_smem);
  scan_kernel<<<1, kScanThreads, 0, stream>>>(l.blk_counts, l.blk_code, l.blocks, num_experts, capacity,
                                              static_cast<int>(host_code), info, l.start, send_pairs, n,
                                              capacity >= 0 ? num_experts * capacity : n);
  FLUX_CHECK_LAUNCH();
  place_kernel<Idx><<<l.blocks, kPairsPerBlock, place_smem, stream>>>(
      idx, n, k, num_experts, capacity, l.blk_counts, info, l.start, l.pair_row.data_ptr<int64_t>(), send_pairs);
  FLUX_CHECK_LAUNCH();
}

// bounded_rows_kernel after count_kernel (per_block a multiple of k): split parts per count block,
// so that the grid is about what the rows need (a token, or a zeroed padding row, per block up to
// kFusedBlocksPerSm blocks per SM).
template <typename Idx, typename Vec>
void launch_bounded_rows(const char* op, const Idx* idx, int64_t n, int k, int num_experts, int64_t capacity,
                         int64_t host_code, bool zero_pad, const at::Tensor& x, Layout& l, at::Tensor& out,
                         cudaStream_t stream) {
  const int64_t rows = num_experts * capacity;
  // A block per token, and with zero_pad one per padding row the counts leave for sure (rows - T * K,
  // a lower bound): where the slabs hold about as many rows as pairs (E * C ~ T * K) the few
  // padding rows do not multiply the blocks, each of which ranks its count block's pairs again.
  const int64_t pad = zero_pad ? std::max<int64_t>(0, rows - n) : 0;
  const int64_t want = grid_for(x.size(0) + pad, kFusedBlocksPerSm);
  const int64_t split = std::max<int64_t>(1, (want + l.blocks - 1) / l.blocks);
  const int64_t grid = l.blocks * split;
  const size_t smem = (kLayoutWarps + 2) * num_experts * sizeof(int);
  const int64_t vecs = x.size(1) * static_cast<int64_t>(x.element_size()) / static_cast<int64_t>(sizeof(Vec));
  moe_launch::check(op, "bounded_rows_kernel", bounded_rows_kernel<Idx, Vec>, grid, kPairsPerBlock, smem);
  bounded_rows_kernel<Idx, Vec><<<grid, kPairsPerBlock, smem, stream>>>(
      idx, n, k, l.per_block, num_experts, capacity, l.blk_counts, l.blk_code, l.blocks, static_cast<int>(split),
      static_cast<int>(host_code), zero_pad, static_cast<const Vec*>(x.data_ptr()), vecs, l.info.data_ptr<int64_t>(),
      l.pair_row.data_ptr<int64_t>(), l.send_pairs.data_ptr<int64_t>(), static_cast<Vec*>(out.data_ptr()));
  FLUX_CHECK_LAUNCH();
}

// out's rows from x (scatter_rows_kernel); pad_rows > 0: also zero out's padding rows.
void launch_rows(const char* op, const at::Tensor& src, const at::Tensor& pair_row, const at::Tensor& send_pairs,
                 int64_t k, int64_t pad_rows, at::Tensor& out, cudaStream_t stream) {
  const int64_t tokens = src.size(0);
  const int64_t row_bytes = src.size(1) * static_cast<int64_t>(src.element_size());
  if (tokens + pad_rows == 0 || row_bytes == 0) return;
  const int grid = grid_for(tokens + pad_rows, 16);
  const int64_t* pr = pair_row.data_ptr<int64_t>();
  const int64_t* sp = send_pairs.data_ptr<int64_t>();
  if (aligned16(src, row_bytes) && aligned16(out, row_bytes)) {
    moe_launch::check(op, "scatter_rows_kernel", scatter_rows_kernel<int4>, grid, kRowThreads, 0);
    scatter_rows_kernel<int4><<<grid, kRowThreads, 0, stream>>>(
        static_cast<const int4*>(src.data_ptr()), pr, sp, tokens, static_cast<int>(k), pad_rows, row_bytes / 16,
        static_cast<int4*>(out.data_ptr()));
  } else {
    moe_launch::check(op, "scatter_rows_kernel", scatter_rows_kernel<char>, grid, kRowThreads, 0);
    scatter_rows_kernel<char><<<grid, kRowThreads, 0, stream>>>(
        static_cast<const char*>(src.data_ptr()), pr, sp, tokens, static_cast<int>(k), pad_rows, row_bytes,
        static_cast<char*>(out.data_ptr()));
  }
  FLUX_CHECK_LAUNCH();
}

#define FLUX_LOCAL_FLOAT_TYPES(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, TYPE, NAME, __VA_ARGS__)

void check_rows(const at::Tensor& t, const char* what, const char* op) {
  FLUX_CHECK(t.is_cuda() && t.dim() == 2 && t.is_contiguous(), op, what, " must be a contiguous 2-D CUDA tensor");
}

}  // namespace

// Returns [recv, counts, verdict, pair_row, send_pairs, info]: recv [E, C, H] bounded (capacity
// C >= 0); for capacity -2, unbounded, [T * K, H], the unbounded layout at its worst case, rows in
// place in this call (rows past the counts' sum are padding: send_pairs T * K, zeros when
// zero_pad); for capacity -3 the same, the counts and the verdict read here: copied to pinned host
// memory right after the layout kernels, the rows' kernel queued behind that copy, then a wait for
// the copy alone (the host reads the counts and returns while the rows move, so the next work is
// queued before the GPU runs dry); info is returned as that host copy (int64 [E + 1], CPU) and,
// where the verdict is 0, recv and send_pairs cut to the first sum(counts) rows (views; zero_pad
// ignored: no padding row is shown); counts
// (info[:E]) and verdict (info[E:], [1]) are views of info, so that the bounded caller uses the
// outputs as they come (no slicing or reshaping on the host per call). info, pair_row and
// send_pairs are views of one allocation (layout_buffers). Bounded: two launches where
// blocks * E <= kFusedCounts (count_kernel, bounded_rows_kernel), else four; unbounded: four.
std::vector<at::Tensor> moe_local_dispatch(const at::Tensor& x_in, const at::Tensor& topk_idx_in, int64_t num_experts,
                                           int64_t capacity, int64_t host_code, bool zero_pad) {
  constexpr const char* op = "moe_local_dispatch";
  const at::Tensor x = x_in.contiguous();
  const at::Tensor topk_idx = topk_idx_in.contiguous();
  check_rows(x, "x", op);
  FLUX_CHECK(topk_idx.device() == x.device() && topk_idx.dim() == 2 && topk_idx.size(0) == x.size(0), op,
             "topk_idx must have x's tokens, on x's device");
  FLUX_CHECK(topk_idx.is_cuda() && (topk_idx.scalar_type() == at::kLong || topk_idx.scalar_type() == at::kInt), op,
             "topk_idx must be an int64 or int32 CUDA tensor");
  FLUX_CHECK(num_experts >= 1 && num_experts <= kMaxLocalExperts, op, "num_experts must be in [1, ", kMaxLocalExperts,
             "], got ", num_experts);
  const int64_t k = topk_idx.size(1), n = topk_idx.numel();
  FLUX_CHECK(k >= 1 && k <= kMaxTopk, op, "K must be in [1, ", kMaxTopk, "], got ", k);
  FLUX_CHECK(capacity >= 0 || capacity == -2 || capacity == -3, op,
             "capacity must be -2 (unbounded, T * K rows), -3 (the same, counts read) or >= 0, got ", capacity);
  const bool read = capacity == -3;
  const bool worst = capacity == -2 || read;
  if (read) zero_pad = false;
  if (worst) capacity = -1;  // the unbounded layout below
  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int whole = kPairsPerBlock - kPairsPerBlock % static_cast<int>(k);  // whole tokens per count block
  const bool fused = capacity >= 0 && std::max<int64_t>(1, (n + whole - 1) / whole) * num_experts <= kFusedCounts;
  Layout l = layout_buffers(topk_idx, num_experts, capacity, fused ? whole : kPairsPerBlock);
  at::Tensor recv = capacity >= 0 ? at::empty({num_experts, capacity, x.size(1)}, x.options())
                                  : at::empty({n, x.size(1)}, x.options());
  at::Tensor host;  // read: the counts and the verdict on the host (pinned), ready at `counted`
  cudaEvent_t counted = nullptr;
  if (read) {
    host = at::empty({num_experts + 1}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    counted = read_event(x.device().index());
  }
  const int e = static_cast<int>(num_experts), ki = static_cast<int>(k);
  AT_DISPATCH_INDEX_TYPES(topk_idx.scalar_type(), "moe_local_dispatch", [&] {
    const index_t* idx = topk_idx.data_ptr<index_t>();
    launch_count(op, idx, n, ki, e, l, stream);
    if (fused) {
      const int64_t row_bytes = x.size(1) * static_cast<int64_t>(x.element_size());
      if (aligned16(x, row_bytes) && aligned16(recv, row_bytes)) {
        launch_bounded_rows<index_t, int4>(op, idx, n, ki, e, capacity, host_code, zero_pad, x, l, recv, stream);
      } else {
        launch_bounded_rows<index_t, char>(op, idx, n, ki, e, capacity, host_code, zero_pad, x, l, recv, stream);
      }
      return;
    }
    launch_scan_place(op, idx, n, ki, e, capacity, host_code, l, stream);
    if (read) {  // counts and verdict to the host as soon as the layout has them, before the rows move
      C10_CUDA_CHECK(cudaMemcpyAsync(host.data_ptr(), l.info.data_ptr(), (num_experts + 1) * sizeof(int64_t),
                                     cudaMemcpyDeviceToHost, stream));
      C10_CUDA_CHECK(cudaEventRecord(counted, stream));
    }
    const int64_t slots = worst ? n : num_experts * capacity;
    launch_rows(op, x, l.pair_row, l.send_pairs, k, zero_pad ? slots : 0, recv, stream);
  });
  at::Tensor counts = int64_slice(l.info, 0, num_experts), verdict = int64_slice(l.info, num_experts, 1);
  if (!read) return {recv, counts, verdict, l.pair_row, l.send_pairs, l.info};
  C10_CUDA_CHECK(cudaEventSynchronize(counted));
  const int64_t* h = host.data_ptr<int64_t>();
  if (h[num_experts] != 0) return {recv, counts, verdict, l.pair_row, l.send_pairs, host};
  int64_t rows = 0;
  for (int64_t i = 0; i < num_experts; ++i) rows += h[i];
  return {first_rows(recv, rows), counts, verdict, l.pair_row, int64_slice(l.send_pairs, 0, rows), host};
}

// The routing weights as the kernels read them (float32, contiguous, T * K entries, on `like`'s
// device): the caller's tensor itself where it is that already (no copy), else a converted copy;
// undefined where none are given.
at::Tensor weights_f32(const std::optional<at::Tensor>& weights, int64_t pairs, const at::Tensor& like,
                       const char* op) {
  if (!weights.has_value()) return at::Tensor();
  FLUX_CHECK(weights->device() == like.device() && at::isFloatingType(weights->scalar_type()) &&
                 weights->numel() == pairs,
             op, "weights must be a floating tensor of T * K entries on the rows' device");
  return weights->to(at::kFloat).contiguous();
}

// The rows of a recv_x-layout tensor ([..., H], any leading dimensions) as contiguous [S, H].
at::Tensor as_rows(const at::Tensor& t, const char* what, const char* op) {
  FLUX_CHECK(t.is_cuda() && t.dim() >= 2, op, what, " must be a CUDA tensor of at least 2 dimensions");
  int64_t rows = 1;  // not reshape({-1, H}), which has no answer for H = 0
  for (int64_t d = 0; d + 1 < t.dim(); ++d) rows *= t.size(d);
  return t.reshape({rows, t.size(-1)}).contiguous();
}

at::Tensor moe_local_combine(const at::Tensor& y_in, const std::optional<at::Tensor>& weights,
                             const at::Tensor& pair_row, int64_t k) {
  constexpr const char* op = "moe_local_combine";
  const at::Tensor y = as_rows(y_in, "y", op);
  FLUX_CHECK(k >= 1 && k <= kMaxTopk && pair_row.is_cuda() && pair_row.scalar_type() == at::kLong &&
                 pair_row.is_contiguous() && pair_row.numel() % k == 0,
             op, "pair_row must be a contiguous int64 CUDA tensor of T * K entries, K in [1, ", kMaxTopk, "]");
  const int64_t t = pair_row.numel() / k, h = y.size(1);
  const at::Tensor w32 = weights_f32(weights, t * k, y, op);
  const float* w = w32.defined() ? w32.data_ptr<float>() : nullptr;
  const c10::cuda::CUDAGuard guard(y.device());
  at::Tensor out = at::empty({t, h}, y.options());
  if (t == 0 || h == 0) return out;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int grid = grid_for(t, 16);
  FLUX_LOCAL_FLOAT_TYPES(y.scalar_type(), "moe_local_combine", [&] {
    constexpr int kVec = 16 / sizeof(scalar_t);
    const int64_t rb = h * static_cast<int64_t>(sizeof(scalar_t));
    if (aligned16(y, rb) && aligned16(out, rb)) {
      const int64_t warps_of_row = (h / kVec + 31) / 32 * 32;
      // at least K threads (they stage the token's rows and weights), at most kCombineThreads
      const int threads =
          static_cast<int>(std::min<int64_t>(kCombineThreads, std::max<int64_t>(kMaxTopk, warps_of_row)));
      moe_launch::check(op, "combine_kernel", combine_kernel<scalar_t, kVec>, grid, threads, 0);
      combine_kernel<scalar_t, kVec><<<grid, threads, 0, stream>>>(y.data_ptr<scalar_t>(), w,
                                                                   pair_row.data_ptr<int64_t>(), t, (int)k, h,
                                                                   out.data_ptr<scalar_t>());
    } else {
      moe_launch::check(op, "combine_kernel", combine_kernel<scalar_t, 1>, grid, kCombineThreads, 0);
      combine_kernel<scalar_t, 1><<<grid, kCombineThreads, 0, stream>>>(
          y.data_ptr<scalar_t>(), w, pair_row.data_ptr<int64_t>(), t, (int)k, h, out.data_ptr<scalar_t>());
    }
    FLUX_CHECK_LAUNCH();
  });
  return out;
}

std::vector<at::Tensor> moe_local_combine_backward(const at::Tensor& grad_out_in,
                                                   const std::optional<at::Tensor>& weights,
                                                   const at::Tensor& pair_row, const at::Tensor& send_pairs,
                                                   const std::optional<at::Tensor>& y_in, int64_t k) {
  constexpr const char* op = "moe_local_combine_backward";
  const at::Tensor grad_out = grad_out_in.contiguous();
  check_rows(grad_out, "grad_out", op);
  std::optional<at::Tensor> y;
  if (y_in.has_value()) y = as_rows(*y_in, "y (rows)", op);
  const int64_t t = grad_out.size(0), h = grad_out.size(1), rows = send_pairs.numel();
  auto idx_ok = [&](const at::Tensor& x) {
    return x.is_cuda() && x.scalar_type() == at::kLong && x.is_contiguous() && x.device() == grad_out.device();
  };
  FLUX_CHECK(k >= 1 && k <= kMaxTopk && idx_ok(pair_row) && idx_ok(send_pairs) && pair_row.numel() == t * k, op,
             "pair_row ([T * K], K in [1, ", kMaxTopk, "]) and send_pairs must be contiguous int64 tensors on "
             "grad_out's device");
  const at::Tensor w32 = weights_f32(weights, t * k, grad_out, op);
  const float* w = w32.defined() ? w32.data_ptr<float>() : nullptr;
  if (y.has_value()) {
    FLUX_CHECK(y->size(0) == rows && y->size(1) == h && y->scalar_type() == grad_out.scalar_type(), op,
               "y must be [rows, H] in grad_out's dtype");
  }
  const c10::cuda::CUDAGuard guard(grad_out.device());
  at::Tensor dy = at::empty({rows, h}, grad_out.options());
  at::Tensor dw = at::zeros({y.has_value() ? t * k : 0}, grad_out.options().dtype(at::kFloat));
  if (t + rows == 0 || h == 0) return {dy, dw};
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int grid = grid_for(t + rows, 16);
  float* dwp = y.has_value() ? dw.data_ptr<float>() : nullptr;
  FLUX_LOCAL_FLOAT_TYPES(grad_out.scalar_type(), "moe_local_combine_backward", [&] {
    constexpr int kVec = 16 / sizeof(scalar_t);
    const int64_t rb = h * static_cast<int64_t>(sizeof(scalar_t));
    const scalar_t* yp = y.has_value() ? y->data_ptr<scalar_t>() : nullptr;
    const bool vec = aligned16(grad_out, rb) && aligned16(dy, rb) && (!y.has_value() || aligned16(*y, rb));
    const int64_t* pr = pair_row.data_ptr<int64_t>();
    const int64_t* sp = send_pairs.data_ptr<int64_t>();
    if (vec) {
      moe_launch::check(op, "combine_bwd_kernel", combine_bwd_kernel<scalar_t, kVec>, grid, kCombineThreads, 0);
      combine_bwd_kernel<scalar_t, kVec><<<grid, kCombineThreads, 0, stream>>>(
          grad_out.data_ptr<scalar_t>(), w, pr, sp, yp, t, (int)k, rows, h, dy.data_ptr<scalar_t>(), dwp);
    } else {
      moe_launch::check(op, "combine_bwd_kernel", combine_bwd_kernel<scalar_t, 1>, grid, kCombineThreads, 0);
      combine_bwd_kernel<scalar_t, 1><<<grid, kCombineThreads, 0, stream>>>(
          grad_out.data_ptr<scalar_t>(), w, pr, sp, yp, t, (int)k, rows, h, dy.data_ptr<scalar_t>(), dwp);
    }
    FLUX_CHECK_LAUNCH();
  });
  return {dy, dw};
}

}  // namespace flux
