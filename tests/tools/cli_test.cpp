// SPDX-License-Identifier: Apache-2.0
// tests/tools/cli_test.cpp: the `kvc` command-line contract (DESIGN.md §6): exit codes 0/2/3, messages that name
// the file, the field and what was expected, and outputs with the documented shapes.
#include <kvc/io/npy.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <sys/wait.h>
#include <vector>

#ifndef KVC_CLI
#  define KVC_CLI "kvc"
#  define KVC_CLI_WORK "/tmp/kvc_cli_work"
#endif

using kvc::Index;

namespace {

struct Result {
  int code;
  std::string output;
};

Result run(std::string const& args) {
  std::string const cmd = std::string(KVC_CLI) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, p))
    out += buf;
  int const status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

std::string work(std::string const& name) {
  std::filesystem::create_directories(KVC_CLI_WORK);
  return std::string(KVC_CLI_WORK) + "/" + name;
}

std::string write_file(std::string const& name, std::vector<std::byte> const& bytes) {
  std::string const path = work(name);
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<char const*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  return path;
}

template <class T>
std::string write_npy(std::string const& name, kvc::NpyDtype dtype, std::vector<Index> shape,
                      std::vector<T> const& data) {
  return write_file(name, kvc::serialize_npy(dtype, shape, data.data()));
}

std::vector<float> randoms(std::size_t n) {
  kvc::tools::Rng rng(1);
  std::vector<float> v(n);
  for (float& x : v)
    x = rng.normal();
  return v;
}

}  // namespace

TEST_CASE("cli: policies lists every policy with parameters and defaults", "[tools][cli]") {
  auto const r = run("policies");
  CHECK(r.code == 0);
  for (char const* s : {"streaming_llm", "key_diff", "knorm", "n_sink=4", "anchor=normalized_mean"})
    CHECK(r.output.find(s) != std::string::npos);
}

TEST_CASE("cli: score and compress write the documented shapes; --time prints one JSON line", "[tools][cli]") {
  auto const k = write_npy("k.npy", kvc::NpyDtype::f32, {1, 2, 10, 4}, randoms(80));
  auto const v = write_npy("v.npy", kvc::NpyDtype::f32, {1, 2, 10, 4}, randoms(80));
  auto const r = run("score --policy key_diff --keys " + k + " --out " + work("s.npy") + " --time");
  REQUIRE(r.code == 0);
  CHECK(r.output.find("{\"command\": \"score\", \"policy\": \"key_diff\", \"seconds\": ") != std::string::npos);
  CHECK(r.output.find("\"bytes_read\": 320}") != std::string::npos);
  kvc::NpyArray a;
  std::string error;
  REQUIRE(kvc::read_npy(work("s.npy"), a, error));
  CHECK(a.shape == std::vector<Index>{1, 2, 10});
  auto const c = run("compress --policy streaming_llm --param n_sink=2 --budget 6 --keys " + k + " --values " + v +
                     " --out-dir " + work("out"));
  REQUIRE(c.code == 0);
  REQUIRE(kvc::read_npy(work("out/indices.npy"), a, error));
  CHECK(a.shape == std::vector<Index>{1, 2, 6});
  CHECK(std::vector<std::int64_t>(a.as<std::int64_t>(), a.as<std::int64_t>() + 6) ==
        std::vector<std::int64_t>{0, 1, 6, 7, 8, 9});
  REQUIRE(kvc::read_npy(work("out/keys.npy"), a, error));
  CHECK(a.shape == std::vector<Index>{1, 2, 6, 4});
  REQUIRE(kvc::read_npy(work("out/counts.npy"), a, error));
  CHECK(a.as<std::int64_t>()[1] == 6);
  // float16 input stays float16 on output.
  std::vector<kvc::half> h16;
  for (float x : randoms(80))
    h16.emplace_back(x);
  auto const k16 = write_npy("k16.npy", kvc::NpyDtype::f16, {1, 2, 10, 4}, h16);
  REQUIRE(run("compress --policy knorm --ratio 0.5 --keys " + k16 + " --values " + k16 + " --out-dir " + work("o16"))
              .code == 0);
  REQUIRE(kvc::read_npy(work("o16/keys.npy"), a, error));
  CHECK(a.dtype == kvc::NpyDtype::f16);
  CHECK(a.shape == std::vector<Index>{1, 2, 5, 4});
}

