// SPDX-License-Identifier: Apache-2.0
// tests/core/params_test.cpp mirrors include/kvc/core/params.hpp: every policy's declared parameters are well formed
// (unique names, documented, defaults inside their own range or names, kvpress presets too), and the declarations
// point at the members they name (a hand-made struct, hand-checked values), also through nested members (the
// composite policies' descriptors), and the tools parse NAME=VALUE into the right member or refuse it, naming it.
#include <kvc/calibration/matrix_entropy.hpp>
#include <kvc/calibration/uncomp_policy.hpp>
#include <kvc/core/params.hpp>
#include <kvc/engine/moment_kv_policy.hpp>
#include <kvc/pipeline/packed_press.hpp>
#include <kvc/pipeline/rdkv_policy.hpp>
#include <kvc/scorers/expected_attention.hpp>
#include <kvc/scorers/h2o.hpp>
#include <kvc/scorers/key_diff.hpp>
#include <kvc/scorers/knorm.hpp>
#include <kvc/scorers/random.hpp>
#include <kvc/scorers/snap_kv.hpp>
#include <kvc/scorers/streaming_llm.hpp>
#include <kvc/scorers/tova.hpp>
#include <kvc/selectors/ada_kv.hpp>
#include <kvc/selectors/pyramid_kv.hpp>

#include "common/policies.hpp"
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
  if constexpr (0 < std::tuple_size_v<decltype(p.names)>) {
    for (auto const& n : p.names)
      if (n.value == v)
        return true;
    return false;
  } else {
    if constexpr (std::is_integral_v<T>)
      if (p.odd && v % 2 == 0)
        return false;
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
          CHECK(accepts(param, param.of(defaults)));
          if constexpr (requires { S::kvpress(); }) {
            S const kvpress = S::kvpress();
            CHECK(accepts(param, param.of(kvpress)));
          }
          if constexpr (requires { S::authors(); }) {
            S const authors = S::authors();
            CHECK(accepts(param, param.of(authors)));
            CHECK(authors.check().ok());
          }
        };
        (one(p), ...);
      },
      S::parameters());
  CHECK(!names.empty());
  if constexpr (requires { defaults.check(); })
    CHECK(defaults.check().ok());
}

enum class Mode : unsigned char { fast, exact };

struct Inner {
  long kernel = 3;
};
struct Middle {
  Inner inner;
  double share = 0.5;
};
/// A composite: its own member, and members of the structs it owns, declared as its own.
struct Outer {
  Middle middle;
  int own = 1;
  static constexpr auto parameters() noexcept {
    return std::tuple{kvc::nested(&Outer::middle, kvc::nested(&Middle::inner, kvc::odd_param("kernel", &Inner::kernel,
                                                                                             1, 9, "odd kernel"))),
                      kvc::nested(&Outer::middle, kvc::number_param("share", &Middle::share, 0, 1, "a fraction")),
                      kvc::number_param("own", &Outer::own, 0, 4, "its own")};
  }
};

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
  check_declarations<kvc::H2OPolicy>("kvc::H2OPolicy");
  check_declarations<kvc::MomentKVPolicy>("kvc::MomentKVPolicy");
  check_declarations<kvc::RDKVPolicy>("kvc::RDKVPolicy");
  check_declarations<kvc::KIVIPress>("kvc::KIVIPress");
  check_declarations<kvc::UNCompPolicy>("kvc::UNCompPolicy");
  check_declarations<kvc::MatrixEntropyOptions>("kvc::MatrixEntropyOptions");
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

TEST_CASE("params: a nested declaration reaches the member of the struct a policy owns") {
  constexpr auto p = Outer::parameters();
  static_assert(std::get<0>(p).odd && !std::get<1>(p).odd);
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(std::get<0>(p))>::holder_type, Inner>);
  Outer o;
  std::get<0>(p).of(o) = 7;
  std::get<1>(p).of(o) = 0.75;
  std::get<2>(p).of(o) = 4;
  CHECK(o.middle.inner.kernel == 7);
  CHECK(o.middle.share == 0.75);
  CHECK(o.own == 4);
  Outer const c{};
  CHECK(std::get<0>(p).of(c) == 3);  // const access reads the same member
  // The library's composites: names reach the members kvpress and the papers name.
  kvc::MomentKVPolicy m;
  std::get<0>(kvc::MomentKVPolicy::parameters()).of(m) = 16;
  CHECK(m.scorer.base.window_size == 16);
  kvc::RDKVPolicy r;
  std::get<1>(kvc::RDKVPolicy::parameters()).of(r) = 0.25;
  CHECK(r.press.allocator.k_budget_ratio == 0.25);
}

