// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/pipeline/pack.cuh: CUDA kernels of kvc::pack_into and of the packed policies' planning steps
// (kvc::kivi_bit_plan, kvc::split_tail, kvc::scores_to_weights). Enqueued on the backend's stream; nothing is read
// on the host, so a prefill that packs can be captured into a graph.
//
// pack_into is two launches of one block per (sequence, KV head):
//   1. order: the head's packed order (thread 0: kept slots by V segment, stable; K channels by segment, padded;
//      the counts and layout_packed_head at the head's region, staged in the workspace; a bit width outside
//      {0, 2, 4, 8, 16} or more kept tokens than the store's `tokens` marks the head bad), its positions written to the
//      arena, and every value the head will store checked against FP16's range by all threads (a NaN, an Inf or an
//      overflow marks it bad);
//   2. fill: if any head of the layer is bad, every descriptor is written empty and *error = 1 (all or nothing, as
//      the CPU); else K params per (token group, packed channel), then each token's K code rows and each V row.
// The per-value math is the CPU packer's functions (range_params, minmax_params, quantize_widened — the element op
// of quantize_row —, pack_codes, layout_packed_head), so both backends write the same bytes; the loops differ
// (the CPU gathers a head's rows once for cache locality, the device gives a thread a channel or a token).
// The ordering runs on one thread per head: O(tokens) and small next to the fill; a block-wide scan is the next
// step if it shows in a profile.
#pragma once

#include <kvc/backend/cuda/config.cuh>
#include <kvc/pipeline/pack.hpp>
#include <kvc/pipeline/packed_press.hpp>

