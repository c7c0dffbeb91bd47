// SPDX-License-Identifier: Apache-2.0
// tools/common/rdkv.hpp: RDKV and the KIVI configuration in the tools (`kvc`, `kvc-eval`; spec shared/specs/rdkv.md):
// the one place their NAME=VALUE parameters (the `rdkv` and `kivi` rows of policies.hpp, declared by kvc::RDKVPolicy
// and kvc::KIVIPress) become the library's objects (RDKVPress, KIVIPress). KIVI's plan, the fp16 tail
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
#include <kvc/pipeline/rdkv_policy.hpp>
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

/// RDKV's or KIVI's configuration: the library's policy objects (their parameters declared there), parsed once.
struct RDKVConfig {
  bool kivi = false;
  RDKVPress<> press{};        ///< rdkv: RDKVPolicy::resolved() (budget_tokens / ratio are set per call: allocator_for)
  std::string weight_policy;  ///< rdkv: non-empty = that policy's scores (shifted to >= 0) are the token weights
  KIVIPress kivi_press{};     ///< kivi

  Index window_size() const noexcept { return kivi ? 0 : press.scorer.window_size; }
  /// The newest tokens of each head kept in fp16 outside the packed store.
  Index residual() const noexcept { return kivi ? kivi_press.residual : press.allocator.residual; }

  /// The allocator for a budget of `budget` fp16-equivalent tokens per (layer, KV head), or floor(n (1 - ratio)).
  RDKVAllocator allocator_for(std::optional<double> ratio, Index budget) const {
    RDKVAllocator a = press.allocator;
    a.budget_tokens = budget;
    a.ratio = ratio ? *ratio : -1.0;
    return a;
  }
};

/// The configuration of an `rdkv` or `kivi` row (policies.hpp) from its resolved parameters. rdkv's weight=NAME (a
/// token policy's scores as the weights) is the tools' extension of RDKVPolicy's `weight`.
inline RDKVConfig rdkv_config(PolicyInfo const& policy, Params const& p) {
  RDKVConfig c;
  if (std::string_view(policy.name) == "kivi") {
    c.kivi = true;
    c.kivi_press = from_params<KIVIPress>(p);
    return c;
  }
  if (std::string_view(policy.name) != "rdkv")
    throw std::logic_error("kvc: rdkv_config of a policy that is neither rdkv nor kivi");
  Params declared = p;
  if (auto const weight = declared.find("weight");
      weight != declared.end() && weight->second != "attn_linear" && weight->second != "derived") {
    if (std::find(std::begin(rdkv_weight_policies), std::end(rdkv_weight_policies), weight->second) ==
        std::end(rdkv_weight_policies)) {
      std::string names;
      for (std::string_view n : rdkv_weight_policies) {
        names += ", ";
        names += n;
      }
      fail(exit_invalid, "--param weight = '" + weight->second +
                             "': expected attn_linear, derived or a token policy (" + names.substr(2) + ")");
    }
    c.weight_policy = weight->second;
    weight->second = "attn_linear";  // (unused: the policy's scores replace RDKVTokenScorer's)
  }
  if (p.count("channel"))
    choice<int>(p, "channel", {{"think", 0}});
  c.press = from_params<RDKVPolicy>(declared).resolved();
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
    fn(c.kivi_press);
  } else if (c.weight_policy.empty()) {
    fn(RDKVPress<>{c.press.scorer, c.press.channels, alloc, c.press.pack});
  } else {
    PolicyInfo const& inner = find_policy(c.weight_policy);
    with_policy(inner, resolve_params(inner, {}, false), [&](auto const& scorer, Selection) {
      using S = std::remove_cvref_t<decltype(scorer)>;
      if constexpr (!StatefulScorer<S> || std::is_same_v<S, H2OScorer<>>)
        fn(RDKVPress<S>{scorer, c.press.channels, alloc, c.press.pack});
      else  // rdkv_weight_policies lists none
        throw std::logic_error("kvc: rdkv's weight policy " + c.weight_policy + " is stateful");
    });
  }
}

}  // namespace kvc::tools
