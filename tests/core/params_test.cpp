// SPDX-License-Identifier: Apache-2.0
// tests/core/params_test.cpp mirrors include/kvc/core/params.hpp: every policy's declared parameters are well formed
// (unique names, documented, defaults inside their own range or names, kvpress presets too), and the declarations
// point at the members they name (a hand-made struct, hand-checked values).
#include <kvc/core/params.hpp>
#include <kvc/scorers/expected_attention.hpp>
#include <kvc/scorers/key_diff.hpp>
#include <kvc/scorers/knorm.hpp>
#include <kvc/scorers/random.hpp>
#include <kvc/scorers/snap_kv.hpp>
#include <kvc/scorers/streaming_llm.hpp>
#include <kvc/scorers/tova.hpp>
#include <kvc/selectors/ada_kv.hpp>
#include <kvc/selectors/pyramid_kv.hpp>

#include "support/catch.hpp"

#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>

namespace {

/// Whether value v of parameter p is one it accepts.
template <class P, class T>
bool accepts(P const& p, T v) {
  if constexpr (std::tuple_size_v < decltype(p.names) >> 0) {
    for (auto const& n : p.names)
      if (n.value == v)
        return true;
    return false;
  } else {
    return static_cast<double>(v) >= p.lo && static_cast<double>(v) <= p.hi;
  }
}

template <kvc::DeclaresParameters S>
void check_declarations(char const* label) {
  INFO(label);
  S const defaults{};
  std::set<std::string_view> names;
  std::apply(
      [&](auto const&... p) {
        auto one = [&](auto const& param) {
          INFO(param.name);
          CHECK(names.insert(param.name).second);
          CHECK(!param.doc.empty());
          CHECK(param.lo <= param.hi);
          CHECK(accepts(param, defaults.*param.member));
          if constexpr (requires { S::kvpress(); })
            CHECK(accepts(param, S::kvpress().*param.member));
        };
        (one(p), ...);
      },
      S::parameters());
  CHECK(!names.empty());
  if constexpr (requires { defaults.check(); })
    CHECK(defaults.check().ok());
}

enum class Mode : unsigned char { fast, exact };

struct Toy {
  int count = 3;
  double share = 0.25;
  Mode mode = Mode::exact;
  bool on = false;
  static constexpr auto parameters() noexcept {
    return std::tuple{kvc::number_param("count", &Toy::count, 1, 8, "how many"),
                      kvc::number_param("share", &Toy::share, 0, 1, "a fraction"),
                      kvc::named_param("mode", &Toy::mode, {{"fast", Mode::fast}, {"exact", Mode::exact}}, "which"),
                      kvc::flag_param("on", &Toy::on, "whether")};
  }
};

}  // namespace

TEST_CASE("params: every declaring policy's parameters are unique, documented and hold their defaults") {
  check_declarations<kvc::StreamingLLMScorer>("kvc::StreamingLLMScorer");
  check_declarations<kvc::KeyDiffScorer>("kvc::KeyDiffScorer");
  check_declarations<kvc::SnapKVScorer>("kvc::SnapKVScorer");
  check_declarations<kvc::TOVAScorer>("kvc::TOVAScorer");
  check_declarations<kvc::ExpectedAttentionScorer>("kvc::ExpectedAttentionScorer");
  check_declarations<kvc::RandomScorer>("kvc::RandomScorer");
  check_declarations<kvc::AdaKVSelector<kvc::FixedBudget>>("kvc::AdaKVSelector<kvc::FixedBudget>");
  check_declarations<kvc::PyramidKVBudget>("kvc::PyramidKVBudget");
}

TEST_CASE("params: a declaration names its member, range and spellings (hand-made struct)") {
  constexpr auto p = Toy::parameters();
  static_assert(kvc::DeclaresParameters<Toy>);
  static_assert(!kvc::DeclaresParameters<kvc::KnormScorer>);  // no parameter to declare
  Toy t;
  t.*std::get<0>(p).member = 5;
  t.*std::get<1>(p).member = 0.5;
  t.*std::get<2>(p).member = std::get<2>(p).names[0].value;
  t.*std::get<3>(p).member = std::get<3>(p).names[0].value;
  CHECK(t.count == 5);
  CHECK(t.share == 0.5);
  CHECK(t.mode == Mode::fast);
  CHECK(t.on);
  CHECK(std::get<0>(p).lo == 1);
  CHECK(std::get<0>(p).hi == 8);
  CHECK(std::get<2>(p).names[1].name == "exact");
  CHECK(std::get<3>(p).names[1].name == "false");
  CHECK(!accepts(std::get<0>(p), 9));
  CHECK(!accepts(std::get<1>(p), -0.1));
  CHECK(accepts(std::get<2>(p), Mode::exact));
  // The shared spelling of Reference, and SnapKV's kvpress preset through its declarations.
  CHECK(kvc::reference_names[1].name == "kvpress");
  CHECK(kvc::SnapKVScorer::kvpress().*std::get<1>(kvc::SnapKVScorer::parameters()).member == 64);
}
