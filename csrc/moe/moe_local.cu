// The `local` strategy of flux.moe_dispatch / flux.moe_combine (flux/ops/moe/local.py): every
// expert on this GPU (one rank), so a dispatch is a permutation of rows into the expert-major
// layout and a combine the weighted gather back. Kernels, each over the (token, slot) pairs
// p = t * K + k or over the rows of recv_x:
//
//   layout   count_kernel  (one block per 256 pairs)  per-block, per-expert counts + verdict bits
//            scan_kernel   (one block)                exclusive scans: blocks within an expert,
//                                                     experts (unbounded) -> counts, verdict
//            place_kernel  (one block per 256 pairs)  pair_row[p] (its row, -1: none) and
//                                                     send_pairs[row] = p
//   move     scatter_rows_kernel  recv_x[pair_row[t, k]] = x[t], token-major (zeros for padding rows)
//   combine  combine_kernel       out[t] = sum_k w[t, k] * y[pair_row[t, k]]  (fp32, k = 0 first)
//   backward combine_bwd_kernel   dy[pair_row[t, k]] = w[t, k] * dout[t], dw[t, k] = <dout[t], that row of y>
//
// Row order within an expert is pair order (token, then slot): a pair's rank among its block's
// pairs of the same expert comes from __match_any_sync per warp and a scan over the block's warps;
// the blocks' offsets from scan_kernel. So the layout is the stable sort by expert that the
// reference strategy makes, bit for bit, and every kernel is deterministic.
//
// Bounded (capacity C >= 0): expert e's rows are e * C .. e * C + counts[e] - 1 of [E * C] rows;
// the rest are padding (send_pairs = T * K, zero rows when zero_pad). Any verdict bit (an id outside
// [-1, E), an expert twice in a token, or the caller's host_code) makes every count zero and every
// pair rowless: nothing moves, recv_x is zeros, combine gives zeros.
//
// The code bits match flux/ops/moe/handle.py: 2 bad id, 4 duplicate; host_code carries the others.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cub/block/block_scan.cuh>

#include "common/check.h"
#include "moe/launch.h"
#include "ops.h"

namespace flux {
namespace {

constexpr int kPairsPerBlock = 256;  // layout blocks: one thread per pair
constexpr int kLayoutWarps = kPairsPerBlock / 32;
// scan_kernel: kScanItems experts per thread. A block of T threads gets 65536 / T registers per
// thread at most; 512 threads (128 each) hold the kernel's without spilling, where 1024 threads
// (64 each) do not fit it (a launch failure unbounded, spills under __launch_bounds__).
constexpr int kScanThreads = 512;
constexpr int kScanItems = 2;
constexpr int64_t kMaxExperts = kScanThreads * kScanItems;
constexpr int kRowThreads = 128;      // scatter_rows_kernel
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

// blk_counts[b, e]: pairs of block b routed to e; blk_code[b]: the block's verdict bits.
template <typename Idx>
__global__ void __launch_bounds__(kPairsPerBlock)
count_kernel(const Idx* __restrict__ idx, int64_t n, int k, int num_experts,
             int* __restrict__ blk_counts, int* __restrict__ blk_code) {
  extern __shared__ int s_count[];  // [num_experts]
  __shared__ int s_code;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) s_count[e] = 0;
  if (threadIdx.x == 0) s_code = 0;
  __syncthreads();
  const int64_t p = static_cast<int64_t>(blockIdx.x) * kPairsPerBlock + threadIdx.x;
  const int e = pair_expert(idx, p, n, k, num_experts, &s_code);
  if (e >= 0) atomicAdd(&s_count[e], 1);
  __syncthreads();
  int* out = blk_counts + static_cast<int64_t>(blockIdx.x) * num_experts;
  for (int x = threadIdx.x; x < num_experts; x += blockDim.x) out[x] = s_count[x];
  if (threadIdx.x == 0) blk_code[blockIdx.x] = s_code;
}

// One block of kScanThreads. blk_counts becomes each block's exclusive offset within its expert
// (one warp per expert at a time, 32 blocks per step); info[0, E) the counts, info[E] the verdict;
// start[e] the first row of expert e. Bounded: send_pairs [E * C] filled with the padding value
// first (place_kernel, which runs after, writes the real rows).
__global__ void __launch_bounds__(kScanThreads)
    scan_kernel(int* __restrict__ blk_counts, const int* __restrict__ blk_code, int blocks, int num_experts,
                int64_t capacity, int host_code, int64_t* __restrict__ info, int64_t* __restrict__ start,
                int64_t* __restrict__ send_pairs, int64_t pad_value) {
  using Scan = cub::BlockScan<int64_t, kScanThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int64_t s_total[kMaxExperts];
  __shared__ int s_code;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) s_code = host_code;
  __syncthreads();
  int code = 0;
  for (int b = threadIdx.x; b < blocks; b += blockDim.x) code |= blk_code[b];
  if (code) atomicOr(&s_code, code);
  for (int e = warp; e < num_experts; e += kScanThreads / 32) {
    int64_t run = 0;
    for (int b0 = 0; b0 < blocks; b0 += 32) {
      const int b = b0 + lane;
      const int c = b < blocks ? blk_counts[static_cast<int64_t>(b) * num_experts + e] : 0;
      int incl = c;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += v;
      }
      if (b < blocks) blk_counts[static_cast<int64_t>(b) * num_experts + e] = static_cast<int>(run) + incl - c;
      run += __shfl_sync(0xffffffffu, incl, 31);
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
  if (capacity >= 0) {
    const int64_t rows = num_experts * capacity;
    for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) send_pairs[r] = pad_value;
  }
}