TEST_CASE("cli: usage errors exit 2", "[tools][cli]") {
  CHECK(run("").code == 2);
  CHECK(run("frobnicate").code == 2);
  CHECK(run("score --policy key_diff").code == 2);
  auto const k = write_npy("k2.npy", kvc::NpyDtype::f32, {1, 1, 4, 2}, randoms(8));
  auto r = run("score --policy nope --keys " + k + " --out " + work("x.npy"));
  CHECK(r.code == 2);
  CHECK(r.output.find("unknown --policy 'nope'") != std::string::npos);
  r = run("score --policy key_diff --param foo=1 --keys " + k + " --out " + work("x.npy"));
  CHECK(r.code == 2);
  CHECK(run("compress --policy knorm --keys " + k + " --values " + k + " --out-dir " + work("d")).code ==
        2);  // no budget
  CHECK(run("compress --policy knorm --ratio 0.5 --budget 2 --keys " + k + " --values " + k + " --out-dir " + work("d"))
            .code == 2);
  CHECK(run("score --policy knorm --keys").code == 2);
}

TEST_CASE("cli: invalid input exits 3 and names the file, the field and what was expected", "[tools][cli]") {
  auto expect3 = [](std::string const& args, std::string const& needle) {
    auto const r = run(args);
    INFO(args << "\n" << r.output);
    CHECK(r.code == 3);
    CHECK(r.output.find(needle) != std::string::npos);
  };
  std::string const out = " --out " + work("bad.npy");
  auto const good = write_npy("good.npy", kvc::NpyDtype::f32, {1, 1, 4, 2}, randoms(8));
  auto const text = write_file("text.npy", {std::byte{'h'}, std::byte{'i'}});
  expect3("score --policy knorm --keys " + text + out, "text.npy: not a .npy file");
  auto full = kvc::serialize_npy(kvc::NpyDtype::f32, std::vector<Index>{1, 1, 4, 2}, randoms(8).data());
  full.resize(full.size() - 5);
  expect3("score --policy knorm --keys " + write_file("trunc.npy", full) + out, "truncated data");
  auto fortran = kvc::serialize_npy(kvc::NpyDtype::f32, std::vector<Index>{1, 1, 4, 2}, randoms(8).data());
  std::string const hdr(reinterpret_cast<char const*>(fortran.data()), 64);
  auto const pos = hdr.find("False");
  std::memcpy(fortran.data() + pos, "True ", 5);
  expect3("score --policy knorm --keys " + write_file("fortran.npy", fortran) + out, "Fortran order");
  std::vector<std::int64_t> ints(8, 1);
  expect3("score --policy knorm --keys " + write_npy("ints.npy", kvc::NpyDtype::i64, {1, 1, 4, 2}, ints) + out,
          "expected '<f4' (float32) or '<f2' (float16)");
  expect3("score --policy knorm --keys " + write_npy("3d.npy", kvc::NpyDtype::f32, {1, 4, 2}, randoms(8)) + out,
          "expected 4 ([batch, kv_heads, tokens, head_dim])");
  auto nan = randoms(8);
  nan[3] = std::numeric_limits<float>::quiet_NaN();
  expect3("score --policy knorm --keys " + write_npy("nan.npy", kvc::NpyDtype::f32, {1, 1, 4, 2}, nan) + out,
          "NaN or Inf");
  auto const other = write_npy("other.npy", kvc::NpyDtype::f32, {1, 1, 3, 2}, randoms(6));
  expect3("compress --policy knorm --ratio 0.5 --keys " + good + " --values " + other + " --out-dir " + work("d"),
          "must equal the keys'");
  expect3("compress --policy knorm --ratio 1.5 --keys " + good + " --values " + good + " --out-dir " + work("d"),
          "--ratio 1.5: expected a number in [0, 1]");
  expect3("compress --policy knorm --budget -3 --keys " + good + " --values " + good + " --out-dir " + work("d"),
          "expected an integer >= 0");
  expect3("compress --policy key_diff --param anchor=median --ratio 0.5 --keys " + good + " --values " + good +
              " --out-dir " + work("d"),
          "expected normalized_mean or raw_mean");
  expect3("score --policy knorm --keys " + work("missing.npy") + out, "cannot open");
  // Headers that claim enormous shapes are rejected before any allocation.
  auto header_only = [](std::string h) {
    h.append(64 - 10 - h.size() % 64 - 1 + 64, ' ');
    h += '\n';
    std::string f =
        std::string("\x93NUMPY\x01\x00", 8) + static_cast<char>(h.size() & 0xff) + static_cast<char>(h.size() >> 8) + h;
    std::vector<std::byte> b(f.size());
    std::memcpy(b.data(), f.data(), f.size());
    return b;
  };
  expect3(
      "score --policy knorm --keys " +
          write_file("huge.npy",
                     header_only("{'descr': '<f4', 'fortran_order': False, 'shape': (100000000000, 100000, 1, 1), }")) +
          out,
      "truncated data: shape needs 40000000000000000 bytes");
  expect3("score --policy knorm --keys " +
              write_file(
                  "overflow.npy",
                  header_only("{'descr': '<f4', 'fortran_order': False, 'shape': (100000000000000, 100000, 1, 1), }")) +
              out,
          "overflows 64 bits");
}
