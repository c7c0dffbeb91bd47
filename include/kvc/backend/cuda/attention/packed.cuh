// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/attention/packed.cuh: CUDA attention over the packed mixed-precision store (RDKV's TriZone zones
// A + B, kvc/store/packed.hpp), reading the codes directly and dequantising in registers: nothing is unpacked to
// memory, so a step reads the packed bytes once (plus the K parameters of each token group, once per query row).
//
// One block of packed_threads per (sequence, query head, query row); GQA maps query head q to KV head q / (Hq / Hkv).
// The block walks the head's kept tokens (packed order) in chunks of at most packed_threads tokens:
//   1. stage: for each K token group the chunk touches (at most packed_max_groups, one warp each), the scaled query
//      q'_i = q_i * a_{g,i} of every packed channel i and the bias sum_i q_i * c_{g,i} (the affine form
//      x̂ = code * a + c of kvc::affine), with q already permuted by k_perm and multiplied by the logit scale. 16-bit
//      channels (raw FP16 keys) stage q'_i = q_i and no bias;
//   2. logits: one thread per token: bias + sum over the 2/4/8-bit segments of q' · code (split layouts of
//      kvc/quant/bitpack.hpp, 4 codes per byte read) + sum over the raw FP16 channels of q · k; -inf past the query's
//      position when causal;
//   3. online softmax: the chunk's max (block-wide), the running max and each thread's running sum rescaled;
//   4. values: thread (slice, c) accumulates output channel c over the chunk's tokens of its slice, V dequantised
//      per token (codes of segments 2/4/8, raw FP16 for zone B) with that token's (group's) parameters.
// At the end the slices' partial sums are added in slice order, divided by the softmax denominator, and the LSE is
// written. fp32 throughout. Queries without positions sit at the last positions before the sequence's context end
// (the largest PackedHead::end_position of its heads), as on the CPU.
// Shape note: a decode step (n = 1) launches only batch x Hq blocks, each streaming its KV head's bytes on one SM;
// splitting a head's tokens over several blocks (merged through their LSEs, as kvc::merge_attention does) is the
// next step if the benchmark shows it latency-bound.
//
// Same definition as the CPU kernel (backend/cpu/attention/packed.hpp): attention over the dequantised K̂, V̂ of the
// kept tokens. Not bit-identical: the dot products run in another order (and factored as q'·code + bias instead of
// q·x̂), sums are reduced in another order, and nvcc contracts multiply-adds into FMAs. The parity tests compare
// within 1e-5 relative (plus 1e-5 absolute for outputs near 0): logits of order 10 in fp32 carry ~1e-6 relative
// rounding, which reaches the outputs as ~1e-6 relative.
#pragma once

#include <kvc/attention/attend.hpp>
#include <kvc/attention/packed.hpp>
#include <kvc/backend/cuda/config.cuh>
#include <kvc/backend/cuda/detail/block_reduce.cuh>
#include <kvc/quant/bitpack.hpp>
#include <kvc/quant/minmax.hpp>
#include <kvc/store/packed.hpp>

#include <cstddef>
#include <cstdint>
#include <math_constants.h>

