// SPDX-License-Identifier: Apache-2.0
// kvc/core/params.hpp: a policy's parameters, declared once next to the policy. Host only (never read by kernels).
//
// A policy struct lists its tunable members in `static constexpr auto parameters()`, a std::tuple of kvc::Param:
//
//   static constexpr auto parameters() noexcept {
//     return std::tuple{
//         named_param("reference", &SnapKVScorer::reference, reference_names, "authors or kvpress (SnapKVPress)"),
//         number_param("window_size", &SnapKVScorer::window_size, 1, max_param_index, "observation window w")};
//   }
//
// Each names a member (the name kvpress gives the field where kvpress has the concept), says in one line what it
// does, and which values it takes: numbers in [lo, hi], enums and bools by name. Its default is the member's
// initializer; under reference=kvpress, the policy's `kvpress()` preset's where it has one. The policy's check()
// validates what ties members together (an odd kernel, a reduction kvpress allows). The tools generate `kvc
// policies`, `--param NAME=VALUE` parsing and kvc-eval's `policy(name=value)` rows from these declarations
// (tools/common/policies.hpp), so a parameter added here is listed, parsed and range-checked everywhere at once.
#pragma once

#include <kvc/core/extents.hpp>

#include <array>
#include <cstddef>
#include <limits>
#include <string_view>
#include <type_traits>

namespace kvc {

/// One value of an enum or bool parameter and the name the tools spell it with.
template <class T>
struct Named {
  std::string_view name;
  T value;
};

/// The largest integer a count parameter takes (2^40: far above any context, and exact as a double).
inline constexpr double max_param_index = 1099511627776.0;

/// A parameter of policy `Owner`: the member it sets, its name, one line of documentation, and its values: numbers
/// in [lo, hi] (inclusive; integer members take whole numbers only), enums and bools one of `names` (N of them).
template <class Owner, class T, std::size_t N = 0>
struct Param {
  using owner_type = Owner;
  using value_type = T;
  using member_pointer = T Owner::*;  // (a named type: GCC 12 warns on a bare `T Owner::*member;` member)

  std::string_view name;
  member_pointer member;
  std::string_view doc;
  double lo = -std::numeric_limits<double>::infinity();
  double hi = std::numeric_limits<double>::infinity();
  std::array<Named<T>, N> names{};
};

/// A number parameter (integer or floating point) in [lo, hi].
template <class Owner, class T>
requires(std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) constexpr Param<Owner, T> number_param(
    std::string_view name, T Owner::*member, double lo, double hi, std::string_view doc) noexcept {
  return {name, member, doc, lo, hi, {}};
}

/// An enum or bool parameter, spelled by `names` (listed in --help order).
template <class Owner, class T, std::size_t N>
constexpr Param<Owner, T, N> named_param(std::string_view name, T Owner::*member, Named<T> const (&names)[N],
                                         std::string_view doc) noexcept {
  Param<Owner, T, N> p{name, member, doc};
  for (std::size_t i = 0; i < N; ++i)
    p.names[i] = names[i];
  return p;
}

/// A bool parameter spelled true or false.
template <class Owner>
constexpr Param<Owner, bool, 2> flag_param(std::string_view name, bool Owner::*member, std::string_view doc) noexcept {
  return named_param(name, member, {{"true", true}, {"false", false}}, doc);
}

/// Whether policy P declares its parameters.
template <class P>
concept DeclaresParameters = requires {
  P::parameters();
};

}  // namespace kvc
