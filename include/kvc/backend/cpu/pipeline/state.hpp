// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/pipeline/state.hpp: CPU kernels of kvc::zero_state, kvc::copy_indices, kvc::decode_budgets and
// kvc::push_queries.
#pragma once

#include <kvc/pipeline/state.hpp>

#include <algorithm>
#include <cstring>

namespace kvc {

template <>
struct Kernel<ZeroStateStep, Cpu> {
  static Status run(Cpu const&, void* data, std::size_t bytes) {
    std::memset(data, 0, bytes);
    return {};
  }
};

template <>
struct Kernel<CopyIndicesStep, Cpu> {
  static Status run(Cpu const&, Index* dst, Index const* src, Index n) {
    std::copy_n(src, n, dst);
    return {};
  }
};

template <>
struct Kernel<DecodeBudgetsStep, Cpu> {
  static Status run(Cpu const&, Index* budgets, Index const* lengths, Index batch, Index heads, Index target) {
    for (Index b = 0; b < batch; ++b)
      detail::decode_budgets_of(budgets + b * heads, lengths + b * heads, heads, target);
    return {};
  }
};

template <>
struct Kernel<PushQueriesStep, Cpu> {
  template <Element T>
  static Status run(Cpu const&, QueryBuffer<T, HostSpace> const& buf,
                    TokenRows<T const, StridedLayout, HostSpace> const& rows, Index const* positions) {
    KVExtents const e = rows.extents();
    for (Index b = 0; b < e.batch; ++b) {
      for (Index q = 0; q < e.heads; ++q)
        for (Index i = 0; i < e.tokens; ++i)
          std::copy_n(rows.row(b, q, i), e.dim, buf.row(b, q, buf.count + i));
      std::copy_n(positions + b * e.tokens, e.tokens, buf.positions + b * buf.capacity + buf.count);
    }
    if (buf.fill)
      *buf.fill = buf.count + e.tokens;
    return {};
  }
};

}  // namespace kvc