namespace kvc::backend::cuda {

inline constexpr int packed_threads = 256;                            ///< threads (and at most tokens) per chunk
inline constexpr int packed_max_groups = packed_threads / warp_size;  ///< K token groups staged per chunk
inline constexpr Index packed_max_value_dim = packed_threads;         ///< d_v limit (one channel per thread)

/// Tokens per chunk for K token groups of `group` tokens (0 = one group): a whole number of groups, at most
/// packed_max_groups of them (groups of >= packed_threads tokens: a chunk of packed_threads spans at most two).
KVC_HOST_DEVICE constexpr Index packed_chunk(Index group) noexcept {
  if (group <= 0 || group >= packed_threads)
    return packed_threads;
  Index const per = packed_threads / group;
  return group * (per < packed_max_groups ? per : packed_max_groups);
}

/// Dynamic shared memory of packed_attend_kernel: the permuted query and the staged groups' q', each
/// PackedKVView::max_k_channels() floats.
inline std::size_t packed_shared_bytes(PackedKVView<DeviceSpace> const& kv) noexcept {
  return static_cast<std::size_t>((1 + packed_max_groups) * kv.max_k_channels()) * sizeof(float);
}

/// sum_i q[i] * code_i over one token's codes of a `Bits`-bit segment of n (padded) channels in the split layout:
/// byte j holds codes j, j + n/2 (4 bits) or j, j + n/4, j + n/2, j + 3n/4 (2 bits), low bits first. Words of 4
/// bytes when the row allows (its byte count a multiple of 4: rows are then 4-byte aligned, the segment 16).
template <int Bits>
__device__ inline float packed_dot(std::uint8_t const* row, Index n, float const* q) {
  constexpr Index per_byte = 8 / Bits;
  Index const bytes = n / per_byte, stride = bytes;  // codes j + k * stride share byte j
  constexpr unsigned mask = (1u << Bits) - 1u;
  float dot = 0.0f;
  auto one_byte = [&](unsigned byte, Index j) {
    for (Index k = 0; k < per_byte; ++k)
      dot += q[j + k * stride] * static_cast<float>((byte >> (Bits * k)) & mask);
  };
  if (bytes % 4 == 0) {
    auto const* words = reinterpret_cast<std::uint32_t const*>(row);
    for (Index w = 0; w < bytes / 4; ++w) {
      std::uint32_t const word = words[w];
      for (Index k = 0; k < 4; ++k)
        one_byte((word >> (8 * k)) & 0xffu, 4 * w + k);
    }
  } else {
    for (Index j = 0; j < bytes; ++j)
      one_byte(row[j], j);
  }
  return dot;
}

/// The code of channel c in a V row of n (padded) channels at `bits` bits (split layout).
__device__ inline unsigned packed_code(std::uint8_t const* row, Index n, int bits, Index c) {
  if (bits == 8)
    return row[c];
  Index const stride = n / (8 / bits), k = c / stride;
  return (static_cast<unsigned>(row[c - k * stride]) >> (bits * k)) & ((1u << bits) - 1u);
}

/// Grid (rows, Hq, batch), packed_threads threads. See the file comment for the passes.
template <class Q>
__global__ void __launch_bounds__(packed_threads)
    packed_attend_kernel(Attention op, Q queries, PackedKVView<DeviceSpace> kv, AttendOutput<DeviceSpace> out,
                         float scale) {
  float* const packed_shared = dynamic_shared<float>();  // qs [cap], then q' [packed_max_groups][cap]
  __shared__ float probs[packed_threads];                // the chunk's weights; at the end the slices' partial sums
  __shared__ float bias[packed_max_groups];
  __shared__ float scratch[warp_size];
  KVExtents const qe = queries.rows.extents();
  Index const dk = kv.dim, dv = kv.value_dim, cap = kv.max_k_channels();
  Index const b = blockIdx.z, hq = blockIdx.y, h = hq / (qe.heads / kv.kv_heads);
  int const tid = static_cast<int>(threadIdx.x), warp = tid / warp_size, lane = tid % warp_size;
  PackedHead const& head = kv.head(b, h);
  ZeroPoint const zp = kv.quant.zero_point;

  // Channel segments [ks[s], ks[s + 1]) and token segments [vs[s], vs[s + 1]) of the packed order.
  Index ks[packed_segments + 1] = {}, vs[packed_segments + 1] = {};
  for (int s = 0; s < packed_segments; ++s) {
    ks[s + 1] = ks[s] + (head.k_count[s] > 0 ? head.k_count[s] : 0);
    vs[s + 1] = vs[s] + (head.v_count[s] > 0 ? head.v_count[s] : 0);
  }
  Index const kp = ks[packed_segments], tokens = vs[packed_segments];
  // A descriptor kvc::pack did not write (more channels than the pads allow, counts that disagree): read nothing.
  bool const sane = kp <= cap && head.tokens == tokens;
  Index const group = kv.quant.k_group > 0 ? kv.quant.k_group : 0, chunk = packed_chunk(group);
  Index const v_groups = kv.v_groups(), v_group = kv.quant.v_group;
  Index const* positions = kv.at<Index>(head.positions);
  std::int32_t const* perm = kv.at<std::int32_t>(head.k_perm);
  float* qs = packed_shared;
  float* qg = packed_shared + cap;

  Index end = 0;  // the context end (queries without positions): 1 + the sequence's largest stored position
  if (!queries.positions)
    for (Index k = 0; k < kv.kv_heads; ++k)
      end = kv.head(b, k).end_position > end ? kv.head(b, k).end_position : end;
  Index const slices = packed_threads / dv, slice = tid / dv, channel = tid % dv;

  for (Index i = blockIdx.x; i < qe.tokens; i += gridDim.x) {
    Index const q_pos = queries.positions ? queries.positions[b * qe.tokens + i] : end - qe.tokens + i;
    auto const* src = queries.rows.row(b, hq, i);
    if (sane)
      for (Index c = tid; c < kp; c += packed_threads) {
        std::int32_t const from = perm[c];
        qs[c] = from >= 0 && from < dk ? scale * to_float(src[from]) : 0.0f;  // pads: -1
      }
    __syncthreads();

    float m = -CUDART_INF_F, l = 0.0f, acc = 0.0f;
    // The groups staged: [staged, staged + staged_n). A chunk whose groups are all among them reuses them (with one
    // group, it stays staged for the whole row). Groups of more than packed_threads tokens: a chunk may start in
    // the staged group and end in the next one, which then has to be staged too.
    Index staged = -1, staged_n = 0;
    for (Index t0 = 0; sane && t0 < tokens; t0 += chunk) {
      Index const tn = tokens - t0 < chunk ? tokens - t0 : chunk;
      Index const g0 = group > 0 ? t0 / group : 0, ng = group > 0 ? (t0 + tn - 1) / group - g0 + 1 : 1;
      // 1. Stage q' and the bias of each group the chunk touches, one warp per group.
      if (staged != g0 || staged_n < ng) {
        if (warp < ng) {
          Index const g = g0 + warp;
          float* dst = qg + warp * cap;
          float part = 0.0f;
          for (Index c = lane; c < kp; c += warp_size) {
            int s = 0;
            while (s < 3 && c >= ks[s + 1])
              ++s;
            if (s == 3) {  // raw FP16 keys: q itself
              dst[c] = qs[c];
              continue;
            }
            Affine const af = affine(kv.at<QuantParams>(head.k_params[s])[g * head.k_count[s] + (c - ks[s])], zp);
            dst[c] = qs[c] * af.a;
            part += qs[c] * af.c;
          }
          part = warp_sum(part);
          if (lane == 0)
            bias[warp] = part;
        }
        staged = g0;
        staged_n = ng;
        __syncthreads();
      }
      // 2. One token per thread: its logit.
      float logit = -CUDART_INF_F;
      if (tid < tn) {
        Index const t = t0 + tid;
        if (!op.causal || positions[t] <= q_pos) {
          Index const gl = group > 0 ? t / group - g0 : 0;
          float const* q1 = qg + gl * cap;
          float dot = bias[gl];
          if (Index const n = ks[1] - ks[0]; n > 0)
            dot += packed_dot<2>(kv.at<std::uint8_t>(head.k_codes[0]) + t * packed_bytes(n, 2), n, q1 + ks[0]);
          if (Index const n = ks[2] - ks[1]; n > 0)
            dot += packed_dot<4>(kv.at<std::uint8_t>(head.k_codes[1]) + t * packed_bytes(n, 4), n, q1 + ks[1]);
          if (Index const n = ks[3] - ks[2]; n > 0)
            dot += packed_dot<8>(kv.at<std::uint8_t>(head.k_codes[2]) + t * n, n, q1 + ks[2]);
          if (Index const n = ks[4] - ks[3]; n > 0) {
            half const* raw = kv.at<half>(head.k_raw) + t * n;
            for (Index c = 0; c < n; ++c)
              dot += q1[ks[3] + c] * to_float(raw[c]);
          }
          logit = dot;
        }
      }
      // 3. Online softmax over the chunk (block_max synchronises, so q' may be restaged after it).
      float const peak = fmaxf(m, block_max(logit, scratch));
      if (peak == -CUDART_INF_F)
        continue;  // nothing visible yet (the same in every thread)
      float const alpha = m == -CUDART_INF_F ? 0.0f : expf(m - peak);
      float const p = logit == -CUDART_INF_F ? 0.0f : expf(logit - peak);
      m = peak;
      l = l * alpha + p;
      acc *= alpha;
      if (tid < tn)
        probs[tid] = p;
      __syncthreads();
      // 4. Values: thread (slice, channel) over the chunk's tokens slice, slice + slices, ...
      if (slice < slices)
        for (Index j = slice; j < tn; j += slices) {
          float const w = probs[j];
          if (w == 0.0f)
            continue;
          Index const t = t0 + j;
          int s = 0;
          while (s < 3 && t >= vs[s + 1])
            ++s;
          Index const r = t - vs[s];
          float x;
          if (s == 3) {
            x = to_float(kv.at<half>(head.v_raw)[r * dv + channel]);
          } else {
            Index const n = kv.v_padded(s);
            std::uint8_t const* row = kv.at<std::uint8_t>(head.v_codes[s]) + r * kv.v_row_bytes(s);
            Affine const af =
                affine(kv.at<QuantParams>(head.v_params[s])[r * v_groups + (v_group > 0 ? channel / v_group : 0)], zp);
            x = static_cast<float>(packed_code(row, n, segment_bits(s), channel)) * af.a + af.c;
          }
          acc += w * x;
        }
      __syncthreads();  // probs and q' are rewritten by the next chunk
    }

    // The denominator, then the slices' partial sums in slice order.
    float const total = block_sum(l, scratch);
    if (slice < slices)
      probs[tid] = acc;
    __syncthreads();
    Index const at = (b * qe.heads + hq) * qe.tokens + i;
    for (Index c = tid; c < dv; c += packed_threads) {
      float sum = 0.0f;
      for (Index s = 0; s < slices; ++s)
        sum += probs[s * dv + c];
      out.out[at * dv + c] = total > 0.0f ? sum / total : 0.0f;
    }
    if (out.lse && tid == 0)
      out.lse[at] = total > 0.0f ? m + logf(total) : -CUDART_INF_F;
    __syncthreads();  // qs and probs are rewritten by the next row
  }
}

}  // namespace kvc::backend::cuda

