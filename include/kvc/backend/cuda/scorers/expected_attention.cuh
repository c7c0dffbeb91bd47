// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/scorers/expected_attention.cuh: CUDA kernel of ExpectedAttentionScorer (definition in
// scorers/expected_attention.hpp; CPU oracle in backend/cpu/scorers/expected_attention.hpp). Five launches, none
// waiting on the host:
//   1. prepare, grid (Hq, B): t0 (QueryStatistics::observed with reference=kvpress, else next_position[b], else
//      context_end), R̄ averaged from the device RopeTable (cos and sin summed in fp64 in position order: the CPU's
//      sums bit for bit), then mū = R̄ mu and Σ̄ = R̄ Σ R̄ᵀ, entry by entry with the CPU's rounding (no contraction);
//   2. logits, grid (64-key tiles, Hkv, B), 256 threads: the tile's keys, widened and transposed into shared memory
//      once for the whole group; per query head, P = K Σ̄ in 64-column passes (Σ̄ staged 32 rows at a time; each
//      thread 4 keys x 4 columns, fp32), kᵀΣ̄k = rowsum(P ⊙ K) and mū·k from the same staged keys, reduced over the
//      16 threads of a key row with shuffles: λ = s mū·k + (s²/2) kᵀΣ̄k into the workspace [B, Hq, N];
//   3. softmax, grid (Hq, B): max and sum of exp(λ - max) over [n_sink, n) (or [0, n) with normalize_sinks);
//   4. score, grid (slot blocks, Hkv, B): one warp per slot: the group's probabilities combined in query-head order
//      (mean or max, as the CPU), times (ā + ε)||v|| (lanes over the value row); each block's max of its scores;
//   5. sinks, one block: slots [0, min(n_sink, n)) of every head get (max of the block maxima) + 1.
// fp32 throughout (fp64 for the RoPE averages, as on the CPU). Every reduction has a fixed order (shuffle trees,
// fixed thread-to-data maps, no atomics), so scores are bit-identical from run to run. Kernels never allocate; the
// workspace holds mū, Σ̄, the logits, the softmax statistics and the block maxima (score_workspace_bytes).
//
// Preconditions the host cannot check (device data; the CPU returns invalid_argument): 0 <= t0 and
// t0 + n_future_positions <= rope.positions when t0 comes from next_position or the cache; the kernel clamps the
// averaging window into the table instead of reading past it. Lengths are clamped to [0, capacity].
#pragma once

#include <kvc/backend/cuda/config.cuh>
#include <kvc/backend/cuda/detail/block_reduce.cuh>
#include <kvc/core/norm_range.hpp>
#include <kvc/scorers/expected_attention.hpp>

#include <cstddef>
#include <math_constants.h>

namespace kvc::backend::cuda {

inline constexpr int ea_keys = 64;                 // keys per block of the logit kernel
inline constexpr int ea_cols = 64;                 // Σ̄ columns per pass
inline constexpr int ea_inner = 32;                // Σ̄ rows staged per step
inline constexpr int ea_threads = 256;             // 16 x 16 threads: 4 keys x 4 columns each
inline constexpr int ea_key_stride = ea_keys + 4;  // padded rows of the transposed key tile (float4-aligned)
inline constexpr int ea_score_warps = 8;           // slots in flight per block of the score kernel
inline constexpr int ea_softmax_threads = 1024;

/// Blocks per head of the score kernel: a pure function of the capacity (it also sizes the block maxima).
inline Index ea_score_blocks(Index tokens) noexcept {
  Index const n = (tokens + 32 * ea_score_warps - 1) / (32 * ea_score_warps);
  return n < 1 ? 1 : (n > 1024 ? 1024 : n);
}

/// Dynamic shared memory of the logit kernel: the transposed key tile and one staged block of Σ̄.
inline std::size_t ea_logits_smem(Index dim) noexcept {
  return static_cast<std::size_t>(dim * ea_key_stride + ea_inner * ea_cols) * sizeof(float);
}

/// Device workspace of the scorer (aligned pieces).
struct EAScratch {
  float* mu = nullptr;         ///< [B, Hq, d] mū
  float* sigma = nullptr;      ///< [B, Hq, d, d] Σ̄ (use_covariance only)
  float* logits = nullptr;     ///< [B, Hq, N] λ
  float* peak = nullptr;       ///< [B, Hq] softmax max
  float* inv = nullptr;        ///< [B, Hq] 1 / sum of exponentials (0 when empty)
  float* block_max = nullptr;  ///< [B, Hkv, ea_score_blocks(N)]

