// SPDX-License-Identifier: Apache-2.0
// tools/common/rdkv.hpp: RDKV and the KIVI configuration in the tools (`kvc`, `kvc-eval`; spec shared/specs/rdkv.md):
// the one place their NAME=VALUE parameters (the `rdkv` and `kivi` rows of policies.hpp) become the library's
// objects (RDKVAllocator, RDKVTokenScorer, ThinKChannelScorer, PackOptions, KIVIPress). KIVI's plan, the fp16 tail
// and a policy's scores as token weights are the library's (pipeline/packed_press.hpp).
// Bad values throw tools::Failure (exit 3) naming the parameter, before any file is read.
#pragma once

#include <kvc/backend/cpu/attention/merge.hpp>
#include <kvc/backend/cpu/attention/packed.hpp>
#include <kvc/backend/cpu/pipeline/pack.hpp>
#include <kvc/backend/cpu/pipeline/query_statistics.hpp>
#include <kvc/backend/cpu/pipeline/state.hpp>
#include <kvc/backend/cpu/scorers/rdkv.hpp>
#include <kvc/backend/cpu/selectors/rdkv.hpp>
#include <kvc/pipeline/pack.hpp>
#include <kvc/pipeline/packed_press.hpp>
#include <kvc/quant/minmax.hpp>
#include <kvc/rate_distortion/epsilon.hpp>
#include <kvc/rate_distortion/knapsack.hpp>
#include <kvc/scorers/rdkv.hpp>
#include <kvc/selectors/rdkv.hpp>
#include <kvc/store/packed.hpp>

#include "policies.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

namespace kvc::tools {

/// The policies whose cache is a packed mixed-precision store (bit plans), not a kept set of tokens.
inline bool is_packed_policy(std::string_view name) noexcept {
  return name == "rdkv" || name == "kivi";
}

/// The policies whose scores may be RDKV's token weights (weight=NAME): every token scorer of with_policy.
inline constexpr std::string_view rdkv_weight_policies[] = {"streaming_llm", "key_diff",           "knorm", "snap_kv",
                                                            "tova",          "expected_attention", "h2o",   "random"};

/// RDKV's or KIVI's configuration, parsed once from the row's resolved parameters.
struct RDKVConfig {
  bool kivi = false;
  bool authors = false;          ///< reference=authors
  RDKVAllocator allocator{};     ///< rdkv: budget_tokens / ratio are set per call (allocator_for)
  RDKVTokenScorer token{};       ///< rdkv: attn_linear or derived weights
  std::string weight_policy;     ///< rdkv: non-empty = that policy's scores (shifted to >= 0) are the weights
  ThinKChannelScorer channel{};  ///< rdkv: the channel weights
  PackOptions pack{};            ///< quantizer and groups (KIVI: float_min, groups of `group`)
  int bits = 2;                  ///< kivi: 2 or 4
  Index group = 32;              ///< kivi: tokens per K group, channels per V group
  Index residual = 0;            ///< the newest tokens of each head kept in fp16 outside the packed store

  Index window_size() const noexcept { return kivi ? 0 : token.window_size; }
  /// KIVI's policy object (kvc::kivi_plan's parameters).
  KIVIPress kivi_press() const noexcept { return {bits, group, residual}; }