namespace kvc {

/// Packed attention on CUDA: no workspace. Limits: d_v in [1, 256]; d_k within shared memory
/// ((1 + packed_max_groups) * (d_k + 4) floats); batch and query heads <= 65535. The view's arena and descriptors
/// must be in device memory (kvc::to_device in <kvc/backend/cuda/store/packed.cuh> copies a host PackedKV).
template <>
struct Kernel<PackedAttention, Cuda> {
  template <class Q>
  static std::size_t workspace_bytes(Cuda const&, PackedAttention const&, Q const&, PackedKVView<DeviceSpace> const&) {
    return 0;
  }

  template <Element T>
  static Status run(Cuda const& cuda, PackedAttention const& op, AttendQueries<T, DeviceSpace> const& queries,
                    PackedKVView<DeviceSpace> const& kv, AttendOutput<DeviceSpace> out, Workspace) {
    namespace bc = backend::cuda;
    KVExtents const q = queries.rows.extents();
    if (kv.value_dim > bc::packed_max_value_dim || kv.value_dim < 1 || kv.dim < 1)
      return {Errc::invalid_argument, "kvc::attend_packed(Cuda): d_v must be in [1, 256] and d_k >= 1"};
    if (q.rows() == 0)
      return {};
    KVC_RETURN_IF_ERROR(
        bc::head_grid_status(q.batch, q.heads, "kvc::attend_packed(Cuda): batch and heads must be <= 65535"));
    std::size_t const smem = bc::packed_shared_bytes(kv);
    KVC_RETURN_IF_ERROR(bc::shared_memory_status(smem, "kvc::attend_packed(Cuda): d_k too large for shared memory"));
    KVC_RETURN_IF_ERROR(bc::pending_status());
    Attention const& a = op.attention;
    float const scale = a.scale > 0 ? a.scale : 1.0f / sqrtf(static_cast<float>(kv.dim));
    dim3 const grid(bc::grid_dim(q.tokens, 2147483647), static_cast<unsigned>(q.heads), static_cast<unsigned>(q.batch));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::attend_packed(Cuda)", bc::packed_attend_kernel), grid,
                                   bc::packed_threads, smem, cuda.stream, a, queries, kv, out, scale));
    return {};
  }
};

}  // namespace kvc
