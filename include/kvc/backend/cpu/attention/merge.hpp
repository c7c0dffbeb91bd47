// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/attention/merge.hpp: the CPU kernel of kvc::merge_attention(backend, ...): the host loop.
#pragma once

#include <kvc/attention/merge.hpp>

namespace kvc {

template <>
struct Kernel<MergeStep, Cpu> {
  static Status run(Cpu const&, float* out_a, float* lse_a, float const* out_b, float const* lse_b, Index rows,
                    Index dim) {
    return merge_attention(out_a, lse_a, out_b, lse_b, rows, dim);
  }
};

}  // namespace kvc
