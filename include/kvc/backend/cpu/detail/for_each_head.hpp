// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/detail/for_each_head.hpp: the (batch, KV head) loops every CPU kernel shares, serial or through
// the engine's parallel-for (kvc::Cpu::parallel).
#pragma once

#include <kvc/core/backend.hpp>
#include <kvc/core/scores.hpp>
#include <kvc/core/status.hpp>

#include <algorithm>
#include <limits>
#include <type_traits>

namespace kvc::detail {

/// Calls fn(item, worker) for item in [0, n): in order on the calling thread, or through cpu.parallel. Each item
/// must write only its own outputs and the scratch of `worker`, so results do not depend on the thread count.
template <class Fn>
void parallel_for(Cpu const& cpu, Index n, Fn&& fn) {
  if (cpu.workers() <= 1 || n <= 1) {
    for (Index i = 0; i < n; ++i)
      fn(i, Index{0});
    return;
  }
  using F = std::remove_reference_t<Fn>;
  ParallelFor::Task const task{const_cast<void*>(static_cast<void const*>(&fn)),
                               [](void* ctx, Index item, Index worker) { (*static_cast<F*>(ctx))(item, worker); }};
  cpu.parallel.run(cpu.parallel.context, n, task);
}

/// Checks every head's valid length against the capacity (the one check all CPU kernels share).
inline Status check_lengths(Lengths const& lengths, Index batch, Index heads, Index capacity, char const* what) {
  if (lengths.data == nullptr)
    return {};
  for (Index b = 0; b < batch; ++b)
    for (Index h = 0; h < (lengths.per_head() ? heads : 1); ++h) {
      Index const n = lengths.at(b, h, capacity);
      if (n < 0 || n > capacity)
        return {Errc::invalid_argument, what};
    }
  return {};
}

/// Checks the lengths, then calls fn(b, h, n, scores_of_head, worker) for every head, in parallel when the backend
/// has a parallel-for, to fill scores [0, n); writes -inf into the padding [n, tokens).
template <class Fn>
Status for_each_head(Cpu const& cpu, ScoreSpan<HostSpace> out, Fn&& fn) {
  KVC_RETURN_IF_ERROR(check_lengths(out.lengths, out.batch, out.heads, out.tokens,
                                    "kvc::score: every valid length must be in [0, tokens]"));
  parallel_for(cpu, out.batch * out.heads, [&](Index item, Index worker) {
    Index const b = item / out.heads, h = item % out.heads;
    Index const n = out.length(b, h);
    float* score = out.row(b, h);
    fn(b, h, n, score, worker);
    std::fill(score + n, score + out.tokens, -std::numeric_limits<float>::infinity());
  });
  return {};
}

}  // namespace kvc::detail
