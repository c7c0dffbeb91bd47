// SPDX-License-Identifier: Apache-2.0
// kvc/pipeline/rdkv_policy.hpp: RDKV (Zhang et al., arXiv 2605.08317; docs/policies/rdkv.md) as the tools and presses
// configure it: kvc::RDKVPress over its own token weights, plus the choices that are not one member of the press
// (the reference preset, the epsilon tables), each parameter declared once (core/params.hpp). resolved() is the
// RDKVPress the engine runs (kvc::LayerCompressor, engine/packed_compressor.hpp).
#pragma once

#include <kvc/core/extents.hpp>
#include <kvc/core/params.hpp>
#include <kvc/core/status.hpp>
#include <kvc/pipeline/pack.hpp>
#include <kvc/pipeline/packed_press.hpp>
#include <kvc/rate_distortion/epsilon.hpp>
#include <kvc/rate_distortion/knapsack.hpp>
#include <kvc/scorers/rdkv.hpp>
#include <kvc/selectors/rdkv.hpp>

#include <cstdint>
#include <string_view>
#include <tuple>

namespace kvc {

/// Which implementation RDKV follows: kvc's default (the exact solver, KIVI's float-min zero point, K at 16 bits kept
/// lossless) or the authors' code (their Lagrangian solver and integer zero point, K16 stored as 8-bit codes).
enum class RDKVReference : std::uint8_t { standard, authors };

/// Which distortion tables (EpsilonTable pairs) the allocation uses.
enum class RDKVEpsilon : std::uint8_t {
  llama31,  ///< calibrated on Llama-3.1-8B-Instruct (EpsilonTable::llama31_v / llama31_k)
  builtin,  ///< the authors' code's built-ins (EpsilonTable::default_v / default_k)
};

/// RDKV as one policy: the reference, the press (token weights, channel weights, allocation, packing) and the
/// epsilon tables. The channel scorer's window is the token scorer's (one `window_size`); the allocator's budget is
/// the caller's (RDKVAllocator::budget_tokens or ratio, per call).
struct RDKVPolicy {
  static constexpr std::string_view name = "rdkv";

  RDKVReference reference = RDKVReference::standard;
  RDKVPress<> press{};  ///< its allocator's eps tables, channels.window_size and pack.clamp_k16_to_8 are derived:
                        ///< resolved() sets them from `eps`, the token window and `reference` (set here, ignored)
  RDKVEpsilon eps = RDKVEpsilon::llama31;

  /// The authors' preset (reference=authors): their solver and zero point.
  static constexpr RDKVPolicy authors() noexcept {
    RDKVPolicy p;
    p.reference = RDKVReference::authors;
    p.press.allocator.solver = BitSolver::lagrangian;
    p.press.pack.zero_point = ZeroPoint::integer;
    return p;
  }

  /// The press the engine runs: the chosen epsilon tables, the channel weights over the token weights' window, and
  /// the authors' packer (never K at 16 bits) under reference=authors.
  constexpr RDKVPress<> resolved() const noexcept {
    RDKVPress<> p = press;
    p.channels.window_size = press.scorer.window_size;
    bool const llama = eps == RDKVEpsilon::llama31;
    p.allocator.eps_v = llama ? EpsilonTable::llama31_v() : EpsilonTable::default_v();
    p.allocator.eps_k = llama ? EpsilonTable::llama31_k() : EpsilonTable::default_k();
    p.pack.clamp_k16_to_8 = reference == RDKVReference::authors;
    return p;
  }

  /// The parameters the tools expose (core/params.hpp; authors()'s defaults under reference=authors).
  static constexpr auto parameters() noexcept {
    using P = RDKVPolicy;
    using R = RDKVPress<>;
    constexpr auto token = [](auto const& p) { return nested(&P::press, nested(&R::scorer, p)); };
    constexpr auto alloc = [](auto const& p) { return nested(&P::press, nested(&R::allocator, p)); };
    constexpr auto pack = [](auto const& p) { return nested(&P::press, nested(&R::pack, p)); };
    return std::tuple{
        named_param("reference", &P::reference,
                    {{"default", RDKVReference::standard}, {"authors", RDKVReference::authors}},
                    "default (exact solver, float-min zero point, K at 16 bits kept lossless) or authors (the RDKV "
                    "code: lagrangian solver, integer zero point, K16 clamped to 8)"),
        alloc(number_param("k_budget_ratio", &RDKVAllocator::k_budget_ratio, 0.0, 1.0,
                           "rho in (0, 1): K's share of the bits, V gets 1 - rho")),
        alloc(named_param("solver", &RDKVAllocator::solver,
                          {{"exact", BitSolver::exact}, {"lagrangian", BitSolver::lagrangian}},
                          "exact (never over the budget) or lagrangian (the authors' bisection, may overshoot 1%)")),
        token(number_param("window_size", &RDKVTokenScorer::window_size, 1, max_param_index,
                           "w: the last w rows of --queries give the token and channel weights")),
        token(odd_param("kernel_size", &RDKVTokenScorer::kernel_size, 1, max_param_index,
                        "avg pooling of the token weights along the tokens (reflect padding), odd")),
        token(named_param("weight", &RDKVTokenScorer::weight,
                          {{"attn_linear", RDKVTokenWeight::attn_linear}, {"derived", RDKVTokenWeight::derived}},
                          "token weights: attn_linear (window attention / causal count) or derived (E[a^2] d "
                          "var(v))")),
        named_param("eps", &P::eps, {{"llama31", RDKVEpsilon::llama31}, {"default", RDKVEpsilon::builtin}},
                    "epsilon tables: llama31 (calibrated, Llama-3.1-8B) or default (the code's built-ins)"),
        alloc(nested(&RDKVAllocator::options,
                     flag_param("evict", &BitOptions::evict,
                                "true: 0 bits (eviction) is an option; false: quantization only (2 bits at least)"))),
        alloc(named_param("scope", &RDKVAllocator::scope,
                          {{"head", RDKVBudgetScope::head}, {"layer", RDKVBudgetScope::layer}},
                          "head (a budget per KV head, the authors') or layer (one lambda over the layer's heads)")),
        pack(named_param("zero_point", &PackOptions::zero_point,
                         {{"float_min", ZeroPoint::float_min}, {"integer", ZeroPoint::integer}},
                         "float_min (KIVI's offset) or integer (the authors' clamped zero point)")),
        pack(number_param("v_group", &PackOptions::v_group, 0, 1 << 20,
                          "channels per V quantization group (0: the whole head dim)")),
        pack(number_param("k_group", &PackOptions::k_group, 0, 1 << 30,
                          "kept tokens per K quantization group (0: all of them)")),
        alloc(number_param("residual", &RDKVAllocator::residual, 0, 1 << 30,
                           "the newest tokens kept at 16 bits outside the allocation (an fp16 tail)"))};
  }

  constexpr Status check() const noexcept {
    if (!(press.allocator.k_budget_ratio > 0.0 && press.allocator.k_budget_ratio < 1.0))
      return {Errc::invalid_argument,
              "RDKVPolicy: `k_budget_ratio` must be in (0, 1), ends excluded (K and V both get bits)"};
    return resolved().check();
  }
};

}  // namespace kvc