namespace kvc::backend::cuda {

inline constexpr int pack_threads = 256;
/// The most packed channels of a K code row or padded channels of a V code row a thread quantises in registers.
inline constexpr Index pack_max_row = 1024;

/// The workspace of pack_into: kept slots [BH, tokens], permutations [BH, d_k + 4], staged descriptors [BH] and the
/// bad flags [BH].
struct PackWorkspace {
  Index* slots = nullptr;
  std::int32_t* perm = nullptr;
  PackedHead* staged = nullptr;
  int* bad = nullptr;
};
inline std::size_t pack_workspace_size(Index heads, Index tokens, Index dim) noexcept {
  return bytes_sum(workspace_round(bytes_product(heads, tokens, sizeof(Index))),
                   workspace_round(bytes_product(heads, dim + 4, sizeof(std::int32_t))),
                   workspace_round(bytes_product(heads, sizeof(PackedHead))),
                   workspace_round(bytes_product(heads, sizeof(int))));
}
inline PackWorkspace carve_pack_workspace(Workspace ws, Index heads, Index tokens, Index dim) {
  WorkspaceCarver carve(ws);
  PackWorkspace w;
  w.slots = carve.take<Index>(heads * tokens);
  w.perm = carve.take<std::int32_t>(heads * (dim + 4));
  w.staged = carve.take<PackedHead>(heads);
  w.bad = carve.take<int>(heads);
  return w;
}

template <class C>
__global__ void pack_order_kernel(C cache, BitPlan<DeviceSpace> plan, PackOptions opt, PackedStore<DeviceSpace> out,
                                  PackWorkspace ws) {
  Index const bh = blockIdx.x, b = bh / plan.heads, h = bh % plan.heads, tokens = plan.tokens, dk = plan.dim;
  Index const dv = out.value_dim;
  Index* slots = ws.slots + bh * tokens;
  std::int32_t* perm = ws.perm + bh * (dk + 4);
  PackedHead& d = ws.staged[bh];
  __shared__ int bad;
  if (threadIdx.x == 0) {
    bad = 0;
    d = PackedHead{};
    Index const n = clamp_length(cache.length(b, h), cache.capacity(b, h) < tokens ? cache.capacity(b, h) : tokens);
    std::int8_t const* vb = plan.v_row(b, h);
    std::int8_t const* kb = plan.k_row(b, h);
    for (Index t = 0; t < n; ++t)
      bad |= valid_bits(vb[t]) ? 0 : 1;
    for (Index c = 0; c < dk; ++c)
      bad |= valid_bits(kb[c]) ? 0 : 1;
    Index tn = 0, channels = 0;
    Index k_kept[packed_segments] = {};
    for (int seg = 0; seg < packed_segments; ++seg)
      for (Index t = 0; t < n; ++t)
        if (bits_segment(vb[t]) == seg) {
          slots[tn++] = t;
          ++d.v_count[seg];
        }
    for (int seg = 0; seg < packed_segments && tn > 0; ++seg) {
      for (Index c = 0; c < dk; ++c) {
        int const bits = kb[c] == 16 && opt.clamp_k16_to_8 ? 8 : kb[c];
        if (bits_segment(bits) == seg) {
          perm[channels++] = static_cast<std::int32_t>(c);
          ++k_kept[seg];
        }
      }
      d.k_count[seg] = padded_count(k_kept[seg], segment_bits(seg));
      for (Index p = k_kept[seg]; p < d.k_count[seg]; ++p)
        perm[channels++] = -1;
    }
    d.tokens = tn;
    d.k_groups = tn == 0 ? 0 : (opt.k_group > 0 ? (tn + opt.k_group - 1) / opt.k_group : 1);
    if (tn > out.tokens) {  // more than the region holds: nothing of this head may be written
      bad = 1;
      d = PackedHead{};
      tn = 0;
    }
    layout_packed_head(d, k_kept, static_cast<std::uint64_t>(bh) * out.region_bytes(), dv, out.quant);
    Index end = 0;
    auto* pos = reinterpret_cast<Index*>(out.arena + d.positions);
    for (Index t = 0; t < tn; ++t) {
      pos[t] = cache.position(b, h, slots[t]);
      end = pos[t] + 1 > end ? pos[t] + 1 : end;
    }
    d.end_position = end;
  }
  __syncthreads();
  // Every value this head stores must fit FP16: K at its kept channels, V whole.
  Index const tn = d.tokens, channels = d.k_channels();
  int mine = 0;
  auto const ks = cache.keys.scale(b, h);
  auto const vs = cache.values.scale(b, h);
  for (Index w = threadIdx.x; w < tn * (channels + dv); w += blockDim.x) {
    Index const t = w / (channels + dv), i = w % (channels + dv);
    float x = 0.0f;
    if (i < channels) {
      if (perm[i] >= 0)
        x = load(cache.keys.row(b, h, slots[t])[perm[i]], ks);
    } else {
      x = load(cache.values.row(b, h, slots[t])[i - channels], vs);
    }
    mine |= detail::fits_half(x) ? 0 : 1;
  }
  if (mine)
    atomicOr(&bad, 1);
  __syncthreads();
  if (threadIdx.x == 0)
    ws.bad[bh] = bad;
}

template <class C>
__global__ void pack_fill_kernel(C cache, PackOptions opt, PackedStore<DeviceSpace> out, PackWorkspace ws, Index heads,
                                 Index slots, int* error) {
  Index const bh = blockIdx.x, b = bh / out.kv_heads, h = bh % out.kv_heads, dk = out.dim, dv = out.value_dim;
  __shared__ int any_bad;
  if (threadIdx.x == 0) {
    any_bad = 0;
    for (Index i = 0; i < heads; ++i)
      any_bad |= ws.bad[i];
  }
  __syncthreads();
  if (any_bad) {
    if (threadIdx.x == 0) {
      out.heads[bh] = PackedHead{};
      if (error != nullptr)
        atomicExch(error, 1);
    }
    return;
  }
  PackedHead const d = ws.staged[bh];
  Index const tn = d.tokens, channels = d.k_channels();
  Index const* kept = ws.slots + bh * slots;  // the order kernel's rows: one per cache slot
  std::int32_t const* perm = ws.perm + bh * (dk + 4);
  std::byte* base = out.arena;
  auto const ks = cache.keys.scale(b, h);
  auto const vs = cache.values.scale(b, h);
  auto const key = [&](Index t, Index i) {  // packed token t, packed channel i (a pad reads 0)
    return perm[i] < 0 ? 0.0f : load(cache.keys.row(b, h, kept[t])[perm[i]], ks);
  };
  for (Index i = threadIdx.x; i < channels && tn > 0; i += blockDim.x)
    reinterpret_cast<std::int32_t*>(base + d.k_perm)[i] = perm[i];

  // K params: one thread per (token group, packed channel of the segment); pads get zero params.
  Index const kg = opt.k_group > 0 ? opt.k_group : tn;
  for (int seg = 0; seg < 3; ++seg) {
    Index const cnt = d.k_count[seg], c0 = d.k_begin(seg);
    auto* params = reinterpret_cast<QuantParams*>(base + d.k_params[seg]);
    for (Index w = threadIdx.x; w < d.k_groups * cnt; w += blockDim.x) {
      Index const g = w / cnt, i = w % cnt, t0 = g * kg, t1 = tn - t0 < kg ? tn : t0 + kg;
      if (perm[c0 + i] < 0) {
        params[w] = QuantParams{};
        continue;
      }
      float lo = key(t0, c0 + i), hi = lo;
      for (Index t = t0 + 1; t < t1; ++t) {
        float const x = key(t, c0 + i);
        lo = x < lo ? x : lo;
        hi = x > hi ? x : hi;
      }
      params[w] = range_params(lo, hi, segment_bits(seg), opt.zero_point);
    }
  }
  __syncthreads();  // the params are read back by every token's row below

  // K rows and V rows: one thread per packed token.
  std::uint8_t codes[pack_max_row];
  Index const v_groups = detail::packed_v_groups(dv, out.quant), vg = opt.v_group > 0 ? opt.v_group : dv;
  for (Index t = threadIdx.x; t < tn; t += blockDim.x) {
    for (int seg = 0; seg < packed_segments; ++seg) {
      Index const cnt = d.k_count[seg], c0 = d.k_begin(seg);
      if (cnt == 0)
        continue;
      if (seg == 3) {
        auto* raw = reinterpret_cast<half*>(base + d.k_raw) + t * cnt;
        for (Index i = 0; i < cnt; ++i)
          raw[i] = half(key(t, c0 + i));
        continue;
      }
      int const bits = segment_bits(seg);
      float const qmax = detail::quant_max_code(bits);
      QuantParams const* params = reinterpret_cast<QuantParams const*>(base + d.k_params[seg]) + (t / kg) * cnt;
      for (Index i = 0; i < cnt; ++i)
        codes[i] = detail::quantize_widened(key(t, c0 + i), static_cast<float>(params[i].scale),
                                            static_cast<float>(params[i].offset), qmax, opt.zero_point);
      Index const rb = packed_bytes(cnt, bits);
      pack_codes(codes, cnt, bits, reinterpret_cast<std::uint8_t*>(base + d.k_codes[seg]) + t * rb);
    }
    int seg = 0;  // V: the token's segment in packed order
    while (seg < 3 && t >= d.v_begin(seg + 1))
      ++seg;
    Index const j = t - d.v_begin(seg);
    auto const* src = cache.values.row(b, h, kept[t]);
    if (seg == 3) {
      auto* raw = reinterpret_cast<half*>(base + d.v_raw) + j * dv;
      for (Index c = 0; c < dv; ++c)
        raw[c] = half(load(src[c], vs));
      continue;
    }
    int const bits = segment_bits(seg);
    float const qmax = detail::quant_max_code(bits);
    Index const padded = padded_count(dv, bits);
    auto* params = reinterpret_cast<QuantParams*>(base + d.v_params[seg]) + j * v_groups;
    for (Index g = 0; g < v_groups; ++g) {
      Index const c0 = g * vg, gn = dv - c0 < vg ? dv - c0 : vg;
      params[g] = minmax_params(src + c0, gn, 1, bits, opt.zero_point, vs);
      float const s = static_cast<float>(params[g].scale), o = static_cast<float>(params[g].offset);
      for (Index c = c0; c < c0 + gn; ++c)
        codes[c] = detail::quantize_widened(load(src[c], vs), s, o, qmax, opt.zero_point);
    }
    for (Index c = dv; c < padded; ++c)
      codes[c] = 0;
    pack_codes(codes, padded, bits,
               reinterpret_cast<std::uint8_t*>(base + d.v_codes[seg]) + j * detail::packed_v_row_bytes(dv, seg));
  }
  if (threadIdx.x == 0)
    out.heads[bh] = d;
}

/// The planning steps: one thread per head, each running the per-head function of pipeline/packed_press.hpp.
template <class F>  // templates: kernels defined in a header must not be one symbol per translation unit
__global__ void kivi_plan_kernel(KIVIPress press, Lengths lengths, BitPlan<DeviceSpace> plan) {
  Index const stride = static_cast<Index>(gridDim.x) * blockDim.x;
  for (Index x = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; x < plan.batch * plan.heads; x += stride) {
    Index const b = x / plan.heads, h = x % plan.heads;
    kivi_plan(press, clamp_length(lengths.at(b, h, plan.tokens), plan.tokens), plan.tokens, plan.dim, plan.v_row(b, h),
              plan.k_row(b, h));
  }
}
template <class F>
__global__ void split_tail_kernel(Index residual, Lengths lengths, BitPlan<DeviceSpace> plan,
                                  KeepPlan<DeviceSpace> tail) {
  Index const stride = static_cast<Index>(gridDim.x) * blockDim.x;
  for (Index x = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; x < plan.batch * plan.heads; x += stride) {
    Index const b = x / plan.heads, h = x % plan.heads;
    tail.count[x] = split_tail_head(clamp_length(lengths.at(b, h, plan.tokens), plan.tokens), residual,
                                    plan.v_row(b, h), tail.index + x * tail.capacity);
  }
}
template <class F>
__global__ void weights_kernel(ScoreSpan<DeviceSpace> span) {
  Index const stride = static_cast<Index>(gridDim.x) * blockDim.x;
  for (Index x = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; x < span.batch * span.heads; x += stride) {
    Index const b = x / span.heads, h = x % span.heads;
    scores_as_weights(span.row(b, h), clamp_length(span.length(b, h), span.tokens));
  }
}

}  // namespace kvc::backend::cuda

