// The bounded MoE exchange of flux/ops/moe/symm.py (flux.moe_dispatch with max_tokens_per_rank,
// and the moves of its combine and backward passes): four kernels, one entry barrier per move,
// nothing read on the host, so a dispatch and a combine are 7 kernels that a CUDA graph replays.
//
// Layout on each rank's symmetric workspace (byte offsets given by the caller):
//   counts  [W][E_l] int32   row s: rank s's rows for each of our E_l local experts
//   rows    [E_l][W][C] rows  to_experts: block (e, s) holds rank s's rows for our local expert
//                             e, in s's send order; dispatch: [W][C] rows, row (s, t) rank s's
//                             token t, sent once however many of its slots go to our experts;
//                             to_sources: rows back at their index in our send order
//   tags    [E_l][W][C] int32 dispatch: for block row (e, s, j), the pair's index in its sender's
//                             send order
//   tokens  [E_l][W][C] int32 dispatch: for block row (e, s, j), the pair's token on its sender
// Signals: slot [kDataChannel][s] of our signal pad, set by rank s once its rows (and counts) are
// written, holding 1 + rank s's error code; consumed (reset to 0) by our receive kernel.
//
//   moe_route_      one block: this rank's (token, slot) pairs sorted by expert, stably (token,
//                   then slot), each pair's destination (rank, block row), per-expert counts and
//                   the verdict code (bad ids, duplicates, plus the host's code); a rank with a
//                   nonzero code sends nothing
//   moe_send_       rows to their destinations' workspaces (SM stores over NVLink): dispatch sends
//                   each token once to each rank that owns one of its experts, with a (send
//                   index, token) tag pair per (token, slot) at the slot's block row; the other
//                   moves send one row per entry. The last block to finish writes the counts and
//                   the flag into every rank
//   moe_recv_pack_  waits for every rank's flag, then packs the blocks expert-major (expert e's
//                   rows from rank 0, then rank 1, ..., zeros after) into the output, a
//                   dispatch's rows read from the token rows through the tags; with any
//                   rank's code nonzero, every output is zeros / -1 instead
//   moe_recv_sum_   waits for every rank's flag, then out[t] = sum_k w[t, k] * row(t, k) in fp32,
//                   slot 0 first, each product and sum rounded as torch does it (no FMA), so it
//                   equals the Python reference bitwise
//
// Ordering: the caller's entry barrier (Runtime::enqueue_barrier) before moe_send_ proves that
// every rank finished its previous move's receive kernel, so no rank still reads the regions or
// flags written here. Blocks fence (system scope) before counting themselves done; the last one
// writes the counts, fences, and releases the flags; receivers acquire them.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "common/check.h"
#include "common/sync.cuh"
#include "moe/launch.h"
#include "ops.h"

