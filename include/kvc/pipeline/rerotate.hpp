// SPDX-License-Identifier: Apache-2.0
// kvc/pipeline/rerotate.hpp: move compacted keys onto contiguous cache positions 0..length-1.
//
// After compaction, slot j of head (b, h) holds a key that RoPE rotated at its absolute position p_j (the cache's
// positions). StreamingLLM's paper (positions "within the cache") and kvpress's KeyRerotationPress rotate each key
// by (j - p_j) so decoding can continue at position length; the cache's positions then read j. Values are
// untouched. Kernel: Kernel<RerotateStep, B> in backend/*/pipeline/rerotate.
#pragma once

#include <kvc/core/backend.hpp>
#include <kvc/core/checks.hpp>
#include <kvc/core/kernel.hpp>
#include <kvc/core/kv_view.hpp>
#include <kvc/core/rope.hpp>
#include <kvc/core/status.hpp>

#include <type_traits>

namespace kvc {

/// Step tag of key re-rotation.
struct RerotateStep {};

/// Re-rotates every valid key of `cache` from its position to its slot index and writes the new positions (when
/// the cache has a positions table). `table` must cover every position involved (old and new); it must be a plain
/// rotation (RopeSpec::scaling == 1). Errors: the table is too short or malformed (invalid_argument).
template <Backend B, KVCacheView C>
Status rerotate_keys(B const& backend, RopeTable<typename B::memory_space> const& table, C const& cache) {
  static_assert(AccessibleFrom<C, B>, "kvc::rerotate_keys: the cache lives in a memory space this backend cannot read");
  static_assert(!std::is_const_v<typename C::keys_type::element_type>, "kvc::rerotate_keys: keys must be writable");
  static_assert(HasKernel<RerotateStep, B>, "kvc::rerotate_keys: include <kvc/backend/cpu/pipeline/rerotate.hpp>");
  KVC_RETURN_IF_ERROR(detail::check_cache(cache, KVC_CACHE_MESSAGES("kvc::rerotate_keys", "the cache")));
  if (table.empty())
    return {Errc::invalid_argument, "kvc::rerotate_keys: `table` is empty"};
  return Kernel<RerotateStep, B>::run(backend, table, cache);
}

}  // namespace kvc
