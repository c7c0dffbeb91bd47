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
// validates what ties members together (an odd kernel, a reduction kvpress allows).
//
// A composite policy (MomentKV, RDKV, UNComp) owns library objects and declares their members as its own with
// nested(): nested(&MomentKVPolicy::scorer, nested(&MomentKVScorer<>::base, number_param("window_size", ...)))
// names `window_size` of MomentKVPolicy, stored in scorer.base.window_size; p.of(policy) is that member. Its
// `authors()` preset, where it has one, gives the defaults under reference=authors. The tools generate `kvc
// policies`, `--param NAME=VALUE` parsing and kvc-eval's `policy(name=value)` rows from these declarations
// (tools/common/policies.hpp), so a parameter added here is listed, parsed and range-checked everywhere at once.
#pragma once

#include <kvc/core/extents.hpp>

#include <array>
#include <cstddef>
#include <limits>
#include <string_view>
#include <tuple>
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

namespace detail {

/// The struct a chain of member pointers ends in: Owner, then the type of each member in turn.
template <class M>
struct member_type;
template <class M, class C>
struct member_type<M C::*> {
  using type = M;
};
template <class Owner, class... Via>
struct holder {
  using type = Owner;
};
template <class Owner, class First, class... Rest>
struct holder<Owner, First, Rest...> : holder<typename member_type<First>::type, Rest...> {};

}  // namespace detail

/// A parameter of policy `Owner`: the member it sets, its name, one line of documentation, and its values: numbers
/// in [lo, hi] (inclusive; integer members take whole numbers only, odd ones only when `odd`), enums and bools one
/// of `names` (N of them). `Via`: the member pointers from Owner to the struct that holds `member` (a nested
/// parameter, nested()), outermost first; none for a member of Owner itself.
template <class Owner, class T, std::size_t N = 0, class... Via>
struct Param {
  using owner_type = Owner;
  using value_type = T;
  using holder_type = typename detail::holder<Owner, Via...>::type;
  using member_pointer = T holder_type::*;  // (a named type: GCC 12 warns on a bare `T Owner::*member;` member)

  std::string_view name;
  member_pointer member;
  std::string_view doc;
  double lo = -std::numeric_limits<double>::infinity();
  double hi = std::numeric_limits<double>::infinity();
  std::array<Named<T>, N> names{};
  bool odd = false;          ///< integers: odd values only (a centred pooling kernel)
  std::tuple<Via...> via{};  ///< the path from Owner to the holder of `member`

  /// The parameter's member in `o` (an Owner or a struct derived from it, const or not).
  template <class O>
  requires std::is_base_of_v<Owner, std::remove_const_t<O>>
  constexpr auto& of(O& o) const noexcept {
    return std::apply(
        [&](auto... step) -> auto& { return (o.*....*step).*member; }, via);
  }
};

/// A number parameter (integer or floating point) in [lo, hi].
template <class Owner, class T>
requires(std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) constexpr Param<Owner, T> number_param(
    std::string_view name, T Owner::*member, double lo, double hi, std::string_view doc) noexcept {
  return {name, member, doc, lo, hi, {}};
}

/// An odd integer parameter in [lo, hi] (a centred pooling kernel: an even one shifts what it pools).
template <class Owner, class T>
requires std::is_integral_v<T>
constexpr Param<Owner, T> odd_param(std::string_view name, T Owner::*member, double lo, double hi,
                                    std::string_view doc) noexcept {
  return {name, member, doc, lo, hi, {}, true};
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

/// Parameter `p` of the struct held in member `inner` of `Outer`, as a parameter of Outer (same name, doc and
/// values): how a composite policy declares the members of the library objects it owns.
template <class Outer, class Inner, class T, std::size_t N, class... Via>
constexpr Param<Outer, T, N, Inner Outer::*, Via...> nested(Inner Outer::*inner,
                                                            Param<Inner, T, N, Via...> const& p) noexcept {
  return {p.name, p.member, p.doc, p.lo, p.hi, p.names, p.odd, std::tuple_cat(std::tuple{inner}, p.via)};
}

/// Whether policy P declares its parameters.
template <class P>
concept DeclaresParameters = requires {
  P::parameters();
};

}  // namespace kvc