namespace flux {
namespace {

constexpr int kRouteSmem = 48 * 1024;  // route_kernel's table, without opting in to more
constexpr int64_t kMaxExperts = kRouteSmem / 4 / 2 - 1;  // the table holds at least one warp
constexpr int64_t kNone = -1;
constexpr int kMaxWorld = 64;  // receive kernels keep per-rank counts in shared memory

__device__ __forceinline__ int64_t encode(int64_t major, int64_t minor) { return (major << 32) | minor; }

// One block of nw warps; dynamic shared memory: int32 [nw + 1][E + 1] (per-warp counts, then
// offsets, of each key; the last row: each key's first send index).
__global__ void route_kernel(const int64_t* __restrict__ idx, int64_t t, int k, int e_total, int world, int rank,
                             int64_t cap, int64_t host_code, int64_t* __restrict__ send_pairs,
                             int64_t* __restrict__ send_code, int64_t* __restrict__ pair_pos,
                             int32_t* __restrict__ send_counts, int64_t* __restrict__ code_out) {
  extern __shared__ int32_t table[];
  const int nw = blockDim.x / 32;
  const int64_t n = t * k;
  const int el = e_total / world;
  const int keys = e_total + 1;  // key e_total: invalid pairs, sorted last
  int32_t* start = table + nw * keys;
  for (int i = threadIdx.x; i < nw * keys; i += blockDim.x) table[i] = 0;
  // The verdict: ids outside [-1, E), a token listing an expert twice.
  int bad = 0, dup = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t g = idx[i];
    if (g < -1 || g >= e_total) bad = 1;
    for (int64_t j = i / k * k; j < i; ++j) {
      if (g >= 0 && idx[j] == g) dup = 1;
    }
  }
  bad = __syncthreads_or(bad);  // also orders the zeroed table before its use
  dup = __syncthreads_or(dup);
  const int64_t code = host_code + (bad ? 2 : 0) + (dup ? 4 : 0);  // flux/ops/moe/handle.py: _BAD_ID, _DUPLICATE
  if (threadIdx.x == 0) *code_out = code;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t chunk = (n + nw - 1) / nw;
  const int64_t lo = warp * chunk, hi = min(n, lo + chunk);
  auto key_of = [&](int64_t i) -> int {
    const int64_t g = idx[i];
    return (code != 0 || g < 0 || g >= e_total) ? e_total : (int)g;
  };
  // Pass 1: per-warp counts of each key over the warp's contiguous range of pairs.
  for (int64_t base = lo; base < hi; base += 32) {
    const int64_t i = base + lane;
    if (i < hi) atomicAdd(&table[warp * keys + key_of(i)], 1);
  }
  __syncthreads();
  // Totals per key, then their exclusive scan (warp 0, 32 keys at a time): each key's first send
  // index.
  for (int key = threadIdx.x; key < keys; key += blockDim.x) {
    int total = 0;
    for (int w = 0; w < nw; ++w) total += table[w * keys + key];
    start[key] = total;
    if (key < e_total) send_counts[key] = total;
  }
  __syncthreads();
  if (warp == 0) {
    int carry = 0;
    for (int base = 0; base < keys; base += 32) {
      const int key = base + lane;
      const int v = key < keys ? start[key] : 0;
      int incl = v;
      for (int d = 1; d < 32; d *= 2) {
        const int u = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += u;
      }
      if (key < keys) start[key] = carry + incl - v;
      carry += __shfl_sync(0xffffffffu, incl, 31);
    }
  }
  __syncthreads();
  // Per-warp offsets: the key's first send index plus the earlier warps' pairs of that key.
  for (int key = threadIdx.x; key < keys; key += blockDim.x) {
    int acc = start[key];
    for (int w = 0; w < nw; ++w) {
      const int c = table[w * keys + key];
      table[w * keys + key] = acc;
      acc += c;
    }
  }
  __syncthreads();
  // Pass 2: each warp walks its range 32 pairs at a time; pairs of one key within the 32 are
  // ranked by lane (match_any), after the warp's earlier pairs of that key.
  for (int64_t base = lo; base < hi; base += 32) {
    const int64_t i = base + lane;
    const bool live = i < hi;
    const int key = live ? key_of(i) : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, key);
    const int before = __popc(peers & ((1u << lane) - 1u));
    int32_t* slot = &table[warp * keys + (live ? key : 0)];
    const int64_t si = (live ? *slot : 0) + before;  // the pair's send index
    __syncwarp();
    if (live) {
      if (key < e_total) {
        send_pairs[si] = i;
        pair_pos[i] = si;
        const int d = key / el, e = key % el;
        send_code[si] = encode(d, ((int64_t)e * world + rank) * cap + (si - start[key]));
      } else {
        send_pairs[si] = n;
        pair_pos[i] = n;
        send_code[si] = kNone;
      }
      if (before == 0) *slot += __popc(peers);  // the group's first lane advances the offset
    }
    __syncwarp();
  }
}

