// SPDX-License-Identifier: Apache-2.0
// tests/io/npy_test.cpp mirrors include/kvc/io/npy.hpp: round trips, every malformed-file class, and a
// deterministic mutation fuzz loop (run under ASan/UBSan in CI; tools/fuzz has the libFuzzer harness).
#include <kvc/io/npy.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"

#include <cstring>
#include <string>
#include <vector>

using kvc::Index;

namespace {

std::vector<std::byte> bytes_of(std::string const& s) {
  std::vector<std::byte> b(s.size());
  std::memcpy(b.data(), s.data(), s.size());
  return b;
}

/// A v1.0 file with a hand-written header (not produced by serialize_npy, so the parser is tested independently).
std::vector<std::byte> handmade(std::string header, std::size_t data_bytes) {
  std::string f = std::string("\x93NUMPY\x01\x00", 8);
  f += static_cast<char>(header.size() & 0xff);
  f += static_cast<char>(header.size() >> 8);
  f += header;
  f += std::string(data_bytes, '\0');
  return bytes_of(f);
}

std::string parse_error(std::vector<std::byte> const& b) {
  kvc::NpyArray a;
  std::string error;
  return kvc::parse_npy(b, a, error) ? std::string("ok") : error;
}

}  // namespace

TEST_CASE("npy: hand-written headers parse (numpy's own spellings)", "[io][npy]") {
  kvc::NpyArray a;
  std::string error;
  REQUIRE(kvc::parse_npy(handmade("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }     \n", 24), a, error));
  CHECK(a.dtype == kvc::NpyDtype::f32);
  CHECK(a.shape == std::vector<Index>{2, 3});
  REQUIRE(kvc::parse_npy(handmade("{\"shape\": (5,), \"fortran_order\": False, \"descr\": \"<f2\"}\n", 10), a, error));
  CHECK(a.shape == std::vector<Index>{5});
  REQUIRE(kvc::parse_npy(handmade("{'descr': '<i8', 'fortran_order': False, 'shape': ()}\n", 8), a, error));
  CHECK(a.shape.empty());
  CHECK(a.size() == 1);
}

TEST_CASE("npy: serialize then parse round-trips every dtype", "[io][npy]") {
  std::vector<float> f = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f, 8.0f};
  std::vector<Index> shape = {1, 2, 3};
  kvc::NpyArray a;
  std::string error;
  REQUIRE(kvc::parse_npy(kvc::serialize_npy(kvc::NpyDtype::f32, shape, f.data()), a, error));
  CHECK(a.shape == shape);
  CHECK(std::memcmp(a.data.data(), f.data(), 24) == 0);
  std::vector<Index> ints = {-1, 5};
  std::vector<Index> s1 = {2};
  REQUIRE(kvc::parse_npy(kvc::serialize_npy(kvc::NpyDtype::i64, s1, ints.data()), a, error));
  CHECK(a.as<std::int64_t>()[0] == -1);
  auto const bytes = kvc::serialize_npy(kvc::NpyDtype::f16, s1, ints.data());
  CHECK((bytes.size() - 4) % 64 == 0);  // header padded to 64 bytes
}

TEST_CASE("npy: malformed files give errors that name the problem", "[io][npy]") {
  CHECK(parse_error(bytes_of("PK\x03\x04 not numpy")).find("magic") != std::string::npos);
  CHECK(parse_error(bytes_of(std::string("\x93NUMPY\x09\x00\x10\x00", 10))).find("version") != std::string::npos);
  CHECK(parse_error(bytes_of(std::string("\x93NUMPY\x01\x00\xff\x00{}", 12))).find("truncated header") !=
        std::string::npos);
  auto const fortran = handmade("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }\n", 16);
  CHECK(parse_error(fortran).find("Fortran") != std::string::npos);
  auto const c8 = handmade("{'descr': '<c8', 'fortran_order': False, 'shape': (2,), }\n", 16);
  CHECK(parse_error(c8).find("unsupported dtype '<c8'") != std::string::npos);
  auto const big_endian = handmade("{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }\n", 8);
  CHECK(parse_error(big_endian).find("unsupported dtype") != std::string::npos);
  auto const truncated = handmade("{'descr': '<f4', 'fortran_order': False, 'shape': (4, 4), }\n", 60);
  CHECK(parse_error(truncated).find("truncated data") != std::string::npos);
  auto const trailing = handmade("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }\n", 8);
  CHECK(parse_error(trailing).find("after the data") != std::string::npos);
  auto const overflow =
      handmade("{'descr': '<f4', 'fortran_order': False, 'shape': (999999999999, 999999999999), }\n", 0);
  CHECK(parse_error(overflow).find("overflows") != std::string::npos);
  auto const negative = handmade("{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }\n", 0);
  CHECK(parse_error(negative).find("shape") != std::string::npos);
  auto const missing = handmade("{'descr': '<f4', 'shape': (1,), }\n", 4);
  CHECK(parse_error(missing).find("lacks") != std::string::npos);
  auto const unknown = handmade("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'x': 1}\n", 4);
  CHECK(parse_error(unknown).find("unexpected header key") != std::string::npos);
  auto const unterminated = handmade("{'descr': '<f4", 0);
  CHECK(parse_error(unterminated) != "ok");
}

TEST_CASE("npy: reading a missing file is an error, not a crash", "[io][npy]") {
  kvc::NpyArray a;
  std::string error;
  CHECK_FALSE(kvc::read_npy("/nonexistent/kvc/file.npy", a, error));
  CHECK(error.find("cannot open") != std::string::npos);
}

TEST_CASE("npy: mutation fuzzing never crashes and accepts only consistent files", "[io][npy][fuzz]") {
  std::vector<float> f(24, 1.0f);
  std::vector<Index> shape = {2, 3, 4};
  auto const seed_file = kvc::serialize_npy(kvc::NpyDtype::f32, shape, f.data());
  kvc::tools::Rng rng(2024);
  int accepted = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    auto b = seed_file;
    int const edits = 1 + static_cast<int>(rng.next() % 4);
    for (int e = 0; e < edits; ++e) {
      switch (rng.next() % 4) {
        case 0: b[rng.next() % b.size()] = static_cast<std::byte>(rng.next()); break;  // flip a byte
        case 1: b.resize(rng.next() % (b.size() + 1)); break;                          // truncate
        case 2:
          b.insert(b.begin() + static_cast<std::ptrdiff_t>(rng.next() % (b.size() + 1)),
                   static_cast<std::byte>(rng.next()));
          break;
        default:  // poke a header character
          if (b.size() > 20)
            b[10 + rng.next() % std::min<std::size_t>(b.size() - 10, 60)] =
                static_cast<std::byte>("(),:'0123456789 {}"[rng.next() % 18]);
      }
      if (b.empty())
        break;
    }
    kvc::NpyArray a;
    std::string error;
    if (kvc::parse_npy(b, a, error)) {
      ++accepted;
      REQUIRE(static_cast<Index>(a.data.size()) == a.size() * kvc::npy_itemsize(a.dtype));
    } else {
      REQUIRE_FALSE(error.empty());
    }
  }
  CHECK(accepted > 0);  // some mutations (e.g. in the data) keep the file valid
}