  static std::size_t bytes(KVExtents const& keys, Index query_heads, bool covariance) noexcept {
    auto f = [](auto... n) { return workspace_round(bytes_product(n..., sizeof(float))); };
    return bytes_sum(f(keys.batch, query_heads, keys.dim),
                     covariance ? f(keys.batch, query_heads, keys.dim, keys.dim) : std::size_t{0},
                     f(keys.batch, query_heads, keys.tokens), f(keys.batch, query_heads), f(keys.batch, query_heads),
                     f(keys.batch, keys.heads, ea_score_blocks(keys.tokens)));
  }
  static EAScratch carve(WorkspaceCarver& c, KVExtents const& keys, Index query_heads, bool covariance) {
    EAScratch s;
    s.mu = c.take<float>(keys.batch * query_heads * keys.dim);
    s.sigma = covariance ? c.take<float>(keys.batch * query_heads * keys.dim * keys.dim) : nullptr;
    s.logits = c.take<float>(keys.batch * query_heads * keys.tokens);
    s.peak = c.take<float>(keys.batch * query_heads);
    s.inv = c.take<float>(keys.batch * query_heads);
    s.block_max = c.take<float>(keys.batch * keys.heads * ea_score_blocks(keys.tokens));
    return s;
  }
  bool complete(bool covariance) const noexcept {
    return mu && (sigma || !covariance) && logits && peak && inv && block_max;
  }
};

/// Entry r of R̄ x for the d-vector x[0], x[stride], ... (cbar, sbar: [half]; pairs past rotary_dim untouched), with
/// the CPU's FutureRope::apply arithmetic: products and sums rounded separately (no fused multiply-add).
__device__ inline float ea_rbar_entry(float const* x, Index stride, Index r, float const* cbar, float const* sbar,
                                      Index half, bool neox) {
  if (r >= 2 * half)
    return x[r * stride];
  Index const i = neox ? (r < half ? r : r - half) : r / 2;
  Index const a = neox ? i : 2 * i, bb = neox ? i + half : 2 * i + 1;
  float const xa = x[a * stride], xb = x[bb * stride];
  return r == a ? __fsub_rn(__fmul_rn(cbar[i], xa), __fmul_rn(sbar[i], xb))
                : __fadd_rn(__fmul_rn(sbar[i], xa), __fmul_rn(cbar[i], xb));
}

/// Pass 1, grid (Hq, B): R̄ for sequence b, then mū and Σ̄ of query head hq into the workspace.
template <class C>
__global__ void ea_prepare_kernel(ExpectedAttentionScorer s, QueryStatistics<DeviceSpace> st, C cache, EAScratch ws) {
  float* const rbar = dynamic_shared<float>();  // [half] mean cos, then [half] mean sin
  __shared__ Index t0_shared;
  Index const b = blockIdx.y, hq = blockIdx.x, d = st.dim, item = b * st.heads + hq;
  Index const half = st.rope.empty() ? 0 : st.rope.rotary_dim / 2, count = s.n_future_positions;
  bool const neox = st.rope.style == RopeStyle::neox;
  if (threadIdx.x == 0 && half > 0) {
    Index t0 = s.reference == Reference::kvpress && st.observed > 0
                   ? st.observed
                   : (st.next_position ? st.next_position[b] : context_end(cache, b));
    Index const last_start = st.rope.positions - count;            // >= 0: checked on the host
    t0_shared = t0 < 0 ? 0 : (t0 > last_start ? last_start : t0);  // device data: clamped, never read past the table
  }
  __syncthreads();
  float* cbar = rbar;
  float* sbar = rbar + half;
  for (Index i = threadIdx.x; i < half; i += blockDim.x) {
    double sc = 0.0, ss = 0.0;
    for (Index p = t0_shared; p < t0_shared + count; ++p) {
      sc += static_cast<double>(st.rope.cos[p * half + i]);
      ss += static_cast<double>(st.rope.sin[p * half + i]);
    }
    cbar[i] = static_cast<float>(sc / static_cast<double>(count));
    sbar[i] = static_cast<float>(ss / static_cast<double>(count));
  }
  __syncthreads();
  float const* mu = st.mean + item * d;
  for (Index c = threadIdx.x; c < d; c += blockDim.x)
    ws.mu[item * d + c] = ea_rbar_entry(mu, 1, c, cbar, sbar, half, neox);
  if (!s.use_covariance)
    return;
  // Σ̄ = R̄ (Σ's columns), then R̄ along each row: entry (r, c) from the column pass's (r, a') and (r, b').
  float const* sg = st.covariance + item * d * d;
  for (Index x = threadIdx.x; x < d * d; x += blockDim.x) {
    Index const r = x / d, c = x % d;
    float v = 0.0f;
    if (c >= 2 * half) {
      v = ea_rbar_entry(sg + c, d, r, cbar, sbar, half, neox);
    } else {
      Index const i = neox ? (c < half ? c : c - half) : c / 2;
      Index const a = neox ? i : 2 * i, bb = neox ? i + half : 2 * i + 1;
      float const xa = ea_rbar_entry(sg + a, d, r, cbar, sbar, half, neox);
      float const xb = ea_rbar_entry(sg + bb, d, r, cbar, sbar, half, neox);
      v = c == a ? __fsub_rn(__fmul_rn(cbar[i], xa), __fmul_rn(sbar[i], xb))
                 : __fadd_rn(__fmul_rn(sbar[i], xa), __fmul_rn(cbar[i], xb));
    }
    ws.sigma[item * d * d + x] = v;
  }
}

/// Pass 2, grid (key tiles, Hkv, B), ea_threads threads: λ for the group's g query heads and the tile's keys.
template <class C>
__global__ void __launch_bounds__(ea_threads)
    ea_logits_kernel(C cache, Index query_heads, float scale, float half_scale_sq, bool covariance, EAScratch ws) {
  float4* const ea_smem = dynamic_shared<float4>();
  float* kt = reinterpret_cast<float*>(ea_smem);  // [d][ea_key_stride]: the tile's keys, transposed, fp32
  KVExtents const e = cache.keys.extents();
  Index const d = e.dim, b = blockIdx.z, h = blockIdx.y, g = query_heads / e.heads;
  float* sg = kt + d * ea_key_stride;  // [ea_inner][ea_cols]: a block of Σ̄
  Index const n = cache.clamped_length(b, h);
  int const tx = static_cast<int>(threadIdx.x) % 16, ty = static_cast<int>(threadIdx.x) / 16;
  auto const ks = cache.keys.scale(b, h);
  for (Index j0 = static_cast<Index>(blockIdx.x) * ea_keys; j0 < n; j0 += static_cast<Index>(gridDim.x) * ea_keys) {
    __syncthreads();  // the previous tile's readers are done
    for (Index x = threadIdx.x; x < ea_keys * d; x += ea_threads) {
      Index const key = x / d, c = x % d;
      kt[c * ea_key_stride + key] = j0 + key < n ? load(cache.keys.row(b, h, j0 + key)[c], ks) : 0.0f;
    }
    __syncthreads();
    for (Index lq = 0; lq < g; ++lq) {
      Index const item = b * query_heads + h * g + lq;
      float const* mu = ws.mu + item * d;
      float const* sigma = covariance ? ws.sigma + item * d * d : nullptr;
      float lin[4] = {}, quad[4] = {};
      for (Index c0 = 0; c0 < d; c0 += ea_cols) {
        float acc[4][4] = {};
        for (Index k0 = 0; covariance && k0 < d; k0 += ea_inner) {
          __syncthreads();  // the previous block of Σ̄ is read
          for (int x = static_cast<int>(threadIdx.x); x < ea_inner * ea_cols; x += ea_threads) {
            Index const k = k0 + x / ea_cols, c = c0 + x % ea_cols;
            sg[x] = k < d && c < d ? sigma[k * d + c] : 0.0f;
          }
          __syncthreads();
          Index const kn = d - k0 < ea_inner ? d - k0 : ea_inner;
          for (Index kk = 0; kk < kn; ++kk) {
            float4 const kv = *reinterpret_cast<float4 const*>(kt + (k0 + kk) * ea_key_stride + ty * 4);
            float4 const sv = *reinterpret_cast<float4 const*>(sg + kk * ea_cols + tx * 4);
            float const ka[4] = {kv.x, kv.y, kv.z, kv.w}, sa[4] = {sv.x, sv.y, sv.z, sv.w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
              for (int m = 0; m < 4; ++m)
                acc[i][m] += ka[i] * sa[m];
          }
        }
#pragma unroll
        for (int m = 0; m < 4; ++m) {  // this thread's 4 columns: (K Σ̄)[key, c] k[c] and mū[c] k[c]
          Index const c = c0 + tx * 4 + m;
          if (c >= d)
            continue;
          float const mc = mu[c];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            float const kc = kt[c * ea_key_stride + ty * 4 + i];
            lin[i] += mc * kc;
            quad[i] += acc[i][m] * kc;
          }
        }
      }
#pragma unroll
      for (int offset = 8; offset > 0; offset /= 2)  // the 16 threads of a key row (one half-warp), fixed tree
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          lin[i] += __shfl_xor_sync(full_mask, lin[i], offset);
          quad[i] += __shfl_xor_sync(full_mask, quad[i], offset);
        }
      if (tx == 0)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          Index const j = j0 + ty * 4 + i;
          if (j < n)
            ws.logits[item * e.tokens + j] = detail::finite_logit(scale * lin[i] + half_scale_sq * quad[i]);
        }
    }
  }
}