// The rows of this move: row i (src[src_row(i)], src_row(i) = order[i] / k, or i without order)
// to rank d = code[i] >> 32 at block row code[i] & 0xffffffff; tags (the send index i) beside
// them. With idx (dispatch, token rows): instead, token t's row once to each rank d owning one
// of its experts, at d's row (rank, t) = rank * cap + t, and for each pair i its send index and
// its token (order[i] / k) at its block row in the tags and tokens regions. The last block to
// finish writes the counts (if any: counts[d * E_l + e] into row `rank` of d's counts region)
// and releases every rank's flag (1 + code).
template <typename Vec>
__global__ void send_kernel(const char* __restrict__ src, const int64_t* __restrict__ order, int k,
                            const int64_t* __restrict__ dst_code, int64_t n, int64_t row_bytes, bool tags,
                            const int32_t* __restrict__ counts, const int64_t* __restrict__ code,
                            int32_t* __restrict__ done, char* const* __restrict__ ptrs, uint32_t** pads, int world,
                            int rank, int el, int64_t rows_off, int64_t tags_off, int64_t counts_off, int channel,
                            const int64_t* __restrict__ idx, int64_t tokens, int64_t cap, int64_t tok_off) {
  const int64_t vecs = row_bytes / (int64_t)sizeof(Vec);
  if (idx != nullptr) {
    const bool quiet = code != nullptr && *code != 0;  // a rank with a nonzero code sends nothing
    const int64_t items = min(tokens, cap) * world;  // a row past cap never lands in a neighbour's rows
    for (int64_t it = blockIdx.x; it < items && !quiet; it += gridDim.x) {
      const int64_t t = it / world;
      const int d = (int)(it % world);
      bool live = false;
      for (int j = 0; j < k; ++j) {
        const int64_t g = idx[t * k + j];
        live |= g >= 0 && g / el == d;
      }
      if (!live) continue;  // uniform across the block
      const Vec* from = reinterpret_cast<const Vec*>(src + t * row_bytes);
      Vec* to = reinterpret_cast<Vec*>(ptrs[d] + rows_off + ((int64_t)rank * cap + t) * row_bytes);
      for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) to[v] = from[v];
    }
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
      const int64_t c = dst_code[i];
      if (c < 0) continue;
      const int64_t d = c >> 32, row = c & 0xffffffffll;
      reinterpret_cast<int32_t*>(ptrs[d] + tags_off)[row] = (int32_t)i;
      reinterpret_cast<int32_t*>(ptrs[d] + tok_off)[row] = (int32_t)(order[i] / k);
    }
  }
  for (int64_t i = blockIdx.x; i < n && idx == nullptr; i += gridDim.x) {
    const int64_t c = dst_code[i];
    if (c < 0) continue;  // uniform across the block
    const int64_t d = c >> 32, row = c & 0xffffffffll;
    const int64_t s = order != nullptr ? order[i] / k : i;
    const Vec* from = reinterpret_cast<const Vec*>(src + s * row_bytes);
    Vec* to = reinterpret_cast<Vec*>(ptrs[d] + rows_off + row * row_bytes);
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) to[v] = from[v];
    if (tags && threadIdx.x == 0) *reinterpret_cast<int32_t*>(ptrs[d] + tags_off + row * 4) = (int32_t)i;
  }
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();  // this block's stores before it counts itself done
    last = atomicAdd(done, 1) == (int)gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence_system();
  if (counts != nullptr) {
    for (int i = threadIdx.x; i < world * el; i += blockDim.x) {
      const int d = i / el, e = i % el;
      reinterpret_cast<int32_t*>(ptrs[d] + counts_off)[rank * el + e] = counts[i];
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) *done = 0;  // for the next launch (stream-ordered)
  const uint32_t flag = 1u + (uint32_t)(code != nullptr ? *code : 0);
  for (int d = threadIdx.x; d < world; d += blockDim.x) {
    __threadfence_system();
    st_release_sys(pads[d] + channel * world + rank, flag);
  }
}

