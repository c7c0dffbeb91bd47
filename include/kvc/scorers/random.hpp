// SPDX-License-Identifier: Apache-2.0
// kvc/scorers/random.hpp: uniform random eviction, the baseline every policy must beat (kvpress RandomPress).
//
//   s(b, h, t) = u(seed, b, h, t) in [0, 1): a counter-based hash (SplitMix64 finaliser) of the slot, so scores are
//   deterministic for a seed, identical on every backend, and independent of the thread count. Reads nothing but
//   the lengths.
#pragma once

#include <kvc/core/params.hpp>
#include <kvc/core/scorer.hpp>

#include <cstdint>
#include <string_view>
#include <tuple>

namespace kvc {

/// Random-eviction scorer parameters.
struct RandomScorer {
  static constexpr Needs needs = Needs::none;
  static constexpr std::string_view name = "random";

  std::uint64_t seed = 0;

  /// The parameters the tools expose (core/params.hpp): any 64-bit seed.
  static constexpr auto parameters() noexcept {
    return std::tuple{number_param("seed", &RandomScorer::seed, 0, 18446744073709551615.0,
                                   "64-bit; scores hash (seed, b, h, t): the same on every run and backend")};
  }

  /// The score of slot t of head (b, h): the top 24 bits of a SplitMix64 hash, as a float in [0, 1).
  KVC_HOST_DEVICE constexpr float at(Index b, Index h, Index t) const noexcept {
    std::uint64_t z = seed ^ (static_cast<std::uint64_t>(b) * 0x9e3779b97f4a7c15ull) ^
                      (static_cast<std::uint64_t>(h) * 0xc2b2ae3d27d4eb4full) ^
                      (static_cast<std::uint64_t>(t) * 0x165667b19e3779f9ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return static_cast<float>(z >> 40) * 0x1p-24f;
  }
};

}  // namespace kvc