/// Pass 3, grid (Hq, B): the softmax's max and 1 / sum of exponentials over slots [from, n) of the head.
template <class C>
__global__ void __launch_bounds__(ea_softmax_threads)
    ea_softmax_kernel(ExpectedAttentionScorer s, C cache, Index query_heads, EAScratch ws) {
  __shared__ float scratch[ea_softmax_threads / warp_size];
  KVExtents const e = cache.keys.extents();
  Index const b = blockIdx.y, hq = blockIdx.x, h = hq / (query_heads / e.heads), item = b * query_heads + hq;
  Index const n = cache.clamped_length(b, h);
  Index const from = s.normalize_sinks ? 0 : (s.n_sink < n ? s.n_sink : n);
  float const* lg = ws.logits + item * e.tokens;
  float peak = -CUDART_INF_F;
  for (Index j = from + threadIdx.x; j < n; j += blockDim.x)
    peak = fmaxf(peak, lg[j]);
  peak = block_max(peak, scratch);
  float total = 0.0f;
  if (peak != -CUDART_INF_F)
    for (Index j = from + threadIdx.x; j < n; j += blockDim.x)
      total += expf(lg[j] - peak);
  total = block_sum(total, scratch);
  if (threadIdx.x == 0) {
    ws.peak[item] = peak;
    ws.inv[item] = total > 0.0f ? 1.0f / total : 0.0f;
  }
}