// Every block waits for every rank's flag and reads the codes; the last block past the wait
// resets the flags. Returns whether any rank's code is nonzero; codes[s] gets rank s's code.
__device__ bool wait_flags(uint32_t* const* pads, int world, int rank, int channel, uint64_t timeout_ms,
                           int32_t* done, int64_t* codes, const char* what) {
  __shared__ int any;
  __shared__ bool last;
  if (threadIdx.x == 0) any = 0;
  __syncthreads();
  uint32_t* mine = pads[rank] + channel * world;
  for (int s = threadIdx.x; s < world; s += blockDim.x) {
    const uint32_t v = bounded_wait(mine + s, 0u, false, timeout_ms, what, rank, s, channel);
    codes[s] = (int64_t)v - 1;
    if (v != 1u) atomicOr(&any, 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(done, 1) == (int)gridDim.x - 1;
  __syncthreads();
  if (last) {
    for (int s = threadIdx.x; s < world; s += blockDim.x) st_relaxed_sys(mine + s, 0u);
    __syncthreads();
    if (threadIdx.x == 0) *done = 0;
  }
  return any != 0;
}

// out: [E_l * W * C] rows; row j = (e, jj): expert e's jj-th row, from the sender s with
// cum[e][s-1] <= jj < cum[e][s], at its block row jj - cum[e][s-1]; zeros past expert e's total
// (or everywhere when any rank's code is nonzero). Without zero_pad those rows are not written
// (their recv_code still is): at decode they are most of the bytes (E_l = 32, W * C = 256: 7/8).
template <typename Vec>
__global__ void recv_pack_kernel(char* __restrict__ out, int64_t row_bytes, int64_t* __restrict__ recv_code,
                                 int64_t* __restrict__ counts_out, int64_t* __restrict__ verdict,
                                 const int64_t* __restrict__ counts_in, int64_t* __restrict__ counts_save,
                                 int64_t* __restrict__ send_code, int64_t* __restrict__ send_pairs,
                                 int64_t* __restrict__ pair_pos, int64_t n_send, int32_t* __restrict__ done,
                                 const char* __restrict__ ws, uint32_t* const* pads, int world, int rank, int el,
                                 int64_t cap, int64_t rows_off, int64_t tags_off, int64_t counts_off, int channel,
                                 uint64_t timeout_ms, bool zero_pad, int64_t tok_off) {
  __shared__ int64_t codes[kMaxWorld];
  const bool error = wait_flags(pads, world, rank, channel, timeout_ms, done, codes, "flux.moe_dispatch (rows)");
  // counts[s][e] of our experts: from the flags' payload (dispatch) or the handle (to_experts).
  auto count = [&](int s, int e) -> int64_t {
    if (error) return 0;
    if (counts_in != nullptr) return counts_in[s * el + e];
    return reinterpret_cast<const int32_t*>(ws + counts_off)[s * el + e];
  };
  if (blockIdx.x == 0) {
    for (int i = threadIdx.x; i < world * el; i += blockDim.x) {
      if (counts_save != nullptr) counts_save[i] = count(i / el, i % el);
    }
    for (int e = threadIdx.x; e < el && counts_out != nullptr; e += blockDim.x) {
      int64_t total = 0;
      for (int s = 0; s < world; ++s) total += count(s, e);
      counts_out[e] = total;
    }
    for (int s = threadIdx.x; s < world && verdict != nullptr; s += blockDim.x) verdict[s] = codes[s];
    if (error) {  // every rank sends and receives nothing: the sending side's routing says so too
      for (int64_t i = threadIdx.x; i < n_send; i += blockDim.x) {
        if (send_code != nullptr) send_code[i] = kNone;
        if (send_pairs != nullptr) send_pairs[i] = n_send;
        if (pair_pos != nullptr) pair_pos[i] = n_send;
      }
    }
  }
  const int64_t span = (int64_t)world * cap;
  const int64_t rows = (int64_t)el * span;
  const int64_t vecs = row_bytes / (int64_t)sizeof(Vec);
  for (int64_t j = blockIdx.x; j < rows; j += gridDim.x) {
    const int e = (int)(j / span);
    const int64_t jj = j % span;
    int64_t before = 0, src_row = -1;
    int sender = -1;
    for (int s = 0; s < world; ++s) {
      const int64_t c = count(s, e);
      if (jj < before + c) {
        sender = s;
        src_row = ((int64_t)e * world + s) * cap + (jj - before);
        break;
      }
      before += c;
    }
    Vec* to = reinterpret_cast<Vec*>(out + j * row_bytes);
    if (sender < 0) {
      if (zero_pad) {
        for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) to[v] = Vec{};
      }
      if (recv_code != nullptr && threadIdx.x == 0) recv_code[j] = kNone;
    } else {
      // A dispatch's block rows hold tags only: the row is the sender's token row.
      const int64_t data_row =
          tok_off < 0 ? src_row : (int64_t)sender * cap + reinterpret_cast<const int32_t*>(ws + tok_off)[src_row];
      const Vec* from = reinterpret_cast<const Vec*>(ws + rows_off + data_row * row_bytes);
      for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) to[v] = from[v];
      if (recv_code != nullptr && threadIdx.x == 0) {
        recv_code[j] = encode(sender, reinterpret_cast<const int32_t*>(ws + tags_off)[src_row]);
      }
    }
  }
}

