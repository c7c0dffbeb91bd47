// SPDX-License-Identifier: Apache-2.0
// tools/eval/moment_kv.hpp: MomentKV in kvc-eval (shared/specs/moment_kv.md §2–§4): the scorer and the checked
// configuration of a `moment_kv` row, and the copy of a layer's moments the engine keeps after prefill, shared by the
// engine (eval/engine_impl.hpp) and the correction measurement (eval/correction.cpp). Both compress through a
// kvc::LayerCompressor of a kvc::Press{MomentKVScorer, selection}:
//  - mi=true:  kvc::moment_kv_prefill (the MI score α_j ‖r_j‖ over prefill_rounds rounds, each head to its L_h);
//  - mi=false: the base score alone in one shot, exactly as snap_kv's row compresses, then kvc::on_evict folds the
//              evicted tokens into the moments. So mi=false selects what snap_kv with the same base parameters
//              selects.
// The selection is tools::with_selection's: TopKSelector over the ratio (or a token budget), or with the ada_kv
// allocator AdaKVSelector (the window on top of the budget, as for snap_kv+ada_kv); n_sink and n_recent are the
// policy's (1 and 32 by default: the sink and the observation window).
#pragma once

#include <kvc/backend/cpu/attention/corrected.hpp>
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/scorers/moment_kv.hpp>
#include <kvc/backend/cpu/selectors/ada_kv.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/pipeline/moment_kv.hpp>
#include <kvc/pipeline/press.hpp>

#include "common/moment_kv.hpp"
#include "common/policies.hpp"

#include <algorithm>
#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace kvc::eval {

/// The configuration of a `moment_kv` row from its resolved parameters, with what kvc-eval cannot run refused
/// (exit 3 or 2, naming the parameter).
inline tools::MomentKVConfig eval_moment_config(tools::Params const& params, tools::AllocatorChoice const& alloc,
                                                std::string const& label) {
  tools::MomentKVConfig c = tools::moment_kv_config(params);
  if (alloc.pyramid_kv)
    tools::fail(tools::exit_usage,
                "--policies " + label + ": moment_kv takes the ada_kv allocator (moment_kv+ada_kv), not pyramid_kv");
  if (c.residual_refresh != 0)
    tools::fail(tools::exit_usage, "--param " + label + ".residual_refresh=" + std::to_string(c.residual_refresh) +
                                       ": kvc-eval runs MomentKV without the u_j cache (residual_refresh=0)");
  return c;
}

/// One layer's moments in the configured storage type.
using AnyMoments = std::variant<tools::HostMoments<float>, tools::HostMoments<half>, tools::HostMoments<bfloat16>>;

/// A deep copy of the moments `m` points to (a compressor's state, or another HostMoments': move-only, since its
/// view points into its vectors).
template <class MT>
tools::HostMoments<MT> copy_moments(MomentState<HostSpace, MT> const& m) {
  tools::HostMoments<MT> c(m.batch, m.heads, m.key_dim, m.value_dim);
  std::copy_n(m.count, c.count.size(), c.count.begin());
  std::copy_n(m.key_mean, c.key_mean.size(), c.key_mean.begin());
  std::copy_n(m.value_mean, c.value_mean.size(), c.value_mean.begin());
  std::copy_n(m.comoment, c.comoment.size(), c.comoment.begin());
  return c;
}

/// A compressed layer's MomentKV state: its moments, and how attention over the layer runs (corrected or plain).
struct LayerMoments {
  AnyMoments moments;
  CorrectedAttention op{};
  bool correction = true;

  LayerMoments(AnyMoments m, CorrectedAttention o, bool corrected)
      : moments(std::move(m)), op(o), correction(corrected) {}
  LayerMoments(LayerMoments const& o)
      : moments(std::visit([](auto const& m) { return AnyMoments(copy_moments(m.view)); }, o.moments)),
        op(o.op),
        correction(o.correction) {}
  LayerMoments(LayerMoments&&) noexcept = default;
  LayerMoments& operator=(LayerMoments const&) = delete;
  LayerMoments& operator=(LayerMoments&&) noexcept = default;

  /// Bytes the moments occupy (HostMoments::bytes: moment_state_bytes of their storage type).
  std::size_t bytes() const {
    return std::visit([](auto const& m) { return m.bytes(); }, moments);
  }
};

}  // namespace kvc::eval
