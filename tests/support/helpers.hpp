// SPDX-License-Identifier: Apache-2.0
// tests/support/helpers.hpp: small helpers shared by the tests (owned buffers for scores, plans, workspaces).
#pragma once

#include <kvc/core/keep_plan.hpp>
#include <kvc/core/kv_view.hpp>
#include <kvc/core/layout.hpp>
#include <kvc/core/rope.hpp>
#include <kvc/core/scores.hpp>
#include <kvc/core/workspace.hpp>

#include <algorithm>
#include <cstddef>
#include <stdexcept>
#include <vector>

namespace kvc::test {

/// Owned workspace of exactly `n` bytes at whatever alignment the allocator gives: the public workspace queries
/// must already include the slack for that (a test of the queries, not only of the kernels).
struct OwnedWorkspace {
  std::vector<std::byte> bytes;
  explicit OwnedWorkspace(std::size_t n) : bytes(n) {}
  Workspace get() { return {bytes.data(), bytes.size()}; }
};

/// Owned [batch, heads, tokens] scores.
struct OwnedScores {
  std::vector<float> data;
  ScoreSpan<> span;
  OwnedScores(Index b, Index h, Index n)
      : data(static_cast<std::size_t>(b * h * n)), span{data.data(), b, h, n, nullptr} {}
};

/// Owned plan of capacity `capacity`.
struct OwnedPlan {
  std::vector<Index> index, count;
  KeepPlan<> plan;
  OwnedPlan(Index b, Index h, Index capacity)
      : index(static_cast<std::size_t>(b * h * capacity), -7),
        count(static_cast<std::size_t>(b * h), -7),
        plan{index.data(), count.data(), b, h, capacity} {}
  /// Kept indices of head (b, h) as a vector.
  std::vector<Index> kept(Index b, Index h) const {
    Index const* p = plan.indices(b, h);
    return {p, p + plan.kept(b, h)};
  }
};

/// Owned host RoPE table for positions [0, positions).
struct OwnedRope {
  std::vector<float> storage;
  RopeTable<> table;
  OwnedRope(RopeSpec const& spec, Index dim, Index positions)
      : storage(static_cast<std::size_t>(rope_table_floats(positions, spec.rotated(dim)))) {
    if (!fill_rope_table(spec, dim, positions, storage.data(), table).ok())
      throw std::invalid_argument("OwnedRope: bad RopeSpec");
  }
};

/// A plan of capacity `capacity` whose head (b, h) keeps `keep[b * heads + h]` (given, not selected).
inline OwnedPlan plan_of(Index batch, Index heads, Index capacity, std::vector<std::vector<Index>> const& keep) {
  OwnedPlan p(batch, heads, capacity);
  for (Index bh = 0; bh < batch * heads; ++bh) {
    auto const& k = keep[static_cast<std::size_t>(bh)];
    p.count[static_cast<std::size_t>(bh)] = static_cast<Index>(k.size());
    std::copy(k.begin(), k.end(), p.index.begin() + bh * capacity);
  }
  return p;
}

/// Owned window queries [batch, heads, rows, dim] (contiguous BHTD) of element type T, with a read-only view for
/// kvc::WindowQueries.
template <class T = float>
struct OwnedQueries {
  KVExtents ext;
  std::vector<T> data;
  explicit OwnedQueries(KVExtents e) : ext(e), data(static_cast<std::size_t>(e.rows() * e.dim)) {}
  T* row(Index b, Index h, Index i) { return data.data() + ((b * ext.heads + h) * ext.tokens + i) * ext.dim; }
  T const* row(Index b, Index h, Index i) const {
    return data.data() + ((b * ext.heads + h) * ext.tokens + i) * ext.dim;
  }
  TokenRows<T const, StridedLayout> rows() const { return {data.data(), bhtd_layout(ext)}; }
};

}  // namespace kvc::test