// out[t, :] = sum over k (slot 0 first) of w[t, k] * back[pos[t * K + k], :], where a slot
// without a row (pos == n_send) adds w * 0 with w = 0, exactly as the reference's where/mul/add.
template <typename T>
__global__ void recv_sum_kernel(T* __restrict__ out, const float* __restrict__ weights,
                                const int64_t* __restrict__ pair_pos, int64_t t, int k, int64_t h, int64_t n_send,
                                int32_t* __restrict__ done, const char* __restrict__ ws, uint32_t* const* pads,
                                int world, int rank, int channel, uint64_t timeout_ms, int64_t rows_off) {
  __shared__ int64_t codes[kMaxWorld];
  wait_flags(pads, world, rank, channel, timeout_ms, done, codes, "flux.moe_combine (rows back)");
  const T* back = reinterpret_cast<const T*>(ws + rows_off);
  for (int64_t tok = blockIdx.x; tok < t; tok += gridDim.x) {
    for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
      float acc = 0.f;
      for (int j = 0; j < k; ++j) {
        const int64_t p = pair_pos[tok * k + j];
        const bool valid = p < n_send;
        const float w = valid ? (weights != nullptr ? weights[tok * k + j] : 1.f) : 0.f;
        const float x = valid ? static_cast<float>(back[p * h + c]) : 0.f;
        acc = __fadd_rn(acc, __fmul_rn(w, x));
      }
      out[tok * h + c] = T(acc);  // c10::BFloat16 / Half round to nearest even, as .to() does
    }
  }
}

int blocks_for(int64_t rows) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return (int)std::max<int64_t>(1, std::min<int64_t>(rows, (int64_t)sms * 8));
}

void check_i64(const at::Tensor& t, int64_t n, const char* op, const char* name) {
  FLUX_CHECK(t.is_cuda() && t.is_contiguous() && t.scalar_type() == at::kLong && t.numel() == n, op, name,
             " must be a contiguous int64 CUDA tensor of ", n, " elements");
}


}  // namespace

void moe_route_(const at::Tensor& topk_idx, int64_t num_experts, int64_t world, int64_t rank, int64_t capacity,
                int64_t host_code, at::Tensor& send_pairs, at::Tensor& send_code, at::Tensor& pair_pos,
                at::Tensor& send_counts, at::Tensor& code) {
  constexpr const char* op = "moe_route_";
  FLUX_CHECK(topk_idx.is_cuda() && topk_idx.dim() == 2 && topk_idx.is_contiguous() &&
                 topk_idx.scalar_type() == at::kLong,
             op, "topk_idx must be a contiguous [T, K] int64 CUDA tensor");
  FLUX_CHECK(world >= 1 && world <= kMaxWorld && num_experts % world == 0 && rank >= 0 && rank < world &&
                 capacity >= 1 && num_experts <= kMaxExperts,
             op, "bad group or sizes (at most ", kMaxWorld, " ranks and ", kMaxExperts, " experts)");
  const int64_t t = topk_idx.size(0), k = topk_idx.size(1), n = t * k;
  for (auto* p : {&send_pairs, &send_code, &pair_pos}) check_i64(*p, n, op, "routing outputs");
  check_i64(code, 1, op, "code");
  FLUX_CHECK(send_counts.is_cuda() && send_counts.scalar_type() == at::kInt && send_counts.numel() == num_experts, op,
             "send_counts must be int32 [E]");
  FLUX_CHECK(k >= 1 && n < (int64_t)1 << 31, op, "bad topk_idx shape");
  const int keys = (int)num_experts + 1;
  const int nw = (int)std::min<int64_t>(32, kRouteSmem / 4 / keys - 1);
  const c10::cuda::CUDAGuard guard(topk_idx.device());
  route_kernel<<<1, nw * 32, (size_t)(nw + 1) * keys * 4, at::cuda::getCurrentCUDAStream()>>>(
      topk_idx.data_ptr<int64_t>(), t, (int)k, (int)num_experts, (int)world, (int)rank, capacity, host_code,
      send_pairs.data_ptr<int64_t>(), send_code.data_ptr<int64_t>(), pair_pos.data_ptr<int64_t>(),
      send_counts.data_ptr<int32_t>(), code.data_ptr<int64_t>());
  FLUX_CHECK_LAUNCH();
}