namespace kvc {

template <>
struct Kernel<PackStep, Cuda> {
  template <KVCacheView C>
  static std::size_t workspace_bytes(Cuda const&, C const& cache) {
    KVExtents const e = cache.keys.extents();
    return backend::cuda::pack_workspace_size(e.batch * e.heads, cache.tokens(), e.dim);
  }

  template <KVCacheView C>
  static Status run(Cuda const& cuda, C const& cache, BitPlan<DeviceSpace> const& plan, PackOptions const& opt,
                    PackedStore<DeviceSpace> const& out, Workspace ws, int* error) {
    namespace bc = backend::cuda;
    KVExtents const e = cache.keys.extents();
    Index const heads = e.batch * e.heads;
    if (e.dim + 4 > bc::pack_max_row || cache.values.extents().dim + 4 > bc::pack_max_row)
      return {Errc::invalid_argument, "kvc::pack_into(Cuda): d_k and d_v must be at most 1020"};
    if (heads == 0)
      return {};
    KVC_RETURN_IF_ERROR(bc::pending_status());
    bc::PackWorkspace const w = bc::carve_pack_workspace(ws, heads, cache.tokens(), e.dim);
    dim3 const grid(static_cast<unsigned>(heads));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::pack_into(Cuda)", bc::pack_order_kernel<C>), grid,
                                   bc::pack_threads, 0, cuda.stream, cache, plan, opt, out, w));
    return bc::launch(KVC_CUDA_KERNEL("kvc::pack_into(Cuda)", bc::pack_fill_kernel<C>), grid, bc::pack_threads, 0,
                      cuda.stream, cache, opt, out, w, heads, cache.tokens(), error);
  }
};

