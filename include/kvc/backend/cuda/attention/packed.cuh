// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/attention/packed.cuh: CUDA attention over the packed mixed-precision store (RDKV's TriZone zones
// A + B, kvc/store/packed.hpp), reading the codes directly and dequantising in registers: nothing is unpacked to
// memory, so a step reads the packed bytes once (plus the parameters, shared by a warp's lanes).
//
// Not a kernel of its own: PackedSources is a source of attend_kernel (backend/cuda/detail/attend.cuh), the kernel
// of kvc::attend, so the online softmax, the causal mask by stored position, non-finite logits, GQA and the output
// are the plain attention's. The source supplies, per (sequence, KV head):
//   - the query permuted by k_perm (pads and pruned channels 0) and scaled by the logit scale;
//   - a token's logit: sum over the 2/4/8-bit K segments of q_i * x̂_i, x̂ = code * a + c with the (token group,
//     channel) parameters (the affine form of kvc::dequantize, bit for bit), plus q · k over the raw FP16 channels;
//   - a token's value row: the code of channel c times its (token, channel group) parameters, or the FP16 value.
// Same definition as the CPU kernel (backend/cpu/attention/packed.hpp): attention over the dequantised K̂, V̂ of the
// kept tokens. Not bit-identical: the CPU folds the parameters into the query (q'·code + bias), sums in 16 lanes and
// in tiles of 64 tokens; here each lane sums its token's products in channel order, chunks are 32 tokens, and nvcc
// contracts multiply-adds into FMAs. The parity tests compare within 1e-5 relative (plus 1e-5 absolute for outputs
// near 0): logits of order 10 in fp32 carry ~1e-6 relative rounding, which reaches the outputs as ~1e-6 relative.
// Cost note: dequantising each K element (two multiply-adds and a parameter read per element, instead of one FMA on
// a query pre-scaled per token group) is the price of one kernel; issue 27's packed-attention work is the place to
// stage q' per group if the GPU benchmark shows the arithmetic, not the bytes, bounding it.
#pragma once

#include <kvc/attention/attend.hpp>
#include <kvc/attention/packed.hpp>
#include <kvc/backend/cuda/config.cuh>
#include <kvc/backend/cuda/detail/attend.cuh>
#include <kvc/quant/bitpack.hpp>
#include <kvc/quant/minmax.hpp>
#include <kvc/store/packed.hpp>

#include <cstddef>
#include <cstdint>

