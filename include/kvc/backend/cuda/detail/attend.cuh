// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/detail/attend.cuh: the CUDA attention kernel over any token source (GQA, causal by position,
// online softmax, fp32 accumulation): KV views of every layout and accessor, and the packed store.
// Shared: corrected attention builds on it and the packed store is one of its sources; the public header is
// kvc/backend/cuda/attention/attend.cuh.
#pragma once

#include <kvc/attention/attend.hpp>
#include <kvc/backend/cuda/config.cuh>
#include <kvc/backend/cuda/detail/logits.cuh>

#include <cstddef>
#include <math_constants.h>
#include <utility>

namespace kvc::backend::cuda {

inline constexpr int attend_warps = 4;       // query rows per block
inline constexpr int attend_max_chunks = 8;  // output channels per lane: d_v <= 256

/// What attend_kernel reads: `Sources` (by value, a kernel argument) gives the layer's shape and one source per
/// (sequence, KV head); a source gives that head's tokens. Two implementations: CacheSources (a KV view of any
/// layout and accessor) and PackedSources (RDKV's and KIVI's packed store, backend/cuda/attention/packed.cuh), so
/// the softmax, the causal mask, non-finite handling, GQA and the output are written once for both.
///   Sources: kv_heads(), value_dim(), query_floats() (floats per prepared query row, shared memory),
///            context_end(b) (where queries without positions end), source(b, h);
///   source:  tokens(), position(j), prepare(q, row, scale, lane) (the warp writes at most query_floats() floats:
///            the query row times the logit scale, in the source's channel order), logit(j, q) (the dot of token j
///            with the prepared query; it reads only what prepare wrote), value_row(j) (a reader: element c of token
///            j's value row in fp32 by operator()(c)).
/// The sources of a KV view.
template <class C>
struct CacheSources {
  using VScale = decltype(std::declval<C const&>().values.scale(0, 0));  // kvc::Unit unless the cache is fp8

  C cache;

  struct Head {
    C const& cache;
    Index b, h, n;
    VScale vs;

    struct Row {
      typename C::values_type::value_type const* v;
      VScale s;
      __device__ float operator()(Index c) const { return load(v[c], s); }
    };

    __device__ Index tokens() const { return n; }
    __device__ Index position(Index j) const { return cache.position(b, h, j); }
    template <class T>
    __device__ void prepare(float* q, T const* row, float scale, int lane) const {
      for (Index c = lane; c < cache.keys.extents().dim; c += warp_size)
        q[c] = scale * to_float(row[c]);
    }
    __device__ float logit(Index j, float const* q) const { return key_dot(cache, b, h, j, q); }
    __device__ Row value_row(Index j) const { return {cache.values.row(b, h, j), vs}; }
  };