  /// The allocator for a budget of `budget` fp16-equivalent tokens per (layer, KV head), or floor(n (1 - ratio)).
  RDKVAllocator allocator_for(std::optional<double> ratio, Index budget) const {
    RDKVAllocator a = allocator;
    a.budget_tokens = budget;
    a.ratio = ratio ? *ratio : -1.0;
    return a;
  }
};

/// `value` of parameter `name` as a number in the open interval (lo, hi) (exit 3 naming it).
inline double parse_open_real(Params const& p, char const* name, double lo, double hi) {
  double const v = parse_real(p, name, lo, hi);
  if (!(v > lo && v < hi))
    fail(exit_invalid, std::string("--param ") + name + " = '" + p.at(name) + "': expected a number in (" +
                           std::to_string(lo) + ", " + std::to_string(hi) + "), ends excluded");
  return v;
}

/// The configuration of an `rdkv` or `kivi` row (policies.hpp) from its resolved parameters.
inline RDKVConfig rdkv_config(PolicyInfo const& policy, Params const& p) {
  auto count = [&](char const* name, Index min = 0) {
    return parse_count(p.at(name), std::string("--param ") + name, min);
  };
  RDKVConfig c;
  if (std::string_view(policy.name) == "kivi") {
    c.kivi = true;
    c.bits = choice<int>(p, "bits", {{"2", 2}, {"4", 4}});
    c.group = count("group", 1);
    c.residual = count("residual");
    if (c.group > (Index{1} << 20) || c.residual > (Index{1} << 30))
      fail(exit_invalid, "--param group / residual: expected at most 2^20 / 2^30");
    c.pack.zero_point = ZeroPoint::float_min;
    c.pack.v_group = c.group;
    c.pack.k_group = c.group;
    c.pack.clamp_k16_to_8 = false;
    return c;
  }
  if (std::string_view(policy.name) != "rdkv")
    throw std::logic_error("kvc: rdkv_config of a policy that is neither rdkv nor kivi");
  c.authors = choice<bool>(p, "reference", {{"default", false}, {"authors", true}});
  RDKVAllocator& a = c.allocator;
  a.k_budget_ratio = parse_open_real(p, "k_budget_ratio", 0.0, 1.0);
  a.solver = choice<BitSolver>(p, "solver", {{"exact", BitSolver::exact}, {"lagrangian", BitSolver::lagrangian}});
  bool const llama = choice<bool>(p, "eps", {{"llama31", true}, {"default", false}});
  a.eps_v = llama ? EpsilonTable::llama31_v() : EpsilonTable::default_v();
  a.eps_k = llama ? EpsilonTable::llama31_k() : EpsilonTable::default_k();
  a.options.evict = parse_bool(p, "evict");
  a.scope = choice<RDKVBudgetScope>(p, "scope", {{"head", RDKVBudgetScope::head}, {"layer", RDKVBudgetScope::layer}});
  c.residual = count("residual");
  if (c.residual > (Index{1} << 30))
    fail(exit_invalid, "--param residual = " + p.at("residual") + ": expected at most 2^30");
  a.residual = c.residual;
  c.token.window_size = count("window_size", 1);
  c.token.kernel_size = count("kernel_size", 1);
  if (c.token.kernel_size % 2 == 0)
    fail(exit_invalid, "--param kernel_size = " + p.at("kernel_size") +
                           ": expected an odd integer (an even kernel shifts the pooled weights)");
  std::string const& weight = p.at("weight");
  if (weight == "attn_linear") {
    c.token.weight = RDKVTokenWeight::attn_linear;
  } else if (weight == "derived") {
    c.token.weight = RDKVTokenWeight::derived;
  } else if (std::find(std::begin(rdkv_weight_policies), std::end(rdkv_weight_policies), weight) !=
             std::end(rdkv_weight_policies)) {
    c.weight_policy = weight;
  } else {
    std::string names;
    for (std::string_view n : rdkv_weight_policies) {
      names += ", ";
      names += n;
    }
    fail(exit_invalid, "--param weight = '" + weight + "': expected attn_linear, derived or a token policy (" +
                           names.substr(2) + ")");
  }
  choice<int>(p, "channel", {{"think", 0}});
  c.channel.window_size = c.token.window_size;
  c.pack.zero_point =
      choice<ZeroPoint>(p, "zero_point", {{"float_min", ZeroPoint::float_min}, {"integer", ZeroPoint::integer}});
  c.pack.v_group = count("v_group");
  c.pack.k_group = count("k_group");
  if (c.pack.v_group > (Index{1} << 20) || c.pack.k_group > (Index{1} << 30))
    fail(exit_invalid, "--param v_group / k_group: expected at most 2^20 / 2^30");
  c.pack.clamp_k16_to_8 = c.authors;  // the authors' packer never stores K at 16 bits
  if (auto const st = c.token.check(); !st.ok())
    fail(exit_invalid, "policy rdkv: " + std::string(st.message()));
  if (auto const st = c.channel.check(); !st.ok())
    fail(exit_invalid, "policy rdkv: " + std::string(st.message()));
  return c;
}

/// The budget a row's allocator is checked with before anything is read (exit 3 naming --budget/--ratio or the
/// parameter the library names).
inline void check_rdkv_budget(RDKVConfig const& c, std::optional<double> ratio, Index budget) {
  if (c.kivi)
    return;
  if (auto const st = c.allocator_for(ratio, budget).check(); !st.ok())
    fail(exit_invalid, "policy rdkv (" + std::string(ratio ? "--ratio" : "--budget") + "): " + st.message());
}

/// Calls fn(press) with the row's policy object for kvc::LayerCompressor: KIVIPress, RDKVPress<> over RDKV's own
/// token weights, or RDKVPress<S> over the scores of the weight=NAME policy (with its default parameters), each
/// allocating for `ratio` (when set) or `budget` fp16-equivalent tokens per head.
template <class Fn>
void with_packed_press(RDKVConfig const& c, std::optional<double> ratio, Index budget, Fn&& fn) {
  RDKVAllocator const alloc = c.allocator_for(ratio, budget);
  if (c.kivi) {
    fn(c.kivi_press());
  } else if (c.weight_policy.empty()) {
    fn(RDKVPress<>{c.token, c.channel, alloc, c.pack});
  } else {
    PolicyInfo const& inner = find_policy(c.weight_policy);
    with_policy(inner, resolve_params(inner, {}, false), [&](auto const& scorer, Selection) {
      using S = std::remove_cvref_t<decltype(scorer)>;
      if constexpr (!StatefulScorer<S> || std::is_same_v<S, H2OScorer<>>)
        fn(RDKVPress<S>{scorer, c.channel, alloc, c.pack});
      else  // rdkv_weight_policies lists none
        throw std::logic_error("kvc: rdkv's weight policy " + c.weight_policy + " is stateful");
    });
  }
}

}  // namespace kvc::tools