template <>
struct Kernel<PackedPlanStep, Cuda> {
  static dim3 grid_of(Index heads) { return dim3(backend::cuda::grid_dim((heads + 127) / 128, 1024)); }
  static Status kivi(Cuda const& cuda, KIVIPress const& press, Lengths lengths, BitPlan<DeviceSpace> const& plan) {
    KVC_RETURN_IF_ERROR(backend::cuda::pending_status());
    return backend::cuda::launch(KVC_CUDA_KERNEL("kvc::kivi_bit_plan(Cuda)", backend::cuda::kivi_plan_kernel<float>),
                                 grid_of(plan.batch * plan.heads), 128, 0, cuda.stream, press, lengths, plan);
  }
  static Status split_tail(Cuda const& cuda, Index residual, Lengths lengths, BitPlan<DeviceSpace> const& plan,
                           KeepPlan<DeviceSpace> const& tail) {
    KVC_RETURN_IF_ERROR(backend::cuda::pending_status());
    return backend::cuda::launch(KVC_CUDA_KERNEL("kvc::split_tail(Cuda)", backend::cuda::split_tail_kernel<float>),
                                 grid_of(plan.batch * plan.heads), 128, 0, cuda.stream, residual, lengths, plan, tail);
  }
  static Status weights(Cuda const& cuda, ScoreSpan<DeviceSpace> const& span) {
    KVC_RETURN_IF_ERROR(backend::cuda::pending_status());
    return backend::cuda::launch(KVC_CUDA_KERNEL("kvc::scores_to_weights(Cuda)", backend::cuda::weights_kernel<float>),
                                 grid_of(span.batch * span.heads), 128, 0, cuda.stream, span);
  }
};

}  // namespace kvc