// pair_row[p] and send_pairs[row]; nothing (every pair -1) when the verdict is nonzero.
template <typename Idx>
__global__ void __launch_bounds__(kPairsPerBlock)
place_kernel(const Idx* __restrict__ idx, int64_t n, int k, int num_experts, int64_t capacity,
             const int* __restrict__ blk_off, const int64_t* __restrict__ info,
             const int64_t* __restrict__ start, int64_t* __restrict__ pair_row,
             int64_t* __restrict__ send_pairs) {
  extern __shared__ int s_warp[];  // [kLayoutWarps, num_experts]: per warp, then exclusive over warps
  const int64_t p = static_cast<int64_t>(blockIdx.x) * kPairsPerBlock + threadIdx.x;
  if (info[num_experts] != 0) {  // uniform over the grid
    if (p < n) pair_row[p] = -1;
    return;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int i = threadIdx.x; i < kLayoutWarps * num_experts; i += blockDim.x) s_warp[i] = 0;
  __syncthreads();
  const int e = pair_expert(idx, p, n, k, num_experts, nullptr);
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
  if (p >= n) return;
  if (e < 0) {
    pair_row[p] = -1;
    return;
  }
  const int64_t place = static_cast<int64_t>(blk_off[static_cast<int64_t>(blockIdx.x) * num_experts + e]) +
                        s_warp[warp * num_experts + e] + in_warp;
  if (capacity >= 0 && place >= capacity) {  // impossible when T <= C without duplicates (both checked)
    pair_row[p] = -1;
    return;
  }
  const int64_t row = start[e] + place;
  pair_row[p] = row;
  send_pairs[row] = p;
}

