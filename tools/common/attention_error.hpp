// SPDX-License-Identifier: Apache-2.0
// tools/common/attention_error.hpp: how far attention over a compressed cache is from attention over the full one,
// for tests, tools and the demo (it allocates, so it is not part of the engine library).
#pragma once

#include <kvc/attention/attend.hpp>
#include <kvc/backend/cpu/attention/attend.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

namespace kvc::tools {

/// Relative L2 error ||O_compressed - O_full|| / ||O_full|| of attention outputs over all queries and heads, between
/// `full` and `compressed` (host caches; the compressed one carries its positions, so the causal mask is the same).
/// A measurement helper for tests, tools and the demo: it allocates its buffers (hence here, not in the library).
template <Element T, KVCacheView Full, KVCacheView Compressed>
Status attention_error(AttendQueries<T, HostSpace> const& queries, Full const& full, Compressed const& compressed,
                       double& relative_error, Attention op = {}) {
  KVExtents const q = queries.rows.extents();
  Index const dv = full.values.extents().dim;
  auto const outputs = static_cast<std::size_t>(q.batch * q.heads * q.tokens * dv);
  std::vector<float> a(outputs), b(outputs);
  std::vector<Index> positions;  // both caches answer the same queries, at the full context's last positions
  AttendQueries<T, HostSpace> fixed = queries;
  if (!queries.positions) {
    for (Index s = 0; s < q.batch; ++s)
      for (Index i = 0; i < q.tokens; ++i)
        positions.push_back(context_end(full, s) - q.tokens + i);
    fixed.positions = positions.data();
  }
  std::vector<std::byte> ws(std::max(attend_workspace_bytes(Cpu{}, op, queries, full),
                                     attend_workspace_bytes(Cpu{}, op, queries, compressed)));
  KVC_RETURN_IF_ERROR(attend(Cpu{}, op, fixed, full, AttendOutput<>{a.data()}, {ws.data(), ws.size()}));
  KVC_RETURN_IF_ERROR(attend(Cpu{}, op, fixed, compressed, AttendOutput<>{b.data()}, {ws.data(), ws.size()}));
  double num = 0, den = 0;
  for (std::size_t i = 0; i < outputs; ++i) {
    num += (double{b[i]} - a[i]) * (double{b[i]} - a[i]);
    den += double{a[i]} * a[i];
  }
  relative_error = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return {};
}

}  // namespace kvc::tools
