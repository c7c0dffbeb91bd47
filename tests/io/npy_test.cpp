// SPDX-License-Identifier: Apache-2.0
// tests/io/npy_test.cpp mirrors tools/io/npy.hpp: round trips, every malformed-file class, and a
// deterministic mutation fuzz loop (run under ASan/UBSan in CI; tools/fuzz has the libFuzzer harness).

#include "io/npy.hpp"

#include "common/synthetic.hpp"
#include "support/catch.hpp"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <sys/stat.h>
#include <unistd.h>
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

TEST_CASE("npy: junk after the header dict and empty arrays declaring absurd sizes are refused", "[io][npy]") {
  auto const junk = handmade("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }junk\n", 4);
  CHECK(parse_error(junk).find("after the header dict") != std::string::npos);
  auto const second = handmade("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), } {}\n", 4);
  CHECK(parse_error(second).find("after the header dict") != std::string::npos);
  // numpy: the product of the non-zero dimensions must fit (2^57 * 2^57 does not), even when one dimension is 0.
  auto const huge_empty =
      handmade("{'descr': '<f4', 'fortran_order': False, 'shape': (0, 144115188075855872, 144115188075855872), }\n", 0);
  CHECK(parse_error(huge_empty).find("overflows") != std::string::npos);
  // 2^61 elements fit in 64 bits, but not in bytes at 4 per element (2^59 * 4 = 2^61 elements).
  auto const huge_bytes =
      handmade("{'descr': '<f4', 'fortran_order': False, 'shape': (0, 576460752303423488, 4), }\n", 0);
  CHECK(parse_error(huge_bytes).find("overflows") != std::string::npos);
  // An empty array of sane sizes is a valid (empty) file.
  auto const empty = handmade("{'descr': '<f4', 'fortran_order': False, 'shape': (0, 3), }\n", 0);
  CHECK(parse_error(empty) == "ok");
}

TEST_CASE("npy: only regular files are read, without blocking", "[io][npy]") {
  kvc::NpyArray a;
  std::string error;
  CHECK_FALSE(kvc::read_npy("/", a, error));
  CHECK(error.find("is a directory, expected a regular file") != std::string::npos);
  CHECK_FALSE(kvc::read_npy("/dev/zero", a, error));
  CHECK(error.find("character device") != std::string::npos);
  std::string const fifo = std::filesystem::temp_directory_path() / ("kvc_npy_fifo_" + std::to_string(::getpid()));
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_FALSE(kvc::read_npy(fifo, a, error));  // no writer: opened non-blocking, refused, never waits
  CHECK(error.find("FIFO") != std::string::npos);
  std::filesystem::remove(fifo);
  // A file larger than the caller's limit (a sparse file can claim more than memory holds) is refused unread.
  std::string const sparse = std::filesystem::temp_directory_path() / ("kvc_npy_sparse_" + std::to_string(::getpid()));
  { std::ofstream(sparse) << "x"; }
  std::filesystem::resize_file(sparse, std::uintmax_t{1} << 40);  // 1 TiB, no block written
  CHECK_FALSE(kvc::read_npy(sparse, a, error, std::uint64_t{1} << 30));
  CHECK(error.find("more than the reader's limit of 1073741824 bytes") != std::string::npos);
  std::filesystem::remove(sparse);
}

TEST_CASE("npy: write_npy replaces a file whole and leaves nothing behind when it cannot", "[io][npy]") {
  std::filesystem::path const dir =
      std::filesystem::temp_directory_path() / ("kvc_npy_w_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::vector<float> const f = {1, 2, 3};
  std::vector<Index> const shape = {3};
  std::string error;
  REQUIRE(kvc::write_npy((dir / "a.npy").string(), kvc::NpyDtype::f32, shape, f.data(), error));
  kvc::NpyArray a;
  REQUIRE(kvc::read_npy((dir / "a.npy").string(), a, error));
  CHECK(a.as<float>()[2] == 3.0f);
  CHECK_FALSE(kvc::write_npy((dir / "missing" / "b.npy").string(), kvc::NpyDtype::f32, shape, f.data(), error));
  CHECK(error.find("cannot create a temporary file") != std::string::npos);
  std::filesystem::create_directories(dir / "c.npy");  // a directory in the way: the rename fails, nothing is left
  CHECK_FALSE(kvc::write_npy((dir / "c.npy").string(), kvc::NpyDtype::f32, shape, f.data(), error));
  int entries = 0;
  for (auto const& e : std::filesystem::directory_iterator(dir))
    entries += e.path().filename().string().find(".kvc-") == std::string::npos ? 1 : 100;
  CHECK(entries == 2);  // a.npy and the c.npy directory, no temporary
  std::filesystem::remove_all(dir);
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
