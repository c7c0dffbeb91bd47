// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/attention/corrected.cuh: the CUDA epilogue of MomentKV's corrected attention (definitions in
// attention/corrected.hpp; CPU oracle in backend/cpu/attention/corrected.hpp). After Kernel<Attention, Cuda> wrote
// (out, lse), one warp per query row of KV head g's group: lse_E = log n + c qᵀk̄ and f̂_E = v̄ + (c/n) C̃ q (zeroth
// order: v̄), merged in place with the retained state by detail::merge_evicted. fp32 arithmetic; K/V, queries and
// moments may be 16-bit.
#pragma once

#include <kvc/attention/corrected.hpp>
#include <kvc/backend/cuda/config.cuh>
#include <kvc/backend/cuda/detail/attend.cuh>
#include <kvc/scorers/moments.hpp>

#include <cmath>
#include <cstddef>

namespace kvc::backend::cuda {

inline constexpr int corrected_warps = 8;  // query rows per block

/// Grid (row blocks, Hkv, B), one warp per row r of KV head g's group (G · n rows: query head g·G + r / n, query
/// r % n). A head with n = 0 leaves its rows as kvc::attend wrote them. Lane a takes value indices a, a + 32, ...
/// and reads C̃'s row a from the state (a row per lane, cached: the O(d²) epilogue reads each row once per query).
/// Every lane computes the same lse, lane 0 stores it after the warp has read the old one.
template <class Q, class MT>
__global__ void __launch_bounds__(corrected_warps* warp_size)
    corrected_kernel(Q queries, MomentState<DeviceSpace, MT> st, float scale, float tau, bool first, Index dv,
                     float* out, float* lse) {
  float* const q_rows = dynamic_shared<float>();  // [corrected_warps, d_k]
  KVExtents const qe = queries.rows.extents();
  Index const dk = qe.dim, group = qe.heads / st.heads, rows = group * qe.tokens;
  int const warp = static_cast<int>(threadIdx.x) / warp_size, lane = static_cast<int>(threadIdx.x) % warp_size;
  Index const b = blockIdx.z, g = blockIdx.y, r = static_cast<Index>(blockIdx.x) * corrected_warps + warp;
  Index const ne = st.count[st.head(b, g)];
  if (r >= rows || ne <= 0)
    return;  // whole warp leaves together: no block-level barrier below
  Index const hq = g * group + r / qe.tokens, i = r % qe.tokens, row = (b * qe.heads + hq) * qe.tokens + i;
  float* q = q_rows + warp * dk;
  auto const* src = queries.rows.row(b, hq, i);
  MT const* km = st.key_mean_of(b, g);
  float dot = 0.0f;  // qᵀk̄
  for (Index c = lane; c < dk; c += warp_size) {
    q[c] = to_float(src[c]);
    dot += q[c] * to_float(km[c]);
  }
  dot = warp_sum(dot);
  __syncwarp();  // every lane's q[c] before the matvec reads them all
  float const lse_r = lse[row];
  float const lse_e = logf(static_cast<float>(ne)) + scale * dot, beta = scale / static_cast<float>(ne);
  MT const* vm = st.value_mean_of(b, g);
  MT const* cm = st.comoment_of(b, g);
  float* o = out + row * dv;
  for (Index a = lane; a < dv; a += warp_size) {
    float t = 0.0f;  // (C̃ q)[a]
    if (first)
      for (Index c = 0; c < dk; ++c)
        t += detail::clamp_small(to_float(cm[a * dk + c]), tau) * q[c];
    float const est = to_float(vm[a]) + (first ? beta * t : 0.0f);
    detail::merge_evicted<float>(o + a, lse_r, &est, lse_e, 1);
  }
  __syncwarp();  // every lane has read lse_r
  if (lane == 0)
    lse[row] = detail::log_add_exp(lse_r, lse_e);
}

}  // namespace kvc::backend::cuda

namespace kvc {

/// The corrected attention's epilogue on CUDA (no workspace: it reads the moments in place).
template <>
struct Kernel<CorrectedAttention, Cuda> {
  template <class Q, KVCacheView C, class MT>
  static std::size_t workspace_bytes(Cuda const&, CorrectedAttention const&, Q const&, C const&,
                                     MomentState<DeviceSpace, MT> const&) {
    return 0;
  }

  /// Merges each query row's retained state (out [B, Hq, n, d_v], lse [B, Hq, n], written by kvc::attend) with
  /// the evicted set of its KV head, in place.
  template <class Q, KVCacheView C, class MT>
  static Status run(Cuda const& cuda, CorrectedAttention const& op, Q const& queries, C const& cache,
                    MomentState<DeviceSpace, MT> const& moments, float* out, float* lse, Workspace) {
    namespace bc = backend::cuda;
    KVExtents const q = queries.rows.extents(), k = cache.keys.extents();
    Index const dk = k.dim, dv = cache.values.extents().dim;
    if (q.rows() == 0 || k.heads == 0)
      return {};
    if (q.heads % k.heads != 0 || q.batch != k.batch || q.dim != dk)
      return {Errc::invalid_argument,
              "kvc::attend_corrected(Cuda): queries must be [batch, Hq, n, d_k] with Hq a multiple of Hkv"};
    KVC_RETURN_IF_ERROR(
        bc::head_grid_status(k.batch, k.heads, "kvc::attend_corrected(Cuda): batch and heads must be <= 65535"));
    std::size_t const smem = static_cast<std::size_t>(bc::corrected_warps * dk) * sizeof(float);
    KVC_RETURN_IF_ERROR(bc::shared_memory_status(smem, "kvc::attend_corrected(Cuda): d_k too large"));
    KVC_RETURN_IF_ERROR(bc::pending_status());
    float const c = op.attention.scale > 0.0f ? op.attention.scale : 1.0f / std::sqrt(static_cast<float>(dk));
    Index const rows = q.heads / k.heads * q.tokens;
    dim3 const grid(bc::grid_dim((rows + bc::corrected_warps - 1) / bc::corrected_warps, 2147483647),
                    static_cast<unsigned>(k.heads), static_cast<unsigned>(k.batch));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::attend_corrected(Cuda)", bc::corrected_kernel), grid,
                                   bc::corrected_warps * bc::warp_size, smem, cuda.stream, queries, moments, c,
                                   op.clamp_tau, op.order == MomentOrder::first, dv, out, lse));
    return {};
  }
};

}  // namespace kvc