namespace kvc::backend::cuda {

/// sum_i q[i] * x̂_i over one token's codes of a `Bits`-bit K segment of n (padded) channels in the split layout
/// (byte j holds codes j, j + n/2 (4 bits) or j, j + n/4, j + n/2, j + 3n/4 (2 bits), low bits first), x̂_i = code_i
/// a_i + c_i with channel i's parameters `params[i]` of the token's group. Words of 4 bytes when the row allows (its
/// byte count a multiple of 4: rows are then 4-byte aligned, the segment 16).
template <int Bits>
__device__ inline float packed_dot(std::uint8_t const* row, Index n, float const* q, QuantParams const* params,
                                   ZeroPoint zp) {
  constexpr Index per_byte = 8 / Bits;
  Index const bytes = n / per_byte, stride = bytes;  // codes j + k * stride share byte j
  constexpr unsigned mask = (1u << Bits) - 1u;
  float dot = 0.0f;
  auto one_byte = [&](unsigned byte, Index j) {
    for (Index k = 0; k < per_byte; ++k) {
      Index const i = j + k * stride;
      Affine const af = affine(params[i], zp);
      dot += q[i] * (static_cast<float>((byte >> (Bits * k)) & mask) * af.a + af.c);
    }
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

/// The sources of attend_kernel for a packed layer in device memory (arena and descriptors).
struct PackedSources {
  PackedKVView<DeviceSpace> kv;

  /// One (sequence, KV head): its packed channel segments [ks[s], ks[s + 1]) and token segments [vs[s], vs[s + 1]).
  /// A descriptor kvc::pack did not write (more channels than the pads allow, counts that disagree) has no tokens
  /// and no channels: nothing is read through it.
  struct Head {
    PackedKVView<DeviceSpace> const* kv;
    PackedHead const* head;
    Index ks[packed_segments + 1];
    Index vs[packed_segments + 1];
    Index n;

    /// Token j's value row: codes of V segment s (bits < 16) with the token's parameters, or raw FP16.
    struct Row {
      std::uint8_t const* codes;
      half const* raw;
      QuantParams const* params;
      Index padded, v_group;
      int bits;
      ZeroPoint zp;
      __device__ float operator()(Index c) const {
        if (raw)
          return to_float(raw[c]);
        Affine const af = affine(params[v_group > 0 ? c / v_group : 0], zp);
        return static_cast<float>(packed_code(codes, padded, bits, c)) * af.a + af.c;
      }
    };

    __device__ Index tokens() const { return n; }
    __device__ Index position(Index j) const { return kv->at<Index>(head->positions)[j]; }
    template <class T>
    __device__ void prepare(float* q, T const* row, float scale, int lane) const {
      std::int32_t const* perm = kv->at<std::int32_t>(head->k_perm);
      for (Index c = lane; c < ks[packed_segments]; c += warp_size) {
        std::int32_t const from = perm[c];
        q[c] = from >= 0 && from < kv->dim ? scale * to_float(row[from]) : 0.0f;  // pads: -1
      }
    }
    __device__ float logit(Index j, float const* q) const {
      ZeroPoint const zp = kv->quant.zero_point;
      Index const g = kv->quant.k_group > 0 ? j / kv->quant.k_group : 0;
      float dot = 0.0f;
      auto params = [&](int s, Index count) { return kv->at<QuantParams>(head->k_params[s]) + g * count; };
      if (Index const c = ks[1] - ks[0]; c > 0)
        dot += packed_dot<2>(kv->at<std::uint8_t>(head->k_codes[0]) + j * packed_bytes(c, 2), c, q + ks[0],
                             params(0, c), zp);
      if (Index const c = ks[2] - ks[1]; c > 0)
        dot += packed_dot<4>(kv->at<std::uint8_t>(head->k_codes[1]) + j * packed_bytes(c, 4), c, q + ks[1],
                             params(1, c), zp);
      if (Index const c = ks[3] - ks[2]; c > 0)
        dot += packed_dot<8>(kv->at<std::uint8_t>(head->k_codes[2]) + j * c, c, q + ks[2], params(2, c), zp);
      if (Index const c = ks[4] - ks[3]; c > 0) {
        half const* raw = kv->at<half>(head->k_raw) + j * c;
        for (Index i = 0; i < c; ++i)
          dot += q[ks[3] + i] * to_float(raw[i]);
      }
      return dot;
    }
    __device__ Row value_row(Index j) const {
      int s = 0;
      while (s < 3 && j >= vs[s + 1])
        ++s;
      Index const r = j - vs[s];
      if (s == 3)
        return {nullptr, kv->at<half>(head->v_raw) + r * kv->value_dim, nullptr, 0, 0, 16, kv->quant.zero_point};
      return {kv->at<std::uint8_t>(head->v_codes[s]) + r * kv->v_row_bytes(s),
              nullptr,
              kv->at<QuantParams>(head->v_params[s]) + r * kv->v_groups(),
              kv->v_padded(s),
              kv->quant.v_group,
              segment_bits(s),
              kv->quant.zero_point};
    }
  };

  __host__ __device__ Index kv_heads() const { return kv.kv_heads; }
  __host__ __device__ Index value_dim() const { return kv.value_dim; }
  __host__ __device__ Index query_floats() const { return kv.max_k_channels(); }
  __device__ Index context_end(Index b) const { return kv.context_end(b); }
  __device__ Head source(Index b, Index h) const {
    Head d{&kv, &kv.head(b, h), {}, {}, 0};
    for (int s = 0; s < packed_segments; ++s) {
      d.ks[s + 1] = d.ks[s] + (d.head->k_count[s] > 0 ? d.head->k_count[s] : 0);
      d.vs[s + 1] = d.vs[s] + (d.head->v_count[s] > 0 ? d.head->v_count[s] : 0);
    }
    if (d.ks[packed_segments] <= kv.max_k_channels() && d.head->tokens == d.vs[packed_segments]) {
      d.n = d.vs[packed_segments];
    } else {
      for (int s = 0; s <= packed_segments; ++s)
        d.ks[s] = d.vs[s] = 0;
    }
    return d;
  }
};

}  // namespace kvc::backend::cuda

namespace kvc {

/// Packed attention on CUDA (attend_kernel over PackedSources): no workspace. Limits: d_v in [1, 256]; d_k within
/// shared memory (attend_warps * (d_k + 4) floats); batch and query heads <= 65535. The view's arena and descriptors
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
    using Q = AttendQueries<T, DeviceSpace>;
    if (kv.dim < 1)
      return {Errc::invalid_argument, "kvc::attend_packed(Cuda): d_v must be in [1, 256] and d_k >= 1"};
    Attention const& a = op.attention;
    float const scale = a.scale > 0 ? a.scale : 1.0f / sqrtf(static_cast<float>(kv.dim));
    return bc::launch_attend(cuda, a, queries, bc::PackedSources{kv}, out, scale,
                             {"kvc::attend_packed(Cuda): d_v must be in [1, 256] and d_k >= 1",
                              "kvc::attend_packed(Cuda): batch and heads must be <= 65535",
                              "kvc::attend_packed(Cuda): d_k too large for shared memory"},
                             KVC_CUDA_KERNEL("kvc::attend_packed(Cuda)", (bc::attend_kernel<Q, bc::PackedSources>)));
  }
};

}  // namespace kvc
