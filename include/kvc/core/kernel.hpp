// SPDX-License-Identifier: Apache-2.0
// kvc/core/kernel.hpp: the one extension point of kvc. Every step (score, select, attend, append, compact, and the
// coming allocate, quantize and update steps) is a parameter struct `Op`; its implementation on backend `B` is the
// specialisation Kernel<Op, B> in backend/<name>/...: e.g. Kernel<KeyDiffScorer, Cpu>, Kernel<TopKSelector<R>, Cuda>,
// Kernel<Attention, Cpu>. Entry points (kvc::score, kvc::select, kvc::attend, ...) check the contract that is
// common to every backend, then call the kernel; drivers call entry points, so they run on every backend.
#pragma once

#include <kvc/core/backend.hpp>

namespace kvc {

/// Primary template left undefined on purpose: a missing kernel is one static_assert at the entry point, naming
/// the header to include.
template <class Op, class B>
struct Kernel;

/// Whether step `Op` has a kernel on backend `B` (the header defining it has been included).
template <class Op, class B>
concept HasKernel = requires {
  sizeof(Kernel<Op, B>);
};

}  // namespace kvc
