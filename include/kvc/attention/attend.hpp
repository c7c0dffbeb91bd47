// SPDX-License-Identifier: Apache-2.0
// kvc/attention/attend.hpp: options and shapes of the reference attention over a full or compressed cache.
#pragma once

#include <kvc/core/extents.hpp>
#include <kvc/core/keep_plan.hpp>
#include <kvc/core/kv_view.hpp>

namespace kvc {

/// Dense queries [batch, query_heads, n_queries, d_k] in fp32, post-RoPE (BHTD layout; `heads` = query heads).
using QueryRows = TokenRows<float const, StridedLayout>;

/// Options of kvc::attend.
struct AttendOptions {
  float scale = 0.0f;        ///< logit scale; 0 = 1 / sqrt(d_k)
  Index causal_offset = -1;  ///< < 0: no mask. Else query i sits at position causal_offset + i and sees keys at
                             ///< positions <= that (original positions, so compressed caches mask correctly)
};

/// Which cache slots each KV head attends: the first `count[b, h]` slots with positions `index[b, h, j]`
/// (a KeepPlan after compaction), or, without a plan, slots [0, length(b)) at positions t.
using AttendKeys = KeepPlan<HostSpace> const*;

}  // namespace kvc