// The rows of a dispatch, token-major so that each token's row is read once (x is read once, each
// row of out written once: the HBM traffic of the permutation itself). Items, grid-stride, one
// per block at a time:
//   [0, tokens)                  token t: x[t] -> out[pair_row[t * k + j]] for each j with a row
//   [tokens, tokens + pad_rows)  (bounded, zero_pad) row r = item - tokens: zeros where
//                                send_pairs[r] is padding (not a pair of [0, tokens * k))
template <typename Vec>
__global__ void __launch_bounds__(kRowThreads)
scatter_rows_kernel(const Vec* __restrict__ src, const int64_t* __restrict__ pair_row,
                    const int64_t* __restrict__ send_pairs, int64_t tokens, int k, int64_t pad_rows,
                    int64_t vecs, Vec* __restrict__ out) {
  constexpr int kUnroll = 4;
  const int64_t num_pairs = tokens * k;
  for (int64_t item = blockIdx.x; item < tokens + pad_rows; item += gridDim.x) {
    if (item < tokens) {
      const int64_t* rows = pair_row + item * k;
      const Vec* from = src + item * vecs;
      for (int64_t v0 = threadIdx.x; v0 < vecs; v0 += kUnroll * blockDim.x) {
        Vec buf[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t v = v0 + u * blockDim.x;
          if (v < vecs) buf[u] = from[v];
        }
        for (int j = 0; j < k; ++j) {
          const int64_t r = rows[j];  // the same for every thread: a broadcast load
          if (r < 0) continue;
          Vec* to = out + r * vecs;
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int64_t v = v0 + u * blockDim.x;
            if (v < vecs) to[v] = buf[u];
          }
        }
      }
    } else {
      const int64_t r = item - tokens;
      const int64_t p = send_pairs[r];
      if (p >= 0 && p < num_pairs) continue;  // a token's row, written above
      Vec zero;
      memset(&zero, 0, sizeof(Vec));
      Vec* to = out + r * vecs;
      for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) to[v] = zero;
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
constexpr int kSlotBatch = 4;
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
      // Slots in groups of kSlotBatch: the group's loads are issued before its sums (latency), the
      // sums still run slot by slot from k = 0.
      for (int j0 = 0; j0 < k; j0 += kSlotBatch) {
        float v[kSlotBatch][N];
#pragma unroll
        for (int u = 0; u < kSlotBatch; ++u) {
          const int j = j0 + u;
          if (j < k && s_row[j] >= 0) load_f32<T, N>(y + s_row[j] * h + g * N, v[u]);
        }
#pragma unroll
        for (int u = 0; u < kSlotBatch; ++u) {
          const int j = j0 + u;
          if (j < k && s_row[j] >= 0) {
            const float wj = s_w[j];
#pragma unroll
            for (int i = 0; i < N; ++i) acc[i] = fmaf(wj, v[u][i], acc[i]);
          }
        }
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

// The three layout kernels (see the top of the file). Returns (info [E + 1], pair_row [T * K],
// send_pairs [E * C] bounded, [T * K] unbounded: its first sum(counts) entries hold the rows).
// info is the head of one allocation whose tail is the kernels' scratch (one allocation fewer
// per call; the scratch lives as long as info, a few hundred bytes).
std::tuple<at::Tensor, at::Tensor, at::Tensor> local_layout(const at::Tensor& topk_idx, int64_t num_experts,
                                                            int64_t capacity, int64_t host_code, cudaStream_t stream) {
  constexpr const char* op = "moe_local_dispatch";
  FLUX_CHECK(topk_idx.is_cuda() && topk_idx.dim() == 2 && topk_idx.is_contiguous() &&
                 (topk_idx.scalar_type() == at::kLong || topk_idx.scalar_type() == at::kInt),
             op, "topk_idx must be a contiguous 2-D int64 or int32 CUDA tensor");
  FLUX_CHECK(num_experts >= 1 && num_experts <= kMaxExperts, op, "num_experts must be in [1, ", kMaxExperts,
             "], got ", num_experts);
  const int64_t t = topk_idx.size(0), k = topk_idx.size(1), n = t * k;
  FLUX_CHECK(k >= 1 && k <= kMaxTopk, op, "K must be in [1, ", kMaxTopk, "], got ", k);
  FLUX_CHECK(capacity >= -1, op, "capacity must be -1 (unbounded) or >= 0, got ", capacity);
  const auto i64 = topk_idx.options().dtype(at::kLong);
  const int64_t blocks64 = std::max<int64_t>(1, (n + kPairsPerBlock - 1) / kPairsPerBlock);
  FLUX_CHECK(blocks64 <= moe_launch::kMaxGridX, op, "T * K = ", n, " pairs is too many for one dispatch");
  const int blocks = static_cast<int>(blocks64);
  // info (int64 [E + 1]), then the scratch: the expert starts (int64 [E]), the block counts (then
  // offsets, int32 [blocks, E]) and the block codes (int32 [blocks]).
  const int64_t blk_ints = static_cast<int64_t>(blocks) * (num_experts + 1);
  at::Tensor info_scratch = at::empty({2 * num_experts + 1 + (blk_ints + 1) / 2}, i64);
  at::Tensor info = info_scratch.narrow(0, 0, num_experts + 1);
  at::Tensor pair_row = at::empty({n}, i64);
  at::Tensor send_pairs = at::empty({capacity >= 0 ? num_experts * capacity : n}, i64);
  int64_t* start = info_scratch.data_ptr<int64_t>() + num_experts + 1;
  int* blk_counts = reinterpret_cast<int*>(start + num_experts);
  int* blk_code = blk_counts + static_cast<int64_t>(blocks) * num_experts;
  const int e = static_cast<int>(num_experts);
  const int ki = static_cast<int>(k);
  AT_DISPATCH_INDEX_TYPES(topk_idx.scalar_type(), "moe_local_layout", [&] {
    const index_t* idx = topk_idx.data_ptr<index_t>();
    const size_t count_smem = e * sizeof(int), place_smem = kLayoutWarps * e * sizeof(int);
    moe_launch::check(op, "count_kernel", count_kernel<index_t>, blocks, kPairsPerBlock, count_smem);
    moe_launch::check(op, "scan_kernel", scan_kernel, 1, kScanThreads, 0);
    moe_launch::check(op, "place_kernel", place_kernel<index_t>, blocks, kPairsPerBlock, place_smem);
    count_kernel<index_t><<<blocks, kPairsPerBlock, count_smem, stream>>>(idx, n, ki, e, blk_counts, blk_code);
    FLUX_CHECK_LAUNCH();
    scan_kernel<<<1, kScanThreads, 0, stream>>>(blk_counts, blk_code, blocks, e, capacity, static_cast<int>(host_code),
                                                info.data_ptr<int64_t>(), start, send_pairs.data_ptr<int64_t>(), n);
    FLUX_CHECK_LAUNCH();
    place_kernel<index_t><<<blocks, kPairsPerBlock, place_smem, stream>>>(
        idx, n, ki, e, capacity, blk_counts, info.data_ptr<int64_t>(), start, pair_row.data_ptr<int64_t>(),
        send_pairs.data_ptr<int64_t>());
    FLUX_CHECK_LAUNCH();
  });
  return {info, pair_row, send_pairs};
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

// Returns [recv, counts, verdict, pair_row, send_pairs, info]: recv [E, C, H] bounded, [0, H]
// unbounded (the caller sizes it with moe_local_rows after its one host read of info); counts
// (info[:E]) and verdict (info[E:], [1]) are views of info, so that the bounded caller uses the
// outputs as they come (no slicing or reshaping on the host per call).
std::vector<at::Tensor> moe_local_dispatch(const at::Tensor& x_in, const at::Tensor& topk_idx_in, int64_t num_experts,
                                           int64_t capacity, int64_t host_code, bool zero_pad) {
  constexpr const char* op = "moe_local_dispatch";
  const at::Tensor x = x_in.contiguous();
  const at::Tensor topk_idx = topk_idx_in.contiguous();
  check_rows(x, "x", op);
  FLUX_CHECK(topk_idx.device() == x.device() && topk_idx.dim() == 2 && topk_idx.size(0) == x.size(0), op,
             "topk_idx must have x's tokens, on x's device");
  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  auto [info, pair_row, send_pairs] = local_layout(topk_idx, num_experts, capacity, host_code, stream);
  at::Tensor recv;
  if (capacity >= 0) {
    const int64_t rows = num_experts * capacity;
    recv = at::empty({num_experts, capacity, x.size(1)}, x.options());
    launch_rows(op, x, pair_row, send_pairs, topk_idx.size(1), zero_pad ? rows : 0, recv, stream);
  } else {
    recv = at::empty({0, x.size(1)}, x.options());  // the unbounded caller sizes it after reading the counts
  }
  return {recv, info.narrow(0, 0, num_experts), info.narrow(0, num_experts, 1), pair_row, send_pairs, info};
}

at::Tensor moe_local_rows(const at::Tensor& x_in, const at::Tensor& pair_row, const at::Tensor& send_pairs,
                          int64_t rows) {
  constexpr const char* op = "moe_local_rows";
  const at::Tensor x = x_in.contiguous();
  check_rows(x, "x", op);
  auto idx_ok = [&](const at::Tensor& t) {
    return t.is_cuda() && t.scalar_type() == at::kLong && t.is_contiguous() && t.device() == x.device();
  };
  const bool whole = x.size(0) == 0 || pair_row.numel() % x.size(0) == 0;
  FLUX_CHECK(idx_ok(pair_row) && idx_ok(send_pairs) && rows >= 0 && whole,
             op, "pair_row ([T * K]) and send_pairs must be contiguous int64 tensors on x's device");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({rows, x.size(1)}, x.options());
  const int64_t k = x.size(0) == 0 ? 1 : pair_row.numel() / x.size(0);
  launch_rows(op, x, pair_row, send_pairs, k, 0, out, at::cuda::getCurrentCUDAStream());
  return out;
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
