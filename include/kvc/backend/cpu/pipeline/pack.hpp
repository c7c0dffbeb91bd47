// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/pipeline/pack.hpp: CPU kernels of kvc::pack_into (each head in its region, written by the same
// three steps as kvc::pack) and of the packed policies' planning steps (kvc::kivi_bit_plan, kvc::split_tail,
// kvc::scores_to_weights: per-head host-device functions of pipeline/packed_press.hpp, looped over the heads).
#pragma once

#include <kvc/pipeline/pack.hpp>
#include <kvc/pipeline/packed_press.hpp>

namespace kvc {

template <>
struct Kernel<PackStep, Cpu> {
  template <KVCacheView C>
  static std::size_t workspace_bytes(Cpu const&, C const& cache) {
    return detail::pack_scratch_bytes(cache.tokens(), cache.keys.extents().dim, cache.values.extents().dim);
  }

  template <KVCacheView C>
  static Status run(Cpu const&, C const& cache, BitPlan<HostSpace> const& plan, PackOptions const& opt,
                    PackedStore<HostSpace> const& out, Workspace ws, int* error) {
    KVExtents const e = cache.keys.extents();
    Index const dv = cache.values.extents().dim;
    PackedQuant const quant{opt.zero_point, opt.v_group, opt.k_group};
    detail::PackScratch s = detail::carve_pack_scratch(ws, cache.tokens(), e.dim, dv);
    std::uint64_t const region = out.region_bytes();
    for (Index i = 0; i < e.batch * e.heads; ++i)
      out.heads[i] = PackedHead{};
    for (Index b = 0; b < e.batch; ++b)
      for (Index h = 0; h < e.heads; ++h) {
        PackedHead d;
        Status st = detail::order_packed_head(cache, b, h, plan, opt, d, s);
        if (st.ok() && d.tokens > out.tokens)
          st = {Errc::out_of_capacity, "kvc::pack_into: a head keeps more tokens than the store's `tokens`"};
        if (st.ok()) {
          layout_packed_head(d, s.k_kept, static_cast<std::uint64_t>(b * e.heads + h) * region, dv, quant);
          st = detail::fill_packed_head(cache, b, h, opt, d, out.arena, s);
        }
        if (!st.ok()) {
          for (Index i = 0; i < e.batch * e.heads; ++i)
            out.heads[i] = PackedHead{};
          if (error != nullptr)
            *error = 1;
          return st;
        }
        out.heads[b * e.heads + h] = d;
      }
    return {};
  }
};

template <>
struct Kernel<PackedPlanStep, Cpu> {
  static Status kivi(Cpu const&, KIVIPress const& press, Lengths lengths, BitPlan<HostSpace> const& plan) {
    for (Index b = 0; b < plan.batch; ++b)
      for (Index h = 0; h < plan.heads; ++h)
        kivi_plan(press, lengths.at(b, h, plan.tokens), plan.tokens, plan.dim, plan.v_row(b, h), plan.k_row(b, h));
    return {};
  }
  static Status split_tail(Cpu const&, Index residual, Lengths lengths, BitPlan<HostSpace> const& plan,
                           KeepPlan<HostSpace> const& tail) {
    for (Index b = 0; b < plan.batch; ++b)
      for (Index h = 0; h < plan.heads; ++h)
        tail.count[b * plan.heads + h] = split_tail_head(lengths.at(b, h, plan.tokens), residual, plan.v_row(b, h),
                                                         tail.index + (b * plan.heads + h) * tail.capacity);
    return {};
  }
  static Status weights(Cpu const&, ScoreSpan<HostSpace> const& span) {
    for (Index b = 0; b < span.batch; ++b)
      for (Index h = 0; h < span.heads; ++h)
        scores_as_weights(span.row(b, h), span.length(b, h));
    return {};
  }
};

}  // namespace kvc