TEST_CASE("params: the tools parse NAME=VALUE into nested members and refuse bad values by name") {
  using kvc::tools::Failure;
  using kvc::tools::from_params;
  using kvc::tools::Params;
  auto const o = from_params<Outer>(Params{{"kernel", "5"}, {"share", "0.125"}, {"own", "2"}}, "outer");
  CHECK(o.middle.inner.kernel == 5);
  CHECK(o.middle.share == 0.125);
  CHECK(o.own == 2);
  auto refused = [](Params const& p) -> std::string {
    try {
      from_params<Outer>(p, "outer");
    } catch (Failure const& f) {
      CHECK(f.code == kvc::tools::exit_invalid);
      return f.message;
    }
    return "accepted";
  };
  CHECK(refused({{"kernel", "4"}}) ==
        "--param kernel = 4: expected an odd integer (an even kernel shifts what it pools)");
  CHECK(refused({{"kernel", "11"}}) == "--param kernel = 11: expected an odd integer in [1, 9]");
  CHECK(refused({{"share", "2"}}) == "--param share = '2': expected a number in [0, 1]");
  // The composites, through their declarations: nested members set, presets applied, check() once.
  auto const m = from_params<kvc::MomentKVPolicy>({{"window_size", "8"},
                                                   {"kernel_size", "7"},
                                                   {"pooling", "max"},
                                                   {"clamp_tau", "0"},
                                                   {"mi", "false"},
                                                   {"order", "zeroth"},
                                                   {"storage", "bf16"},
                                                   {"n_recent", "8"}});
  CHECK(m.scorer.base.window_size == 8);
  CHECK(m.scorer.base.kernel_size == 7);
  CHECK(m.scorer.base.pooling == kvc::Pooling::max);
  CHECK(m.scorer.clamp_tau == 0.0f);
  CHECK(!m.scorer.mi);
  CHECK(m.attention().order == kvc::MomentOrder::zeroth);
  CHECK(m.attention().clamp_tau == 0.0f);
  CHECK(m.storage == kvc::MomentStorage::bf16);
  CHECK(m.n_recent == 8);
  try {
    from_params<kvc::MomentKVPolicy>({{"pooling", "max"}});  // kernel_size 4
    FAIL("an even kernel under max pooling was accepted");
  } catch (Failure const& f) {
    CHECK(f.message == "policy moment_kv: MomentKVPolicy: pooling=max needs an odd kernel_size (chunk_mean takes any)");
  }
  auto const r = from_params<kvc::RDKVPolicy>({{"reference", "authors"},
                                               {"eps", "default"},
                                               {"evict", "false"},
                                               {"window_size", "16"},
                                               {"v_group", "32"},
                                               {"residual", "4"}});
  kvc::RDKVPress<> const press = r.resolved();
  CHECK(press.scorer.window_size == 16);
  CHECK(press.channels.window_size == 16);  // one window for the token and channel weights
  CHECK(press.pack.clamp_k16_to_8);         // reference=authors
  CHECK(press.pack.v_group == 32);
  CHECK(!press.allocator.options.evict);
  CHECK(press.allocator.residual == 4);
  CHECK(press.allocator.eps_k.eps[1] == kvc::EpsilonTable::default_k().eps[1]);
  CHECK_THROWS_AS(from_params<kvc::RDKVPolicy>({{"k_budget_ratio", "1"}}), Failure);  // (0, 1), ends excluded
  CHECK_THROWS_AS(from_params<kvc::RDKVPolicy>({{"kernel_size", "4"}}), Failure);
  CHECK_THROWS_AS(from_params<kvc::KIVIPress>({{"bits", "3"}}), Failure);
  CHECK_THROWS_AS(from_params<kvc::KIVIPress>({{"group", "0"}}), Failure);
  auto const u = from_params<kvc::UNCompPolicy>(
      {{"window_size", "4"}, {"schedule", "paper"}, {"largest", "30"}, {"gqa", "expand"}, {"pooling", "avg"}});
  CHECK(u.scorer.window_size == 4);
  CHECK(u.scorer.pooling == kvc::Pooling::avg);
  CHECK(u.budgets.schedule == kvc::BudgetSchedule::paper);
  CHECK(u.budgets.largest == 30);
  CHECK(u.gqa == kvc::UNCompGqa::expand);
  auto const h = from_params<kvc::H2OPolicy>({{"reference", "kvpress"}, {"recent_share", "0.25"}});
  CHECK(h.reference == kvc::Reference::kvpress);
  CHECK(h.recent_share == 0.25);
}

TEST_CASE("params: the composite policies' table rows come from their declarations, with their presets") {
  auto row = [](std::vector<kvc::tools::ParamInfo> const& rows, std::string_view name) {
    for (auto const& r : rows)
      if (name == r.name)
        return r;
    FAIL("no row " << name);
    return rows.front();
  };
  auto const h2o = kvc::tools::declared_params<kvc::H2OPolicy>(kvc::tools::Stage::scorer,
                                                               {{"recent_share", kvc::tools::Stage::selection}});
  CHECK(std::string(row(h2o, "recent_share").default_value) == "0.5");
  CHECK(std::string(row(h2o, "recent_share").kvpress_default) == "0");
  CHECK(row(h2o, "recent_share").stage == kvc::tools::Stage::selection);
  CHECK(row(h2o, "reference").stage == kvc::tools::Stage::scorer);
  auto const rdkv = kvc::tools::declared_params<kvc::RDKVPolicy>(kvc::tools::Stage::allocation);
  CHECK(std::string(row(rdkv, "solver").authors_default) == "lagrangian");
  CHECK(std::string(row(rdkv, "zero_point").authors_default) == "integer");
  CHECK(row(rdkv, "eps").authors_default == nullptr);
  CHECK(std::string(row(rdkv, "reference").default_value) == "default");
  auto const moment = kvc::tools::declared_params<kvc::MomentKVPolicy>();
  CHECK(std::string(row(moment, "clamp_tau").default_value) == "1e-6");  // as typed, not to_chars' "1e-06"
  CHECK(std::string(row(moment, "pooling").default_value) == "chunk_mean");
  CHECK(std::string(row(moment, "n_sink").default_value) == "1");
  // What `kvc policies` lists: the declared rows of each composite policy, the tools' own in between.
  auto const& kivi = kvc::tools::find_policy("kivi");
  CHECK(kivi.params.size() == 3);
  CHECK(std::string(row(kivi.params, "residual").default_value) == "128");
  auto const& uncomp = kvc::tools::find_policy("uncomp");
  CHECK(std::string(uncomp.params[5].name) == "largest");  // the table's order kept
  CHECK(std::string(row(uncomp.params, "gqa").default_value) == "kv_heads");
}
