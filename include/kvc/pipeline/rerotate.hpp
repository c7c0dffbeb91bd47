// SPDX-License-Identifier: Apache-2.0
// kvc/pipeline/rerotate.hpp: move compacted keys onto contiguous cache positions 0..count-1.
//
// After compaction, slot j of head (b, h) holds the key that RoPE rotated at its original position
// plan.index[j]. StreamingLLM's paper (positions "within the cache") and kvpress's KeyRerotationPress rotate each
// kept key by (j - index[j]) so decoding can continue at position count. Values are untouched.
#pragma once

#include <kvc/core/element.hpp>
#include <kvc/core/keep_plan.hpp>
#include <kvc/core/kv_view.hpp>
#include <kvc/core/rope.hpp>
#include <kvc/core/workspace.hpp>

#include <cstddef>
#include <type_traits>

namespace kvc {

/// Workspace of rerotate_keys (any alignment): one fp32 row.
inline std::size_t rerotate_workspace_bytes(Index dim) noexcept {
  return workspace_round(static_cast<std::size_t>(dim) * sizeof(float)) + workspace_slack;
}

/// Re-rotates compacted keys (host memory) from their original positions to their slots. Workspace: one fp32
/// row (`dim` floats) used to widen 16-bit keys. The plan is not modified: it still records original positions.
template <TokenRowsView K>
Status rerotate_keys(RopeSpec const& spec, KeepPlan<HostSpace> const& plan, K const& keys, Workspace ws) {
  static_assert(std::is_same_v<typename K::memory_space, HostSpace>, "kvc::rerotate_keys: keys must be in host memory");
  static_assert(!std::is_const_v<typename K::element_type>, "kvc::rerotate_keys: keys must be writable");
  using T = typename K::value_type;
  KVExtents const e = keys.extents();
  KVC_RETURN_IF_ERROR(spec.check(e.dim));
  float* row = WorkspaceCarver(ws).take<float>(e.dim);
  if (row == nullptr)
    return {Errc::out_of_capacity, "kvc::rerotate_keys: workspace needs `dim` floats"};
  for (Index b = 0; b < plan.batch; ++b)
    for (Index h = 0; h < plan.heads; ++h)
      for (Index j = 0; j < plan.kept(b, h); ++j) {
        Index const from = plan.indices(b, h)[j];
        if (from == j)
          continue;
        T* k = keys.row(b, h, j);
        for (Index i = 0; i < e.dim; ++i)
          row[i] = to_float(k[i]);
        rope_rotate(spec, row, e.dim, static_cast<double>(j - from));
        for (Index i = 0; i < e.dim; ++i)
          k[i] = from_float<T>(row[i]);
      }
  return {};
}

}  // namespace kvc