/// Pass 4, grid (ea_score_blocks, Hkv, B), one warp per slot: probabilities combined over the group in query-head
/// order (the CPU's order), value-norm weighting; padding -inf, sinks -inf until pass 5; each block's max of its
/// non-sink scores into the workspace.
template <class C>
__global__ void __launch_bounds__(ea_score_warps* warp_size)
    ea_score_kernel(ExpectedAttentionScorer s, C cache, Index query_heads, EAScratch ws, ScoreSpan<DeviceSpace> out) {
  __shared__ float scratch[ea_score_warps];
  KVExtents const e = cache.keys.extents();
  Index const b = blockIdx.z, h = blockIdx.y, g = query_heads / e.heads, dv = cache.values.extents().dim;
  Index const n = cache.clamped_length(b, h), sink_end = s.n_sink < n ? s.n_sink : n;
  int const warp = static_cast<int>(threadIdx.x) / warp_size, lane = static_cast<int>(threadIdx.x) % warp_size;
  float local = -CUDART_INF_F;
  auto const vs = cache.values.scale(b, h);
  Index const stride = static_cast<Index>(gridDim.x) * ea_score_warps;
  for (Index j = static_cast<Index>(blockIdx.x) * ea_score_warps + warp; j < e.tokens; j += stride) {
    if (j >= n || j < sink_end) {  // warp-uniform
      if (lane == 0)
        out(b, h, j) = -CUDART_INF_F;
      continue;
    }
    float norm = 0.0f;
    if (s.use_vnorm) {
      auto const* v = cache.values.row(b, h, j);
      float sq = 0.0f;
      for (Index c = lane; c < dv; c += warp_size) {
        float const x = load(v[c], vs);
        sq += x * x;
      }
      norm = sqrtf(warp_sum(sq));
    }
    float acc = 0.0f;
    for (Index base = 0; base < g; base += warp_size) {
      Index const lq = base + lane;
      float p = 0.0f;
      if (lq < g) {
        Index const item = b * query_heads + h * g + lq;
        float const logit = ws.logits[item * e.tokens + j];  // -inf: a non-finite key, probability 0 (the CPU's)
        p = logit == -CUDART_INF_F ? 0.0f : expf(logit - ws.peak[item]) * ws.inv[item];
      }
      int const here = g - base < warp_size ? static_cast<int>(g - base) : warp_size;
      for (int k = 0; k < here; ++k) {
        float const pk = __shfl_sync(full_mask, p, k);
        acc = gqa_combine(s.gqa, base + k, acc, pk);
      }
    }
    float const a = expected_attention_score(s, g, acc, norm);
    if (lane == 0)
      out(b, h, j) = a;
    local = fmaxf(local, a);
  }
  float const top = block_max(local, scratch);
  if (threadIdx.x == 0)
    ws.block_max[(b * e.heads + h) * gridDim.x + blockIdx.x] = top;
}

