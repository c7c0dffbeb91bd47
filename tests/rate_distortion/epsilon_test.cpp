// SPDX-License-Identifier: Apache-2.0
// tests/rate_distortion/epsilon_test.cpp mirrors include/kvc/rate_distortion/epsilon.hpp: the eps(b) tables of
// spec rdkv.md §2.4 (values copied from the spec's table), their validation and the lower convex hull (P11's
// first half). Hull membership is worked out by hand in the comments.
#include <kvc/rate_distortion/epsilon.hpp>

#include "support/catch.hpp"

#include <limits>
#include <string>

namespace {

using kvc::EpsilonTable;

bool names(kvc::Status const& st, char const* what) {
  return std::string(st.message()).find(what) != std::string::npos;
}

std::string hull_string(EpsilonTable const& t) {
  bool on[kvc::kBitOptions] = {};
  t.hull(on);
  std::string s;
  for (bool b : on)
    s += b ? '1' : '0';
  return s;
}

}  // namespace

TEST_CASE("bit options are 0 2 4 8 16 in this order") {
  REQUIRE(kvc::kBitOptions == 5);
  CHECK(kvc::kBits[0] == 0);
  CHECK(kvc::kBits[1] == 2);
  CHECK(kvc::kBits[2] == 4);
  CHECK(kvc::kBits[3] == 8);
  CHECK(kvc::kBits[4] == 16);
  for (int i = 0; i < kvc::kBitOptions; ++i)
    CHECK(kvc::bit_option_index(kvc::kBits[i]) == i);
  for (int b : {-1, 1, 3, 6, 7, 12, 32})
    CHECK(kvc::bit_option_index(b) == -1);
  CHECK(kvc::BitOptions{}.evict);
}

TEST_CASE("built-in tables match spec section 2.4") {
  constexpr EpsilonTable v = EpsilonTable::default_v(), k = EpsilonTable::default_k();
  constexpr EpsilonTable lv = EpsilonTable::llama31_v(), lk = EpsilonTable::llama31_k();
  double const ev[] = {1, 0.312, 0.0138, 4.8e-5, 0}, ek[] = {1, 0.277, 0.011, 6.1e-5, 0};
  double const elv[] = {1, 0.31287, 0.013986, 4.8554e-5, 0}, elk[] = {1, 0.14894, 0.0062426, 2.1757e-5, 0};
  for (int i = 0; i < kvc::kBitOptions; ++i) {
    CHECK(v.eps[i] == ev[i]);
    CHECK(k.eps[i] == ek[i]);
    CHECK(lv.eps[i] == elv[i]);
    CHECK(lk.eps[i] == elk[i]);
    CHECK(EpsilonTable{}.eps[i] == ev[i]);  // the default member values are DEFAULT_EPSILON_V
  }
  static_assert(EpsilonTable::llama31_k().check().ok());
}

TEST_CASE("P11 table validation: eps(0) = 1, eps(16) = 0, strictly decreasing, finite") {
  for (EpsilonTable const& t :
       {EpsilonTable::default_v(), EpsilonTable::default_k(), EpsilonTable::llama31_v(), EpsilonTable::llama31_k()})
    CHECK(t.check().ok());
  double const nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  struct Bad {
    EpsilonTable table;
    char const* named;
  };
  Bad const bad[] = {
      {{{0.9, 0.3, 0.01, 1e-5, 0}}, "eps[0]"}, {{{1, 0.3, 0.01, 1e-5, 1e-9}}, "eps[4]"},
      {{{1, 1.0, 0.01, 1e-5, 0}}, "eps[1]"},   {{{1, nan, 0.01, 1e-5, 0}}, "eps[1]"},
      {{{1, 0.3, 0.3, 1e-5, 0}}, "eps[2]"},    {{{1, 0.3, 0.4, 1e-5, 0}}, "eps[2]"},
      {{{1, 0.3, 0.01, 0.0, 0}}, "eps[3]"},    {{{1, 0.3, 0.01, 0.02, 0}}, "eps[3]"},
      {{{1, 0.3, inf, 1e-5, 0}}, "eps[2]"},    {{{1, -0.1, 0.01, 1e-5, 0}}, "eps[1]"},
      {{{nan, 0.3, 0.01, 1e-5, 0}}, "eps[0]"},
  };
  for (Bad const& b : bad) {
    kvc::Status const st = b.table.check();
    INFO(st.message());
    CHECK(st.code() == kvc::Errc::invalid_argument);
    CHECK(names(st, b.named));
  }
}

TEST_CASE("P11 hull: every built-in table is convex, so every option is on the hull") {
  // Spec §2.4 [CHECK]: strictly decreasing and convex.
  for (EpsilonTable const& t :
       {EpsilonTable::default_v(), EpsilonTable::default_k(), EpsilonTable::llama31_v(), EpsilonTable::llama31_k()})
    CHECK(hull_string(t) == "11111");
}

TEST_CASE("P11 hull: an option above the chord of its neighbours is off the hull") {
  // 2 bits at 0.9: the chord (0, 1) -> (4, 0.01) is at 0.505 for b = 2, so 2 bits is above it.
  CHECK(hull_string({{1, 0.9, 0.01, 1e-4, 0}}) == "10111");
  // 8 bits at 0.004: chord (4, 0.01) -> (16, 0) is at 0.01 * 8/12 = 0.00667 for b = 8; 0.004 is below: on the hull.
  CHECK(hull_string({{1, 0.3, 0.01, 0.004, 0}}) == "11111");
  // 8 bits at 0.008: above 0.00667 -> off.
  CHECK(hull_string({{1, 0.3, 0.01, 0.008, 0}}) == "11101");
  // Both middle options above the chord from 0 to 16 (1 - b/16: 0.875 at 2, 0.75 at 4) while 8 bits is below it:
  // eps = {1, 0.95, 0.8, 0.1, 0}: chord 0 -> 8 is 1 - 0.9 b/8: 0.775 at 2 (0.95 above), 0.55 at 4 (0.8 above).
  CHECK(hull_string({{1, 0.95, 0.8, 0.1, 0}}) == "10011");
}

TEST_CASE("P11 hull: a point on an edge counts as on the hull") {
  // eps(b) = 1 - b/16 at b = 2, 4, 8: all on the straight line from (0, 1) to (16, 0).
  CHECK(hull_string({{1, 0.875, 0.75, 0.5, 0}}) == "11111");
}

TEST_CASE("hull without option 0 starts at 2 bits") {
  int idx[kvc::kBitOptions] = {};
  EpsilonTable const t{{1, 0.9, 0.01, 1e-4, 0}};
  // Without 0 the points are 2, 4, 8, 16 and 2 bits is their leftmost point: on the hull.
  REQUIRE(t.hull_of(1, idx) == 4);
  CHECK(idx[0] == 1);
  CHECK(idx[1] == 2);
  CHECK(idx[2] == 3);
  CHECK(idx[3] == 4);
  REQUIRE(t.hull_of(0, idx) == 4);
  CHECK(idx[0] == 0);
  CHECK(idx[1] == 2);
}