  __host__ __device__ Index kv_heads() const { return cache.keys.extents().heads; }
  __host__ __device__ Index value_dim() const { return cache.values.extents().dim; }
  __host__ __device__ Index query_floats() const { return cache.keys.extents().dim; }
  __device__ Index context_end(Index b) const { return ::kvc::context_end(cache, b); }
  __device__ Head source(Index b, Index h) const {
    return {cache, b, h, cache.clamped_length(b, h), cache.values.scale(b, h)};
  }
};

/// One warp per query row (b, q, i), grid (row blocks, Hq, batch); the row's KV head is q / (Hq / Hkv). The warp
/// prepares the query in shared memory, then walks the head's tokens in chunks of 32, one token per lane, with an
/// online softmax (one pass: each logit computed once): the chunk's max, the running max, denominator and output
/// accumulators rescaled by e^(m_old - m_new); then the warp walks the chunk's weights with shuffles while lanes
/// accumulate output channels lane, lane + 32, ..., so a value row is read coalesced. A token past the query's
/// position (when causal) or with a non-finite logit (a NaN or Inf key: detail::finite_logit, as on the CPU) gets
/// weight 0 and its value is not read. A row that sees no token gets zeros and lse = -inf.
template <class Q, class Sources>
__global__ void __launch_bounds__(attend_warps* warp_size)
    attend_kernel(Attention op, Q queries, Sources sources, AttendOutput<DeviceSpace> out, float scale) {
  float* const q_rows = dynamic_shared<float>();  // [attend_warps, query_floats]
  KVExtents const qe = queries.rows.extents();
  Index const qf = sources.query_floats(), dv = sources.value_dim();
  int const warp = static_cast<int>(threadIdx.x) / warp_size, lane = static_cast<int>(threadIdx.x) % warp_size;
  Index const b = blockIdx.z, hq = blockIdx.y, i = static_cast<Index>(blockIdx.x) * attend_warps + warp;
  if (i >= qe.tokens)
    return;  // whole warp leaves together: no block-level barrier below
  auto const src = sources.source(b, hq / (qe.heads / sources.kv_heads()));
  Index const n = src.tokens();
  float* q = q_rows + warp * qf;
  src.prepare(q, queries.rows.row(b, hq, i), scale, lane);
  __syncwarp();
  Index const q_pos = queries.positions ? queries.positions[b * qe.tokens + i] : sources.context_end(b) - qe.tokens + i;
  float m = -CUDART_INF_F, l = 0.0f, acc[attend_max_chunks] = {};
  for (Index base = 0; base < n; base += warp_size) {
    Index const j = base + lane;
    float logit = -CUDART_INF_F;
    if (j < n && (!op.causal || src.position(j) <= q_pos))
      logit = detail::finite_logit(src.logit(j, q));
    float const peak = fmaxf(m, warp_max(logit));
    if (peak == -CUDART_INF_F)
      continue;  // nothing visible yet (the same in every lane)
    float const alpha = m == -CUDART_INF_F ? 0.0f : expf(m - peak);
    float const p = logit == -CUDART_INF_F ? 0.0f : expf(logit - peak);
    m = peak;
    l = l * alpha + p;
    for (int k = 0; k < attend_max_chunks; ++k)
      acc[k] *= alpha;
    int const chunk = n - base < warp_size ? static_cast<int>(n - base) : warp_size;
    for (int s = 0; s < chunk; ++s) {
      float const w = __shfl_sync(full_mask, p, s);
      if (w == 0.0f)
        continue;
      auto const v = src.value_row(base + s);
      for (int k = 0; k < attend_max_chunks; ++k) {
        Index const c = lane + k * warp_size;
        if (c < dv)
          acc[k] += w * v(c);
      }
    }
  }
  float const total = warp_sum(l);
  Index const at = (b * qe.heads + hq) * qe.tokens + i;
  for (int k = 0; k < attend_max_chunks; ++k) {
    Index const c = lane + k * warp_size;
    if (c < dv)
      out.out[at * dv + c] = total > 0.0f ? acc[k] / total : 0.0f;
  }
  if (out.lse && lane == 0)
    out.lse[at] = total > 0.0f ? m + logf(total) : -CUDART_INF_F;
}

/// The errors an entry point of attend_kernel reports (string literals: a Status never allocates).
struct AttendMessages {
  char const* value_dim;      ///< d_v outside [1, 256]
  char const* grid;           ///< batch or query heads above 65535
  char const* shared_memory;  ///< the prepared queries above the device's shared memory
};

/// Launches attend_kernel<Q, Sources> (`site`, `kernel`: KVC_CUDA_KERNEL of it) over `sources` for every query row,
/// after the checks every source shares. `scale`: the logit scale (Attention::scale, or 1 / sqrt(d_k) when 0).
template <class Q, class Sources>
Status launch_attend(Cuda const& cuda, Attention const& op, Q const& queries, Sources const& sources,
                     AttendOutput<DeviceSpace> out, float scale, AttendMessages const& messages, KernelSite const& site,
                     void (*kernel)(Attention, Q, Sources, AttendOutput<DeviceSpace>, float)) {
  KVExtents const q = queries.rows.extents();
  if (sources.value_dim() > attend_max_chunks * warp_size || sources.value_dim() < 1)
    return {Errc::invalid_argument, messages.value_dim};
  if (q.rows() == 0)
    return {};
  KVC_RETURN_IF_ERROR(head_grid_status(q.batch, q.heads, messages.grid));
  auto const smem = static_cast<std::size_t>(attend_warps * sources.query_floats()) * sizeof(float);
  KVC_RETURN_IF_ERROR(shared_memory_status(smem, messages.shared_memory));
  KVC_RETURN_IF_ERROR(pending_status());
  dim3 const grid(grid_dim((q.tokens + attend_warps - 1) / attend_warps, 2147483647), static_cast<unsigned>(q.heads),
                  static_cast<unsigned>(q.batch));
  return launch(site, kernel, grid, attend_warps * warp_size, smem, cuda.stream, op, queries, sources, out, scale);
}

}  // namespace kvc::backend::cuda

namespace kvc {

/// Attention on CUDA: no workspace. Limits: d_v <= 256, batch and query heads <= 65535, d_k within shared memory.
template <>
struct Kernel<Attention, Cuda> {
  template <class Q, KVCacheView C>
  static std::size_t workspace_bytes(Cuda const&, Attention const&, Q const&, C const&) {
    return 0;
  }

  template <Element T, KVCacheView C>
  static Status run(Cuda const& cuda, Attention const& op, AttendQueries<T, DeviceSpace> const& queries, C const& cache,
                    AttendOutput<DeviceSpace> out, Workspace) {
    namespace bc = backend::cuda;
    using Q = AttendQueries<T, DeviceSpace>;
    float const scale = op.scale > 0 ? op.scale : 1.0f / sqrtf(static_cast<float>(cache.keys.extents().dim));
    return bc::launch_attend(
        cuda, op, queries, bc::CacheSources<C>{cache}, out, scale,
        {"kvc::attend(Cuda): d_v must be in [1, 256]", "kvc::attend(Cuda): batch and heads must be <= 65535",
         "kvc::attend(Cuda): d_k too large for shared memory"},
        KVC_CUDA_KERNEL("kvc::attend(Cuda)", (bc::attend_kernel<Q, bc::CacheSources<C>>)));
  }
};

}  // namespace kvc
