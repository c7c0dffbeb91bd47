// SPDX-License-Identifier: Apache-2.0
// tools/common/moment_kv.hpp: MomentKV in the tools (kvc CLI and kvc-eval): its parameters (the `moment_kv` entry of
// policies.hpp) parsed once, and one layer's moments owned on the host in the chosen storage type.
#pragma once

#include <kvc/attention/corrected.hpp>
#include <kvc/scorers/moment_kv.hpp>
#include <kvc/scorers/moments.hpp>

#include "policies.hpp"

#include <cstdint>
#include <string>
#include <vector>

namespace kvc::tools {

/// Storage type of the moments (`--param storage`).
enum class MomentStorage : std::uint8_t { fp32, fp16, bf16 };

/// MomentKV as the tools run it, from the policy's resolved parameters.
struct MomentKVConfig {
  MomentKVScorer<> scorer{};       ///< base score, rounds, clamp (its state is set per layer)
  CorrectedAttention attention{};  ///< the correction's clamp and order (scale: the model's)
  bool mi = true;                  ///< moment-informed eviction (false: the base score alone)
  bool correction = true;          ///< attend with the correction
  bool decode_evict = true;        ///< Algorithm 1 while decoding
  MomentStorage storage = MomentStorage::fp32;
  Index residual_refresh = 0;  ///< 0: no u_j cache
  Index n_sink = 1;
  Index n_recent = 32;
};

inline MomentKVConfig moment_kv_config(Params const& p) {
  auto count = [&](char const* name, Index min = 0) {
    return parse_count(p.at(name), std::string("--param ") + name, min);
  };
  MomentKVConfig c;
  c.scorer.base.window_size = count("window_size", 1);
  c.scorer.base.kernel_size = count("kernel_size", 1);
  std::string const& pooling = p.at("pooling");
  if (pooling == "none") {
    c.scorer.base.kernel_size = 1;
    c.scorer.base.pooling = Pooling::max;
  } else {
    c.scorer.base.pooling = choice<Pooling>(p, "pooling", {{"chunk_mean", Pooling::chunk_mean}, {"max", Pooling::max}});
  }
  if (c.scorer.base.pooling == Pooling::max && c.scorer.base.kernel_size % 2 == 0)
    fail(exit_invalid, "--param kernel_size = " + p.at("kernel_size") + ": pooling=max needs an odd kernel_size");
  c.scorer.prefill_rounds = count("prefill_rounds", 1);
  c.scorer.clamp_tau = static_cast<float>(parse_real(p, "clamp_tau", 0.0, 1e30));
  c.attention.clamp_tau = c.scorer.clamp_tau;
  c.attention.order = choice<MomentOrder>(p, "order", {{"first", MomentOrder::first}, {"zeroth", MomentOrder::zeroth}});
  c.mi = parse_bool(p, "mi");
  c.correction = parse_bool(p, "correction");
  c.decode_evict = parse_bool(p, "decode_evict");
  c.storage = choice<MomentStorage>(
      p, "storage", {{"fp32", MomentStorage::fp32}, {"fp16", MomentStorage::fp16}, {"bf16", MomentStorage::bf16}});
  c.residual_refresh = count("residual_refresh");
  c.n_sink = count("n_sink");
  c.n_recent = count("n_recent");
  if (auto const st = c.scorer.check(); !st.ok())
    fail(exit_invalid, "policy moment_kv: " + std::string(st.message()));
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
  s.mi = c.mi;
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