void moe_send_(const at::Tensor& src, const std::optional<at::Tensor>& order, int64_t k, const at::Tensor& dst_code,
               bool tags, const std::optional<at::Tensor>& counts, const std::optional<at::Tensor>& code,
               at::Tensor& done, int64_t ptrs_dev, int64_t pads_dev, int64_t world, int64_t rank, int64_t local_experts,
               int64_t rows_off, int64_t tags_off, int64_t counts_off, int64_t channel,
               const std::optional<at::Tensor>& topk_idx, int64_t capacity, int64_t tok_off) {
  constexpr const char* op = "moe_send_";
  FLUX_CHECK(src.is_cuda() && src.is_contiguous() && src.dim() >= 1, op, "src must be a contiguous CUDA tensor");
  const int64_t n = dst_code.numel();
  check_i64(dst_code, n, op, "dst_code");
  if (order.has_value()) check_i64(*order, n, op, "order");
  if (code.has_value()) check_i64(*code, 1, op, "code");
  FLUX_CHECK(!counts.has_value() || (counts->is_cuda() && counts->scalar_type() == at::kInt &&
                                     counts->numel() == world * local_experts),
             op, "counts must be int32 [W * E_l]");
  FLUX_CHECK(done.is_cuda() && done.scalar_type() == at::kInt && done.numel() >= 1, op, "bad done counter");
  FLUX_CHECK(world >= 1 && world <= kMaxWorld && ptrs_dev != 0 && pads_dev != 0, op, "bad workspace");
  const int64_t row_bytes = src.size(0) == 0 ? 0 : src.numel() / src.size(0) * (int64_t)src.element_size();
  const int64_t* idx = nullptr;
  int64_t tokens = 0;
  if (topk_idx.has_value()) {  // a dispatch of token rows: src [T, ...], topk_idx [T, k]
    tokens = src.size(0);
    check_i64(*topk_idx, tokens * k, op, "topk_idx");
    // T > capacity comes with a nonzero code (flux/ops/moe/handle.py: _OVER_CAPACITY): nothing is sent.
    FLUX_CHECK(order.has_value() && tags && capacity >= 1 && tok_off >= 0 && local_experts >= 1, op,
               "a token-row dispatch needs order, tags, a capacity and a tokens region");
    idx = topk_idx->data_ptr<int64_t>();
  }
  const c10::cuda::CUDAGuard guard(src.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int blocks = blocks_for(std::max(n, tokens * world));
  moe_launch::by_vector(row_bytes == 0 ? 16 : row_bytes, {reinterpret_cast<uintptr_t>(src.data_ptr()), (uintptr_t)rows_off},
            [&](auto vec) {
              using Vec = decltype(vec);
              send_kernel<Vec><<<blocks, 256, 0, stream>>>(
                  static_cast<const char*>(src.data_ptr()), order.has_value() ? order->data_ptr<int64_t>() : nullptr,
                  (int)k, dst_code.data_ptr<int64_t>(), n, row_bytes, tags,
                  counts.has_value() ? counts->data_ptr<int32_t>() : nullptr,
                  code.has_value() ? code->data_ptr<int64_t>() : nullptr, done.data_ptr<int32_t>(),
                  reinterpret_cast<char* const*>(ptrs_dev), reinterpret_cast<uint32_t**>(pads_dev), (int)world,
                  (int)rank, (int)local_experts, rows_off, tags_off, counts_off, (int)channel, idx, tokens, capacity,
                  tok_off);
            });
  FLUX_CHECK_LAUNCH();
}

void moe_recv_pack_(at::Tensor& out, const std::optional<at::Tensor>& recv_code,
                    const std::optional<at::Tensor>& counts_out, const std::optional<at::Tensor>& verdict,
                    const std::optional<at::Tensor>& counts_in, const std::optional<at::Tensor>& counts_save,
                    const std::optional<at::Tensor>& send_code, const std::optional<at::Tensor>& send_pairs,
                    const std::optional<at::Tensor>& pair_pos, at::Tensor& done, int64_t ws_base, int64_t pads_dev,
                    int64_t world, int64_t rank, int64_t local_experts, int64_t capacity, int64_t rows_off,
                    int64_t tags_off, int64_t counts_off, int64_t channel, int64_t timeout_ms, bool zero_pad,
                    int64_t tok_off) {
  constexpr const char* op = "moe_recv_pack_";
  const int64_t rows = local_experts * world * capacity;
  FLUX_CHECK(out.is_cuda() && out.is_contiguous() && rows > 0 && out.numel() > 0 && out.numel() % rows == 0, op,
             "out must be a contiguous CUDA tensor of ", rows, " rows");
  FLUX_CHECK(world >= 1 && world <= kMaxWorld && ws_base != 0 && pads_dev != 0, op, "bad workspace");
  if (recv_code.has_value()) check_i64(*recv_code, rows, op, "recv_code");
  if (counts_out.has_value()) check_i64(*counts_out, local_experts, op, "counts_out");
  if (verdict.has_value()) check_i64(*verdict, world, op, "verdict");
  if (counts_in.has_value()) check_i64(*counts_in, world * local_experts, op, "counts_in");
  if (counts_save.has_value()) check_i64(*counts_save, world * local_experts, op, "counts_save");
  const int64_t n_send = send_code.has_value() ? send_code->numel() : 0;
  if (send_pairs.has_value()) check_i64(*send_pairs, n_send, op, "send_pairs");
  if (pair_pos.has_value()) check_i64(*pair_pos, n_send, op, "pair_pos");
  FLUX_CHECK(done.is_cuda() && done.scalar_type() == at::kInt && done.numel() >= 1, op, "bad done counter");
  const int64_t row_bytes = out.numel() / rows * (int64_t)out.element_size();
  const c10::cuda::CUDAGuard guard(out.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  auto ptr = [](const std::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr<int64_t>() : nullptr; };
  const int blocks = blocks_for(rows);
  moe_launch::by_vector(row_bytes, {reinterpret_cast<uintptr_t>(out.data_ptr()), (uintptr_t)(ws_base + rows_off)}, [&](auto vec) {
    using Vec = decltype(vec);
    recv_pack_kernel<Vec><<<blocks, 256, 0, stream>>>(
        static_cast<char*>(out.data_ptr()), row_bytes, ptr(recv_code), ptr(counts_out), ptr(verdict), ptr(counts_in),
        ptr(counts_save), ptr(send_code), ptr(send_pairs), ptr(pair_pos), n_send,
        done.data_ptr<int32_t>(),
        reinterpret_cast<const char*>(ws_base), reinterpret_cast<uint32_t* const*>(pads_dev), (int)world, (int)rank,
        (int)local_experts, capacity, rows_off, tags_off, counts_off, (int)channel, (uint64_t)timeout_ms, zero_pad,
        tok_off);
  });
  FLUX_CHECK_LAUNCH();
}

void moe_recv_sum_(at::Tensor& out, const std::optional<at::Tensor>& weights, const at::Tensor& pair_pos,
                   int64_t n_send, at::Tensor& done, int64_t ws_base, int64_t pads_dev, int64_t world, int64_t rank,
                   int64_t rows_off, int64_t channel, int64_t timeout_ms) {
  constexpr const char* op = "moe_recv_sum_";
  FLUX_CHECK(out.is_cuda() && out.is_contiguous() && out.dim() == 2, op, "out must be a contiguous [T, H] CUDA tensor");
  const int64_t t = out.size(0), h = out.size(1);
  FLUX_CHECK(pair_pos.numel() % std::max<int64_t>(t, 1) == 0, op, "pair_pos must be [T * K]");
  const int64_t k = t == 0 ? 1 : pair_pos.numel() / t;
  check_i64(pair_pos, t * k, op, "pair_pos");
  FLUX_CHECK(!weights.has_value() || (weights->is_cuda() && weights->is_contiguous() &&
                                       weights->scalar_type() == at::kFloat && weights->numel() == t * k),
             op, "weights must be a contiguous float32 [T, K] CUDA tensor");
  FLUX_CHECK(world >= 1 && world <= kMaxWorld && ws_base != 0 && pads_dev != 0, op, "bad workspace");
  const c10::cuda::CUDAGuard guard(out.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int blocks = blocks_for(t);  // at least one: every block takes part in the wait
  const float* w = weights.has_value() ? weights->data_ptr<float>() : nullptr;
  auto launch = [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    recv_sum_kernel<T><<<blocks, 256, 0, stream>>>(
        reinterpret_cast<T*>(out.data_ptr()), w, pair_pos.data_ptr<int64_t>(), t, (int)k, h, n_send,
        done.data_ptr<int32_t>(), reinterpret_cast<const char*>(ws_base), reinterpret_cast<uint32_t* const*>(pads_dev),
        (int)world, (int)rank, (int)channel, (uint64_t)timeout_ms, rows_off);
  };
  switch (out.scalar_type()) {
    case at::kFloat: launch((float*)nullptr); break;
    case at::kBFloat16: launch((c10::BFloat16*)nullptr); break;
    case at::kHalf: launch((c10::Half*)nullptr); break;
    default: FLUX_CHECK(false, op, "out must be float32, bfloat16 or float16, got ", out.scalar_type());
  }
  FLUX_CHECK_LAUNCH();
}

}  // namespace flux
