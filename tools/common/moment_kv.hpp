// SPDX-License-Identifier: Apache-2.0
// tools/common/moment_kv.hpp: MomentKV in the tools (kvc CLI and kvc-eval): its parameters (the `moment_kv` entry of
// policies.hpp, declared by kvc::MomentKVPolicy) parsed once, and one layer's moments owned on the host in the chosen
// storage type.
#pragma once

#include <kvc/attention/corrected.hpp>
#include <kvc/engine/moment_kv_policy.hpp>
#include <kvc/scorers/moment_kv.hpp>
#include <kvc/scorers/moments.hpp>

#include "policies.hpp"

#include <cstdint>
#include <string>
#include <vector>

namespace kvc::tools {

/// MomentKV as the tools run it: the library's policy object (its parameters declared there).
using MomentKVConfig = MomentKVPolicy;

/// The `moment_kv` row's resolved parameters as the policy object (bad values exit 3 naming the parameter, before
/// any file is read). pooling=none is the tools' spelling of a kernel of one (kernel_size is then ignored).
inline MomentKVConfig moment_kv_config(Params const& p) {
  Params q = p;
  auto const pooling = q.find("pooling");
  bool const none =
      pooling != q.end() && choice<bool>(p, "pooling", {{"chunk_mean", false}, {"max", false}, {"none", true}});
  if (none)
    pooling->second = "chunk_mean";  // kernel_size still checked, as any chunk takes it
  MomentKVConfig c = from_params<MomentKVPolicy>(q);
  if (none) {
    c.scorer.base.kernel_size = 1;
    c.scorer.base.pooling = Pooling::max;
  }
  return c;
}

/// The MomentKV scorer of a configuration (its base, rounds, clamp and `mi`) over `state` (moments stored as MT; a
/// kvc::LayerCompressor points it at its own).
template <class MT>
MomentKVScorer<HostSpace, MT> moment_scorer(MomentKVConfig const& c, MomentState<HostSpace, MT> state = {}) {
  MomentKVScorer<HostSpace, MT> s;
  s.state = state;
  s.base = c.scorer.base;
  s.scale = c.scorer.scale;
  s.clamp_tau = c.scorer.clamp_tau;
  s.prefill_rounds = c.scorer.prefill_rounds;
  s.mi = c.scorer.mi;
  return s;
}

/// One layer's moments [batch, heads], owned on the host, stored as T (zeroed: nothing evicted).
template <class T = float>
struct HostMoments {
  std::vector<Index> count;
  std::vector<T> key_mean, value_mean, comoment;
  MomentState<HostSpace, T> view{};

  HostMoments() = default;
  HostMoments(Index batch, Index heads, Index dk, Index dv)
      : count(static_cast<std::size_t>(batch * heads), 0),
        key_mean(static_cast<std::size_t>(batch * heads * dk), from_float<T>(0.0f)),
        value_mean(static_cast<std::size_t>(batch * heads * dv), from_float<T>(0.0f)),
        comoment(static_cast<std::size_t>(batch * heads * dk * dv), from_float<T>(0.0f)) {
    view = {count.data(), key_mean.data(), value_mean.data(), comoment.data(), batch, heads, dk, dv};
  }
  HostMoments(HostMoments const&) = delete;  // the view points into the vectors
  HostMoments& operator=(HostMoments const&) = delete;
  HostMoments(HostMoments&& o) noexcept { *this = std::move(o); }
  HostMoments& operator=(HostMoments&& o) noexcept {
    count = std::move(o.count);
    key_mean = std::move(o.key_mean);
    value_mean = std::move(o.value_mean);
    comoment = std::move(o.comoment);
    view = o.view;
    return *this;
  }
  /// Bytes the moments occupy ((d_v d_k + d_k + d_v) elements + an 8-byte count per head).
  std::size_t bytes() const { return moment_state_bytes<T>(view.batch, view.heads, view.key_dim, view.value_dim); }
};

/// Calls fn(HostMoments<T>&-compatible type tag) with T the configured storage: fn(float{}), fn(half{}) or
/// fn(bfloat16{}).
template <class Fn>
decltype(auto) with_moment_storage(MomentStorage s, Fn&& fn) {
  switch (s) {
    case MomentStorage::fp16: return fn(half{});
    case MomentStorage::bf16: return fn(bfloat16{});
    default: return fn(float{});
  }
}

}  // namespace kvc::tools