/// Pass 5, one block: the sinks of every head get (max of every non-sink score) + 1 (0 + 1 when there is none).
template <class C>
__global__ void __launch_bounds__(ea_softmax_threads)
    ea_sink_kernel(ExpectedAttentionScorer s, C cache, Index blocks, EAScratch ws, ScoreSpan<DeviceSpace> out) {
  __shared__ float scratch[ea_softmax_threads / warp_size];
  KVExtents const e = cache.keys.extents();
  float top = -CUDART_INF_F;
  for (Index i = threadIdx.x; i < e.batch * e.heads * blocks; i += blockDim.x)
    top = fmaxf(top, ws.block_max[i]);
  top = block_max(top, scratch);
  float const sink = expected_attention_sink_score(top);
  for (Index bh = 0; bh < e.batch * e.heads; ++bh) {
    Index const n = cache.clamped_length(bh / e.heads, bh % e.heads);
    Index const sink_end = s.n_sink < n ? s.n_sink : n;
    for (Index j = threadIdx.x; j < sink_end; j += blockDim.x)
      out.row(bh / e.heads, bh % e.heads)[j] = sink;
  }
}

}  // namespace kvc::backend::cuda

namespace kvc {

/// ExpectedAttention on CUDA (see the file comment). Workspace (device): mū [B, Hq, d], Σ̄ [B, Hq, d, d] (with
/// use_covariance), logits [B, Hq, N], softmax statistics [B, Hq] x 2 and block maxima [B, Hkv, <= 1024] fp32: 16 MiB
/// of logits at Hq = 32 and N = 128K. Statistics, RoPE table and next_position live on the device. Limits: batch and
/// query heads <= 65535; the transposed 64-key tile in shared memory (d <= 768 on Hopper, opted in past 48 KiB).
template <>
struct Kernel<ExpectedAttentionScorer, Cuda> {
  template <class Obs>
  static std::size_t workspace_bytes(Cuda const&, ExpectedAttentionScorer const& s, KVExtents const& keys,
                                     Obs const& obs) {
    Index query_heads = keys.heads;
    if constexpr (HasQueryStatistics<Obs>)
      query_heads = obs.query_statistics.heads;
    return backend::cuda::EAScratch::bytes(keys, query_heads, s.use_covariance);
  }

