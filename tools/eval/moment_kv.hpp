// SPDX-License-Identifier: Apache-2.0
// tools/eval/moment_kv.hpp: MomentKV in kvc-eval (shared/specs/moment_kv.md §2–§4): one layer's prefill compression
// with its moments, shared by the engine (eval/engine.hpp) and the correction measurement (eval/correction.hpp).
//
// A layer is compressed in place (the cache needs a per-head length table):
//  - mi=true:  kvc::moment_kv_prefill (the MI score α_j ‖r_j‖ over prefill_rounds rounds, each head to its L_h);
//  - mi=false: the base score alone, exactly as snap_kv's row compresses (kvc::compress with the base SnapKV scorer
//              and the same selection), then kvc::on_evict folds the evicted tokens into the moments, then
//              kvc::compact. So mi=false selects what snap_kv with the same base parameters selects.
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

/// The MomentKV scorer of a configuration over `state` (moments stored as MT).
template <class MT>
MomentKVScorer<HostSpace, MT> moment_scorer(tools::MomentKVConfig const& c, MomentState<HostSpace, MT> state) {
  MomentKVScorer<HostSpace, MT> s;
  s.state = state;
  s.base = c.scorer.base;
  s.scale = c.scorer.scale;
  s.clamp_tau = c.scorer.clamp_tau;
  s.prefill_rounds = c.scorer.prefill_rounds;
  return s;
}

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

/// Scratch of one layer's compression (reused across layers and calls).
struct MomentScratch {
  std::vector<Index> index, count;
  std::vector<std::byte> workspace;
  void grow(std::size_t bytes) {
    if (workspace.size() < bytes)
      workspace.resize(bytes);
  }
};

/// Compresses one layer's prefilled `cache` in place with MomentKV (see the file comment), folding every evicted
/// token into `moments`. `obs` are the window queries of the base score; `ratio` (when set) or `budget` tokens per
/// head is the budget; `params` the row's parameters (the allocator's included); `tokens` the longest head.
template <class MT, class C, class Obs>
Status moment_kv_compress(tools::MomentKVConfig const& cfg, tools::AllocatorChoice const& alloc,
                          tools::Params const& params, std::optional<double> ratio, Index budget, Index tokens,
                          C const& cache, Obs const& obs, MomentState<HostSpace, MT> const& moments,
                          MomentScratch& scratch) {
  KVExtents const e = cache.keys.extents();
  auto const scorer = moment_scorer(cfg, moments);
  tools::Selection const sel{cfg.n_sink, cfg.n_recent};
  Status status;
  tools::with_selection(alloc, params, sel, ratio, budget, tokens, [&](auto const& selector) {
    if (cfg.mi) {
      scratch.grow(moment_kv_prefill_workspace_bytes(Cpu{}, scorer, selector, e, obs));
      status =
          moment_kv_prefill(Cpu{}, scorer, selector, cache, obs, {scratch.workspace.data(), scratch.workspace.size()});
      return;
    }
    scratch.index.resize(static_cast<std::size_t>(e.rows()));
    scratch.count.resize(static_cast<std::size_t>(e.batch * e.heads));
    KeepPlan<> const plan{scratch.index.data(), scratch.count.data(), e.batch, e.heads, e.tokens};
    Press const press{scorer.base, selector};
    std::size_t const a = compress_workspace_bytes(Cpu{}, press, e, obs),
                      b = on_evict_workspace_bytes(Cpu{}, scorer, e);
    scratch.grow(a > b ? a : b);
    Workspace const ws{scratch.workspace.data(), scratch.workspace.size()};
    status = compress(Cpu{}, press, cache, obs, plan, ws);
    if (status.ok())
      status = on_evict(Cpu{}, scorer, cache, plan, ws);
    if (status.ok())
      status = compact(Cpu{}, plan, cache);
  });
  return status;
}

/// One layer's moments in the configured storage type.
using AnyMoments = std::variant<tools::HostMoments<float>, tools::HostMoments<half>, tools::HostMoments<bfloat16>>;

/// A deep copy of `m` (HostMoments is move-only: its view points into its vectors).
template <class MT>
tools::HostMoments<MT> copy_moments(tools::HostMoments<MT> const& m) {
  tools::HostMoments<MT> c(m.view.batch, m.view.heads, m.view.key_dim, m.view.value_dim);
  std::copy(m.count.begin(), m.count.end(), c.count.begin());
  std::copy(m.key_mean.begin(), m.key_mean.end(), c.key_mean.begin());
  std::copy(m.value_mean.begin(), m.value_mean.end(), c.value_mean.begin());
  std::copy(m.comoment.begin(), m.comoment.end(), c.comoment.begin());
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
      : moments(std::visit([](auto const& m) { return AnyMoments(copy_moments(m)); }, o.moments)),
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