  template <KVCacheView C, class Obs>
  static Status run(Cuda const& cuda, ExpectedAttentionScorer const& s, C const& cache, Obs const& obs,
                    ScoreSpan<DeviceSpace> out, Workspace ws) {
    namespace bc = backend::cuda;
    KVC_RETURN_IF_ERROR(s.check());
    auto const& st = obs.query_statistics;
    KVExtents const e = cache.keys.extents();
    Index const d = e.dim;
    if (st.batch != e.batch || st.dim != d || e.heads <= 0 || st.heads < 1 || st.heads % e.heads != 0)
      return {Errc::invalid_argument,
              "kvc::score(expected_attention, Cuda): query statistics must be [batch, Hq, d_k] with Hq a multiple "
              "of Hkv"};
    if (st.mean == nullptr || (s.use_covariance && st.covariance == nullptr))
      return {Errc::invalid_argument,
              "kvc::score(expected_attention, Cuda): statistics need `mean`, and `covariance` unless "
              "use_covariance=false"};
    if (!st.rope.empty()) {  // what the host can see of the table; t0 itself may be device data
      if (st.rope.sin == nullptr || st.rope.rotary_dim <= 0 || st.rope.rotary_dim % 2 != 0 || st.rope.rotary_dim > d)
        return {Errc::invalid_argument, "RopeTable: needs cos and sin, and an even `rotary_dim` in (0, head dim]"};
      if (st.rope.positions < s.n_future_positions)
        return {Errc::invalid_argument,
                "kvc::score(expected_attention, Cuda): the RoPE table has fewer rows than n_future_positions"};
      Index last = 0;
      if (s.reference == Reference::kvpress && st.observed > 0 &&
          (__builtin_add_overflow(st.observed, s.n_future_positions - 1, &last) || last >= st.rope.positions))
        return {Errc::invalid_argument,
                "RopeTable: a position to rotate is past the table's `positions` rows (t0 = observed)"};
    }
    KVC_RETURN_IF_ERROR(bc::head_grid_status(
        e.batch, st.heads, "kvc::score(expected_attention, Cuda): batch and query heads must be <= 65535"));
    if (e.batch * e.heads == 0 || e.tokens == 0)
      return {};
    WorkspaceCarver carve(ws);
    auto const scratch = bc::EAScratch::carve(carve, e, st.heads, s.use_covariance);
    if (!scratch.complete(s.use_covariance))
      return {Errc::out_of_capacity,
              "kvc::score(expected_attention, Cuda): workspace smaller than score_workspace_bytes()"};
    KVC_RETURN_IF_ERROR(bc::pending_status());
    std::size_t const smem = bc::ea_logits_smem(d);
    KVC_RETURN_IF_ERROR(bc::shared_memory_status(  // above 48 KiB, launch() opts the kernel in
        smem,
        "kvc::score(expected_attention, Cuda): head dim too large for the 64-key tile in the device's shared "
        "memory"));
    std::size_t const rope_smem =
        static_cast<std::size_t>(st.rope.empty() ? 0 : st.rope.rotary_dim) * sizeof(float);  // <= d floats
    KVC_RETURN_IF_ERROR(bc::shared_memory_status(
        rope_smem, "kvc::score(expected_attention, Cuda): rotary_dim too large for the device's shared memory"));
    float const scale = s.scale > 0.0f ? s.scale : 1.0f / sqrtf(static_cast<float>(d));
    float const half_scale_sq = 0.5f * scale * scale;
    Index const blocks = bc::ea_score_blocks(e.tokens);
    auto const batch = static_cast<unsigned>(e.batch), kv_heads = static_cast<unsigned>(e.heads),
               query_heads = static_cast<unsigned>(st.heads);
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::score(expected_attention, Cuda)", bc::ea_prepare_kernel),
                                   dim3(query_heads, batch), 256, rope_smem, cuda.stream, s, st, cache, scratch));
    KVC_RETURN_IF_ERROR(bc::launch(
        KVC_CUDA_KERNEL("kvc::score(expected_attention, Cuda)", bc::ea_logits_kernel),
        dim3(bc::grid_dim((e.tokens + bc::ea_keys - 1) / bc::ea_keys, 2147483647), kv_heads, batch), bc::ea_threads,
        smem, cuda.stream, cache, st.heads, scale, half_scale_sq, s.use_covariance, scratch));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::score(expected_attention, Cuda)", bc::ea_softmax_kernel),
                                   dim3(query_heads, batch), bc::ea_softmax_threads, 0, cuda.stream, s, cache, st.heads,
                                   scratch));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::score(expected_attention, Cuda)", bc::ea_score_kernel),
                                   dim3(static_cast<unsigned>(blocks), kv_heads, batch),
                                   bc::ea_score_warps * bc::warp_size, 0, cuda.stream, s, cache, st.heads, scratch,
                                   out));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::score(expected_attention, Cuda)", bc::ea_sink_kernel), 1,
                                   bc::ea_softmax_threads, 0, cuda.stream, s, cache, blocks, scratch, out));
    return {};
  }
};

}  // namespace kvc
