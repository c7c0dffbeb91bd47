// SPDX-License-Identifier: Apache-2.0
// tests/tools/cli_test.cpp: the `kvc` command-line contract (DESIGN.md §6, docs/cli.md): exit codes 0/2/3,
// messages that name the file, the field and what was expected, --help, exact parameter lists, the query options of
// the window policies (SnapKV, TOVA) and of the stateful ones (ExpectedAttention, H2O), and outputs with the
// documented shapes. The scores themselves are checked against the NumPy oracle by tools/reference/check_cli.py
// (ctest kvc.tools.cli_oracle).

#include "common/synthetic.hpp"
#include "common/uncomp.hpp"
#include "eval/calibration_file.hpp"
#include "io/npy.hpp"
#include "io/safetensors.hpp"
#include "support/catch.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <sys/wait.h>
#include <unistd.h>
#include <utility>
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

/// Runs the CLI; `output` is stdout and stderr together, or stdout alone with `stdout_only`.
Result run(std::string const& args, bool stdout_only = false) {
  std::string const cmd = std::string(KVC_CLI) + " " + args + (stdout_only ? " 2>/dev/null" : " 2>&1");
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, p))
    out += buf;
  int const status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

/// `name` in this process's own work folder: ctest runs the test cases as parallel processes, and several write
/// inputs of the same name (a shared folder let one case truncate a file another case's kvc was reading). The folder
/// is removed when the process exits.
std::string work(std::string const& name) {
  static std::string const dir = [] {
    std::string d = std::string(KVC_CLI_WORK) + "/" + std::to_string(::getpid());
    std::error_code ec;
    std::filesystem::remove_all(d, ec);  // a folder left by an earlier process of the same id
    std::filesystem::create_directories(d);
    static std::string const made = d;
    std::atexit([] {
      std::error_code e;
      std::filesystem::remove_all(made, e);
    });
    return d;
  }();
  return dir + "/" + name;
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

std::vector<float> randoms(std::size_t n, std::uint64_t seed = 1) {
  kvc::tools::Rng rng(seed);
  std::vector<float> v(n);
  for (float& x : v)
    x = rng.normal();
  return v;
}

}  // namespace

TEST_CASE("cli: score and compress write the documented shapes, and --time prints one JSON line", "[tools][cli]") {
  auto const k = write_npy("k.npy", kvc::NpyDtype::f32, {1, 2, 10, 4}, randoms(80));
  auto const v = write_npy("v.npy", kvc::NpyDtype::f32, {1, 2, 10, 4}, randoms(80));
  auto const r = run("score --policy key_diff --keys " + k + " --out " + work("s.npy") + " --time");
  REQUIRE(r.code == 0);
  CHECK(r.output.find("{\"command\":\"score\",\"policy\":\"key_diff\",\"seconds\":") != std::string::npos);
  // KeyDiff's scratch at d = 4, one worker: a 32-row tile (512 B), two rows (64 B each), an fp64 row (64 B), each
  // rounded to 64 B, plus 64 B of alignment slack.
  CHECK(r.output.find("\"bytes_read\":320,\"workspace_bytes\":768,\"threads\":1,\"isa\":\"") != std::string::npos);
  {  // the instruction set kvc was compiled for: '+'-joined names of tools/common/isa.hpp, or "baseline"
    auto const at = r.output.find("\"isa\":\"");
    REQUIRE(at != std::string::npos);
    std::string const isa = r.output.substr(at + 7, r.output.find('"', at + 7) - (at + 7));
    INFO(isa);
    std::set<std::string> const known = {"avx512f", "avx512bw", "avx512vbmi", "avx512fp16", "avx2",
                                         "fma",     "f16c",     "neon",       "baseline"};
    std::istringstream names(isa);
    int count = 0;
    for (std::string name; std::getline(names, name, '+'); ++count)
      CHECK(known.count(name) == 1);
    CHECK(count >= 1);
  }
  CHECK(r.output.find("select_seconds") == std::string::npos);  // score does not select
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
  // compress --time times the compressor's prefill as one call (score, selection and compaction) and reports its
  // state: KeyDiff has none beyond the 64 B of alignment slack; --threads changes no result.
  auto const t = run("compress --policy key_diff --ratio 0.5 --keys " + k + " --values " + v + " --out-dir " +
                     work("out2") + " --time --threads 2");
  REQUIRE(t.code == 0);
  CHECK(t.output.find("{\"command\":\"compress\",\"policy\":\"key_diff\",\"seconds\":") != std::string::npos);
  CHECK(t.output.find("select_seconds") == std::string::npos);
  CHECK(t.output.find("\"state_bytes\":64,\"input_bytes\":640,") != std::string::npos);
  CHECK(t.output.find("\"threads\":2,") != std::string::npos);
  REQUIRE(run("compress --policy key_diff --ratio 0.5 --keys " + k + " --values " + v + " --out-dir " + work("out1"))
              .code == 0);
  kvc::NpyArray one, two;
  REQUIRE(kvc::read_npy(work("out1/indices.npy"), one, error));
  REQUIRE(kvc::read_npy(work("out2/indices.npy"), two, error));
  CHECK(one.data == two.data);
  CHECK(run("score --policy knorm --keys " + k + " --out " + work("s.npy") + " --threads 0").code == 3);
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

// ---------------------------------------------------------------------------------------------------------------
// Help, the policy table, parameter rejection, and the window policies' query options.

namespace {

kvc::NpyArray read(std::string const& path) {
  kvc::NpyArray a;
  std::string error;
  INFO(path << ": " << error);
  REQUIRE(kvc::read_npy(path, a, error));
  return a;
}

std::vector<float> floats(kvc::NpyArray const& a) {
  return {a.as<float>(), a.as<float>() + a.size()};
}

std::vector<std::int64_t> ints(kvc::NpyArray const& a) {
  return {a.as<std::int64_t>(), a.as<std::int64_t>() + a.size()};
}

bool contains(std::string const& text, std::string const& needle) {
  return text.find(needle) != std::string::npos;
}

/// A small GQA problem: keys/values [1, 2, 40, 4] and pre-RoPE queries [1, 4, 32, 4] (32 rows: SnapKV's default
/// window), as .npy files named after `tag` (ctest runs the test cases in parallel processes).
struct WindowFiles {
  static constexpr Index n = 40, w = 32;
  explicit WindowFiles(std::string const& name)
      : tag(name),
        keys(write_npy(name + "_k.npy", kvc::NpyDtype::f32, {1, 2, n, 4}, randoms(2 * n * 4, 2))),
        values(write_npy(name + "_v.npy", kvc::NpyDtype::f32, {1, 2, n, 4}, randoms(2 * n * 4, 3))),
        queries(write_npy(name + "_q.npy", kvc::NpyDtype::f32, {1, 4, w, 4}, randoms(4 * w * 4, 4))) {}
  std::string tag, keys, values, queries;
  /// A path for an output of this test case.
  std::string out(std::string const& name) const { return work(tag + "_" + name); }
  std::string kv() const { return " --keys " + keys + " --values " + values; }
  std::string kq() const { return " --keys " + keys + " --queries " + queries; }
};

std::vector<std::string> const all_policies = {"streaming_llm",      "key_diff", "knorm",  "snap_kv",  "tova",
                                               "expected_attention", "h2o",      "random", "moment_kv"};
std::vector<std::string> const key_only_policies = {"streaming_llm", "key_diff", "knorm", "random"};
std::vector<std::string> const query_policies = {"snap_kv", "tova", "expected_attention", "h2o", "moment_kv"};

bool reads_queries(std::string const& policy) {
  return std::find(query_policies.begin(), query_policies.end(), policy) != query_policies.end();
}

}  // namespace

namespace {

/// An int8 .npy file ('|i1', as compress --policy rdkv|kivi writes its bit plans), read independently of kvc's
/// reader (which has no int8): the header's descr and shape, then one byte per element.
struct Int8Npy {
  std::vector<Index> shape;
  std::vector<int> data;
};

Int8Npy read_int8(std::string const& path) {
  std::ifstream f(path, std::ios::binary);
  std::string const bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  REQUIRE(bytes.size() >= 10);
  REQUIRE(bytes.substr(1, 5) == "NUMPY");
  std::size_t const length =
      static_cast<unsigned char>(bytes[8]) | static_cast<std::size_t>(static_cast<unsigned char>(bytes[9])) << 8;
  std::string const header = bytes.substr(10, length);
  INFO(header);
  REQUIRE(header.find("'descr': '|i1'") != std::string::npos);
  std::size_t const open = header.find("'shape': (") + 10, close = header.find(')', open);
  Int8Npy out;
  std::stringstream dims(header.substr(open, close - open));
  for (std::string item; std::getline(dims, item, ',');)
    if (item.find_first_not_of(' ') != std::string::npos)
      out.shape.push_back(std::stoll(item));
  Index count = 1;
  for (Index s : out.shape)
    count *= s;
  REQUIRE(bytes.size() == 10 + length + static_cast<std::size_t>(count));
  for (std::size_t i = 10 + length; i < bytes.size(); ++i)
    out.data.push_back(static_cast<signed char>(bytes[i]));
  return out;
}

bool valid_bits(int b) {
  return b == 0 || b == 2 || b == 4 || b == 8 || b == 16;
}

double json_real(std::string const& line, std::string const& key) {
  std::size_t const at = line.find("\"" + key + "\":");
  REQUIRE(at != std::string::npos);
  return std::strtod(line.c_str() + at + key.size() + 3, nullptr);
}

/// The synthetic layer of the RDKV tests: K, V [1, 2, 40, 8], pre-RoPE queries [1, 4, 8, 8].
struct RDKVFiles {
  static constexpr Index heads = 2, n = 40, d = 8;
  std::string k = write_npy("rd_k.npy", kvc::NpyDtype::f32, {1, heads, n, d}, randoms(heads* n* d, 31));
  std::string v = write_npy("rd_v.npy", kvc::NpyDtype::f32, {1, heads, n, d}, randoms(heads* n* d, 32));
  std::string q = write_npy("rd_q.npy", kvc::NpyDtype::f32, {1, 4, 8, d}, randoms(4 * 8 * d, 33));
  std::string in() const { return " --keys " + k + " --values " + v + " --queries " + q + " --param window_size=8"; }
};

}  // namespace

TEST_CASE("cli: --help prints each command's usage to stdout and exits 0", "[tools][cli]") {
  auto r = run("score --help", true);
  CHECK(r.code == 0);
  for (char const* s :
       {"usage: kvc score", "--queries Q.npy", "--positions P.npy", "--rope theta=T,style=neox|interleaved",
        "--out scores.npy", "--param queries=post_rope", "snap_kv", "Exit codes"})
    CHECK(contains(r.output, s));
  CHECK(run("help score", true).output == r.output);
  CHECK(run("score --policy knorm --bogus --help", true).output == r.output);  // --help wins
  r = run("compress --help", true);
  CHECK(r.code == 0);
  for (char const* s : {"usage: kvc compress", "--ratio R", "--budget N", "--out-dir DIR", "--queries Q.npy",
                        "indices.npy", "counts.npy", "--allocator ada_kv|pyramid_kv|pyramid_kv+ada_kv", "--dump DIR",
                        "ragged_keys.npy", "offsets.npy", "padded_bytes", "Allocators: ada_kv"})
    CHECK(contains(r.output, s));
  CHECK(run("compress -h", true).output == r.output);
  for (char const* args : {"--help", "-h", "help"}) {
    r = run(args, true);
    CHECK(r.code == 0);
    for (char const* s : {"kvc score", "kvc compress", "kvc policies", "kvc COMMAND --help"})
      CHECK(contains(r.output, s));
  }
  r = run("policies --help", true);
  CHECK(r.code == 0);
  CHECK(contains(r.output, "usage: kvc policies"));
  // A usage error prints the command's synopsis (to stderr) and where the details are.
  r = run("score --bogus");
  CHECK(r.code == 2);
  CHECK(contains(r.output, "unknown argument '--bogus'"));
  CHECK(contains(r.output, "usage: kvc score"));
  CHECK(contains(r.output, "kvc score --help"));
  CHECK(run("score --bogus", true).output.empty());
}

TEST_CASE("cli: policies lists every policy with every parameter and its default, each accepted", "[tools][cli]") {
  auto const r = run("policies", true);
  REQUIRE(r.code == 0);
  // Parse "NAME  (reads ...)" and "NAME  (allocator)" headings and "    --param NAME=DEFAULT ..." lines.
  std::map<std::string, std::map<std::string, std::string>> listed, allocators;
  std::map<std::string, std::string>* current = nullptr;
  std::istringstream lines(r.output);
  for (std::string line; std::getline(lines, line);) {
    if (contains(line, "  (reads ") && line[0] != ' ') {
      current = &listed[line.substr(0, line.find(' '))];
    } else if (contains(line, "  (allocator)") && line[0] != ' ') {
      current = &allocators[line.substr(0, line.find(' '))];
    } else if (line.rfind("    --param ", 0) == 0) {
      REQUIRE(current != nullptr);
      std::string const kv = line.substr(12, line.find(' ', 12) - 12);
      (*current)[kv.substr(0, kv.find('='))] = kv.substr(kv.find('=') + 1);
    }
  }
  using M = std::map<std::string, std::string>;
  M const selection = {{"n_sink", "0"}, {"n_recent", "0"}};
  auto with_selection = [&](M m) {
    m.insert(selection.begin(), selection.end());
    return m;
  };
  std::map<std::string, M> const expected = {
      {"streaming_llm", {{"n_sink", "4"}}},
      {"key_diff", with_selection({{"anchor", "normalized_mean"}})},
      {"knorm", selection},
      {"snap_kv", with_selection({{"reference", "authors"},
                                  {"window_size", "32"},
                                  {"kernel_size", "7"},
                                  {"pooling", "max"},
                                  {"gqa", "mean"},
                                  {"queries", "pre_rope"}})},
      {"tova", with_selection({{"reference", "authors"}, {"queries", "pre_rope"}})},
      {"expected_attention",
       {{"reference", "authors"},
        {"n_future_positions", "512"},
        {"n_sink", "4"},
        {"use_covariance", "true"},
        {"use_vnorm", "true"},
        {"epsilon", "0.01"},
        {"gqa", "mean"},
        {"normalize_sinks", "false"},
        {"queries", "pre_rope"},
        {"n_recent", "0"}}},
      {"h2o", {{"reference", "authors"}, {"recent_share", "0.5"}, {"queries", "pre_rope"}, {"n_sink", "0"}}},
      {"random", with_selection({{"seed", "0"}})},
      {"moment_kv",
       {{"window_size", "32"},
        {"kernel_size", "4"},
        {"pooling", "chunk_mean"},
        {"prefill_rounds", "8"},
        {"clamp_tau", "1e-6"},
        {"order", "first"},
        {"mi", "true"},
        {"correction", "true"},
        {"storage", "fp32"},
        {"decode_evict", "true"},
        {"residual_refresh", "0"},
        {"queries", "pre_rope"},
        {"n_sink", "1"},
        {"n_recent", "32"}}},
  };
  // uncomp_entropy writes per-head values ([B, Hq]), not token scores: it is listed, and compress refuses it.
  M const entropy = {{"top_k", "auto"},      {"normalize_rows", "true"}, {"renormalize_topk", "false"}, {"ridge", "0"},
                     {"unit", "normalized"}, {"dtype", "float64"},       {"queries", "pre_rope"}};
  auto listed_cache_policies = listed;
  CHECK(listed_cache_policies["uncomp_entropy"] == entropy);
  listed_cache_policies.erase("uncomp_entropy");
  // uncomp reads a calibration file (its own test below).
  CHECK(listed_cache_policies["uncomp"] == M{{"window_size", "8"},
                                             {"kernel_size", "7"},
                                             {"pooling", "max"},
                                             {"schedule", "preserving"},
                                             {"step", "auto"},
                                             {"largest", "640"},
                                             {"list", ""},
                                             {"preset", ""},
                                             {"groups", "auto"},
                                             {"rule", "auto"},
                                             {"gqa", "kv_heads"},
                                             {"stages", "false"},
                                             {"stage_epsilon", "1"},
                                             {"stage_count", "0"},
                                             {"hs_min_tokens", "auto"},
                                             {"hs_step", "0"},
                                             {"queries", "pre_rope"}});
  listed_cache_policies.erase("uncomp");
  // rdkv and kivi write bit plans (their own tests below), kivi takes neither --ratio nor --budget.
  CHECK(listed_cache_policies["rdkv"] == M{{"reference", "default"},
                                           {"k_budget_ratio", "0.5"},
                                           {"solver", "exact"},
                                           {"window_size", "32"},
                                           {"kernel_size", "5"},
                                           {"weight", "attn_linear"},
                                           {"channel", "think"},
                                           {"eps", "llama31"},
                                           {"evict", "true"},
                                           {"scope", "head"},
                                           {"zero_point", "float_min"},
                                           {"v_group", "0"},
                                           {"k_group", "0"},
                                           {"residual", "0"},
                                           {"queries", "pre_rope"}});
  CHECK(listed_cache_policies["kivi"] == M{{"bits", "2"}, {"group", "32"}, {"residual", "128"}});
  CHECK(contains(r.output, "solver=exact (authors: lagrangian)"));
  CHECK(contains(r.output, "zero_point=float_min (authors: integer)"));
  CHECK(contains(r.output, "rdkv  (reads keys and --queries)"));
  CHECK(contains(r.output, "kivi  (reads keys)"));
  {  // every listed default, given, changes nothing
    RDKVFiles const rf;
    std::string all;
    for (auto const& [name, value] : listed_cache_policies["rdkv"])
      all += " --param " + name + "=" + value;
    all.replace(all.find(" --param window_size=32"), 23, "");
    REQUIRE(run("compress --policy rdkv --budget 10" + rf.in() + " --out-dir " + work("rd_plain")).code == 0);
    REQUIRE(run("compress --policy rdkv --budget 10" + rf.in() + all + " --out-dir " + work("rd_alld")).code == 0);
    CHECK(read_int8(work("rd_plain/v_bits.npy")).data == read_int8(work("rd_alld/v_bits.npy")).data);
    CHECK(read_int8(work("rd_plain/k_bits.npy")).data == read_int8(work("rd_alld/k_bits.npy")).data);
    std::string const kv = " --keys " + rf.k + " --values " + rf.v;
    REQUIRE(run("compress --policy kivi" + kv + " --param residual=8 --out-dir " + work("kv_plain")).code == 0);
    REQUIRE(run("compress --policy kivi" + kv + " --param residual=8 --param bits=2 --param group=32 --out-dir " +
                work("kv_alld"))
                .code == 0);
    CHECK(read_int8(work("kv_plain/v_bits.npy")).data == read_int8(work("kv_alld/v_bits.npy")).data);
  }
  listed_cache_policies.erase("rdkv");
  listed_cache_policies.erase("kivi");
  CHECK(listed_cache_policies == expected);
  CHECK(contains(r.output, "uncomp_entropy  (reads keys and --queries)") == false);
  CHECK(contains(r.output, "uncomp_entropy  (reads --queries)"));
  for (char const* s : {"window_size=32 (kvpress: 64)", "kernel_size=7 (kvpress: 5)", "pooling=max (kvpress: avg)",
                        "epsilon=0.01 (kvpress: 0)", "recent_share=0.5 (kvpress: 0)"})
    CHECK(contains(r.output, s));
  std::map<std::string, M> const expected_allocators = {
      {"ada_kv", {{"reference", "authors"}, {"alpha_safeguard", "0.2"}}},
      {"pyramid_kv",
       {{"reference", "authors"}, {"window_size", "8"}, {"beta", "20"}, {"layer", "0"}, {"num_layers", "1"}}}};
  CHECK(allocators == expected_allocators);
  CHECK(contains(r.output, "pyramid_kv  (allocator)\n"));
  CHECK(contains(r.output, "--param window_size=8 (kvpress: 64)"));

  // Every listed parameter, set to its listed default, is accepted and changes nothing.
  WindowFiles const f("defaults");
  for (auto const& [policy, params] : expected) {
    std::string const inputs = f.kv() + (reads_queries(policy) ? " --queries " + f.queries : "");
    std::string all;
    for (auto const& [name, value] : params)
      all += " --param " + name + "=" + value;
    INFO(policy << all);
    REQUIRE(run("compress --policy " + policy + " --ratio 0.5" + inputs + " --out-dir " + f.out("d_plain")).code == 0);
    REQUIRE(run("compress --policy " + policy + " --ratio 0.5" + all + inputs + " --out-dir " + f.out("d_all")).code ==
            0);
    CHECK(ints(read(f.out("d_plain/indices.npy"))) == ints(read(f.out("d_all/indices.npy"))));
  }
  // The allocators' parameters too, with any policy (pyramid_kv's layer 0 of 1 is its listed default).
  for (auto const& [allocator, params] : expected_allocators)
    for (char const* policy : {"knorm", "snap_kv"}) {
      std::string const inputs = f.kv() + (reads_queries(policy) ? " --queries " + f.queries : "");
      std::string all;
      for (auto const& [name, value] : params)
        all += " --param " + name + "=" + value;
      std::string const base = std::string("compress --policy ") + policy + " --budget 20 --allocator " + allocator;
      INFO(base << all);
      REQUIRE(run(base + inputs + " --out-dir " + f.out("a_plain")).code == 0);
      REQUIRE(run(base + all + inputs + " --out-dir " + f.out("a_all")).code == 0);
      CHECK(ints(read(f.out("a_plain/indices.npy"))) == ints(read(f.out("a_all/indices.npy"))));
    }
}

TEST_CASE("cli: a parameter a policy does not have is rejected with exit 2, naming it and the policy", "[tools][cli]") {
  WindowFiles const f("reject");
  auto expect2 = [](std::string const& args, std::vector<std::string> const& needles) {
    auto const r = run(args);
    INFO(args << "\n" << r.output);
    CHECK(r.code == 2);
    for (auto const& n : needles)
      CHECK(contains(r.output, n));
  };
  for (auto const& policy : all_policies) {
    std::string const inputs = reads_queries(policy) ? f.kq() : " --keys " + f.keys;
    expect2("score --policy " + policy + " --param bogus=1" + inputs + " --out " + f.out("x.npy"),
            {"--param 'bogus' is not a parameter of policy " + policy});
  }
  // Parameters of other policies, and `queries` on a policy that reads none.
  for (auto const& [policy, param] : std::vector<std::pair<std::string, std::string>>{{"knorm", "queries=post_rope"},
                                                                                      {"key_diff", "queries=pre_rope"},
                                                                                      {"random", "queries=post_rope"},
                                                                                      {"streaming_llm", "n_recent=2"},
                                                                                      {"key_diff", "seed=1"},
                                                                                      {"knorm", "reference=kvpress"},
                                                                                      {"random", "anchor=raw_mean"},
                                                                                      {"tova", "window_size=8"},
                                                                                      {"tova", "gqa=mean"},
                                                                                      {"snap_kv", "anchor=raw_mean"},
                                                                                      {"snap_kv", "seed=3"}}) {
    std::string const inputs = reads_queries(policy) ? f.kq() : " --keys " + f.keys;
    std::string const name = param.substr(0, param.find('='));
    expect2("score --policy " + policy + " --param " + param + inputs + " --out " + f.out("x.npy"),
            {"'" + name + "' is not a parameter of policy " + policy, "see `kvc policies`"});
  }
  // Selection parameters do not change scores: `score` rejects them, `compress` takes them.
  expect2("score --policy key_diff --param n_sink=4 --keys " + f.keys + " --out " + f.out("x.npy"),
          {"'n_sink' of policy key_diff", "kvc compress"});
  expect2("score --policy snap_kv --param n_recent=2" + f.kq() + " --out " + f.out("x.npy"),
          {"'n_recent' of policy snap_kv"});
  CHECK(run("compress --policy key_diff --param n_sink=4 --budget 8" + f.kv() + " --out-dir " + f.out("d")).code == 0);
  // Malformed or repeated --param.
  expect2("score --policy knorm --param n_sink --keys " + f.keys + " --out " + f.out("x.npy"), {"expected NAME=VALUE"});
  expect2("compress --policy knorm --param n_sink=1 --param n_sink=2 --budget 4" + f.kv() + " --out-dir " + f.out("d"),
          {"'n_sink' given twice"});
}

TEST_CASE("cli: --queries, --positions and --rope go with the policies that read queries, and only them",
          "[tools][cli]") {
  WindowFiles const f("qopts");
  auto const positions = write_npy("wp.npy", kvc::NpyDtype::i64, {1, WindowFiles::w},
                                   std::vector<std::int64_t>(static_cast<std::size_t>(WindowFiles::w), 39));
  auto expect2 = [](std::string const& args, std::string const& needle) {
    auto const r = run(args);
    INFO(args << "\n" << r.output);
    CHECK(r.code == 2);
    CHECK(contains(r.output, needle));
  };
  for (char const* policy : {"snap_kv", "tova"}) {
    expect2(std::string("score --policy ") + policy + " --keys " + f.keys + " --out " + f.out("x.npy"),
            std::string("policy ") + policy + " reads queries: pass --queries Q.npy");
    expect2(std::string("compress --policy ") + policy + " --ratio 0.5" + f.kv() + " --out-dir " + f.out("d"),
            "reads queries: pass --queries Q.npy");
  }
  for (auto const& policy : key_only_policies)
    for (std::string const& opt :
         std::vector<std::string>{"--queries " + f.queries, "--positions " + positions, "--rope theta=10000"}) {
      expect2("score --policy " + policy + " --keys " + f.keys + " " + opt + " --out " + f.out("x.npy"),
              opt.substr(0, opt.find(' ')) + " given, but policy " + policy + " does not read queries");
      expect2("compress --policy " + policy + " --ratio 0.5" + f.kv() + " " + opt + " --out-dir " + f.out("d"),
              "does not read queries");
    }
  std::string const snap = "score --policy snap_kv" + f.kq() + " --out " + f.out("x.npy");
  for (char const* rope : {"''", "theta", "=5", "theta=abc", "theta=0.5", "theta=1e4,style=gptj", "theta=1e4,foo=1",
                           "theta=1e4,theta=2e4", "style=neox,", "theta=inf"})
    expect2(snap + " --rope " + rope, "--rope '");
  for (char const* rope : {"style=interleaved", "theta=500000", "theta=1e4,style=neox", "style=neox,theta=10000"})
    CHECK(run(snap + " --rope " + rope).code == 0);
  expect2(snap + " --param queries=post_rope --rope theta=10000",
          "--rope given, but --param queries=post_rope: post-RoPE queries are used as given");
  CHECK(run(snap + " --param queries=post_rope --positions " + positions).code == 0);
}

TEST_CASE("cli: snap_kv, tova and random follow the documented contract", "[tools][cli]") {
  WindowFiles const f("contract");
  Index const n = WindowFiles::n, w = WindowFiles::w;
  auto scores = [&](std::string const& args) {
    auto const r = run("score " + args + " --out " + f.out("ws.npy"));
    INFO(args << "\n" << r.output);
    REQUIRE(r.code == 0);
    auto const a = read(f.out("ws.npy"));
    CHECK(a.shape == std::vector<Index>{1, 2, n});
    return floats(a);
  };
  // SnapKV: the window_size window scores max(prefix) + 1 on every head; compress keeps it.
  auto const s = scores("--policy snap_kv --param window_size=8" + f.kq());
  for (Index h = 0; h < 2; ++h) {
    auto const* row = s.data() + h * n;
    float const top = *std::max_element(row, row + n - 8);
    for (Index t = n - 8; t < n; ++t)
      CHECK(row[t] == top + 1.0f);
  }
  REQUIRE(run("compress --policy snap_kv --param window_size=8 --budget 12" + f.kv() + " --queries " + f.queries +
              " --out-dir " + f.out("snap"))
              .code == 0);
  auto const kept = ints(read(f.out("snap/indices.npy")));
  REQUIRE(kept.size() == 24);
  for (Index h = 0; h < 2; ++h)
    for (Index t = 0; t < 8; ++t)
      CHECK(kept[static_cast<std::size_t>(h * 12 + 4 + t)] == n - 8 + t);
  // The documented defaults: reference=kvpress changes window_size to 64 (more rows than the queries hold).
  auto r = run("score --policy snap_kv --param reference=kvpress" + f.kq() + " --out " + f.out("x.npy"));
  CHECK(r.code == 3);
  CHECK(contains(r.output, "reads the last 64 query rows"));
  CHECK(scores("--policy snap_kv --param reference=kvpress --param window_size=32" + f.kq()) ==
        scores("--policy snap_kv --param reference=kvpress --param window_size=32 --param kernel_size=5 "
               "--param pooling=avg --param gqa=mean" +
               f.kq()));
  CHECK(scores("--policy snap_kv" + f.kq()) ==
        scores("--policy snap_kv --param window_size=32 --param kernel_size=7 --param pooling=max" + f.kq()));

  // TOVA: one score per token shared by every KV head; authors' scores are probabilities summing to 1; kvpress
  // keeps the newest token.
  auto const t = scores("--policy tova" + f.kq());
  CHECK(std::equal(t.begin(), t.begin() + n, t.begin() + n));
  double sum = 0;
  for (Index j = 0; j < n; ++j)
    sum += t[static_cast<std::size_t>(j)];
  CHECK(std::abs(sum - 1.0) < 1e-5);
  auto const tk = scores("--policy tova --param reference=kvpress" + f.kq());
  CHECK(tk[n - 1] == *std::max_element(tk.begin(), tk.begin() + n - 1) + 1.0f);

  // Positions: the default is the context's last w positions; other positions change the causal mask and RoPE.
  std::vector<std::int64_t> last(static_cast<std::size_t>(w));
  for (Index i = 0; i < w; ++i)
    last[static_cast<std::size_t>(i)] = n - w + i;
  auto const p_last = write_npy("p_last.npy", kvc::NpyDtype::i64, {1, w}, last);
  for (auto& p : last)
    p -= 4;
  auto const p_early = write_npy("p_early.npy", kvc::NpyDtype::i64, {1, w}, last);
  for (char const* policy : {"snap_kv", "tova"}) {
    std::string const base = std::string("--policy ") + policy + f.kq();
    CHECK(scores(base) == scores(base + " --positions " + p_last));
    CHECK(scores(base) != scores(base + " --positions " + p_early));
    CHECK(scores(base) != scores(base + " --rope style=interleaved"));
    CHECK(scores(base) != scores(base + " --param queries=post_rope"));
  }

  // float16 queries are widened exactly: the same scores as float32 queries holding the same values.
  std::vector<kvc::half> q16;
  std::vector<float> q32;
  for (float x : randoms(4 * w * 4, 4)) {
    q16.emplace_back(x);
    q32.push_back(static_cast<float>(q16.back()));
  }
  auto const f16 = write_npy("wq16.npy", kvc::NpyDtype::f16, {1, 4, w, 4}, q16);
  auto const f32 = write_npy("wq32.npy", kvc::NpyDtype::f32, {1, 4, w, 4}, q32);
  CHECK(scores("--policy tova --keys " + f.keys + " --queries " + f16) ==
        scores("--policy tova --keys " + f.keys + " --queries " + f32));

  // --time counts K and Q bytes for the window policies, nothing for random.
  r = run("score --policy snap_kv" + f.kq() + " --out " + f.out("x.npy") + " --time");
  CHECK(contains(r.output, "\"policy\":\"snap_kv\""));
  CHECK(contains(r.output, "\"bytes_read\":" + std::to_string((2 * n * 4 + 4 * w * 4) * 4) + ","));
  r = run("score --policy random --keys " + f.keys + " --out " + f.out("x.npy") + " --time");
  CHECK(contains(r.output, "\"bytes_read\":0,"));

  // random: deterministic per seed, in [0, 1), different for another seed.
  auto const r0 = scores("--policy random --keys " + f.keys);
  CHECK(r0 == scores("--policy random --param seed=0 --keys " + f.keys));
  CHECK(r0 != scores("--policy random --param seed=1 --keys " + f.keys));
  CHECK(r0 != scores("--policy random --param seed=18446744073709551615 --keys " + f.keys));
  for (float x : r0)
    CHECK((x >= 0.0f && x < 1.0f));
  REQUIRE(run("compress --policy random --param n_sink=2 --budget 5" + f.kv() + " --out-dir " + f.out("rnd")).code ==
          0);
  auto const rk = ints(read(f.out("rnd/indices.npy")));
  CHECK(rk.size() == 10);
  CHECK((rk[0] == 0 && rk[1] == 1 && rk[5] == 0 && rk[6] == 1));
}

TEST_CASE("cli: invalid queries, positions and window parameters exit 3 naming the file and the field",
          "[tools][cli]") {
  WindowFiles const f("invalid");
  Index const w = WindowFiles::w;
  auto expect3 = [](std::string const& args, std::string const& needle) {
    auto const r = run(args);
    INFO(args << "\n" << r.output);
    CHECK(r.code == 3);
    CHECK(contains(r.output, needle));
  };
  std::string const out = " --out " + f.out("bad.npy");
  auto snap = [&](std::string const& queries, std::string const& more = "") {
    return "score --policy snap_kv --param window_size=8 --keys " + f.keys + " --queries " + queries + more + out;
  };
  auto const q = [&](char const* name, std::vector<Index> shape) {
    Index size = 1;
    for (Index s : shape)
      size *= s;
    return write_npy(name, kvc::NpyDtype::f32, shape, randoms(static_cast<std::size_t>(size)));
  };
  expect3(snap(write_npy("qi.npy", kvc::NpyDtype::i64, {1, 4, 8, 4}, std::vector<std::int64_t>(128, 1))),
          "qi.npy: field 'descr' is <i8, expected '<f4' (float32) or '<f2' (float16)");
  expect3(snap(q("q3.npy", {4, 8, 4})),
          "q3.npy: field 'shape' has 3 dimensions, expected 4 ([batch, query_heads, "
          "window, head_dim])");
  expect3(snap(q("qb.npy", {2, 4, 8, 4})), "qb.npy: field 'shape': batch (shape[0]) is 2, expected the keys' 1");
  expect3(snap(q("qh.npy", {1, 3, 8, 4})),
          "qh.npy: field 'shape': query heads (shape[1]) is 3, expected a positive multiple of the keys' KV heads (2)");
  expect3(snap(q("qw.npy", {1, 4, 0, 4})), "qw.npy: field 'shape' is (1, 4, 0, 4): every dimension must be >= 1");
  expect3(snap(q("qd.npy", {1, 4, 8, 6})), "qd.npy: field 'shape': head_dim (shape[3]) is 6, expected the keys' 4");
  auto nan = randoms(128);
  nan[7] = std::numeric_limits<float>::infinity();
  expect3(snap(write_npy("qn.npy", kvc::NpyDtype::f32, {1, 4, 8, 4}, nan)), "qn.npy: field 'data' holds NaN or Inf");
  expect3(snap(f.out("missing_q.npy")), "queries file " + f.out("missing_q.npy") + ": cannot open");
  // The window must fit the queries, and (without --positions) the context.
  expect3("score --policy snap_kv --param window_size=33" + f.kq() + out,
          "field 'shape': window (shape[2]) is 32, but policy snap_kv reads the last 33 query rows");
  auto const short_keys = write_npy("k_short.npy", kvc::NpyDtype::f32, {1, 2, 6, 4}, randoms(48));
  expect3("score --policy snap_kv --param window_size=8 --keys " + short_keys + " --queries " +
              q("q8.npy", {1, 4, 8, 4}) + out,
          "k_short.npy: field 'shape': tokens (shape[2]) is 6, but the last 8 query rows sit at positions N - 8 .. "
          "N - 1 (pass --positions P.npy)");
  // RoPE rotates pairs of channels.
  auto const odd_k = write_npy("k_odd.npy", kvc::NpyDtype::f32, {1, 1, 10, 3}, randoms(30));
  auto const odd_q = write_npy("q_odd.npy", kvc::NpyDtype::f32, {1, 1, 2, 3}, randoms(6));
  expect3("score --policy tova --keys " + odd_k + " --queries " + odd_q + out,
          "q_odd.npy: field 'shape': head_dim (shape[3]) is 3: RoPE rotates pairs of channels");
  CHECK(run("score --policy tova --param queries=post_rope --keys " + odd_k + " --queries " + odd_q + out).code == 0);
  // Positions: int64 [B, w], non-negative.
  std::string const pos = " --positions ";
  expect3(snap(f.queries, pos + q("pf.npy", {1, w})),
          "positions file " + work("pf.npy") + ": field 'descr' is <f4, expected '<i8' (int64)");
  expect3(snap(f.queries, pos + write_npy("ps.npy", kvc::NpyDtype::i64, {1, 8}, std::vector<std::int64_t>(8, 1))),
          "ps.npy: field 'shape' has 2 dimensions or other sizes, expected [batch, window] = [1, 32]");
  std::vector<std::int64_t> neg(static_cast<std::size_t>(w), 5);
  neg[3] = -1;
  expect3(snap(f.queries, pos + write_npy("pn.npy", kvc::NpyDtype::i64, {1, w}, neg)),
          "pn.npy: field 'data': position -1 (element 3) is negative, expected >= 0");
  std::vector<std::int64_t> huge(static_cast<std::size_t>(w), 5);
  huge[0] = std::int64_t{1} << 40;
  expect3(snap(f.queries, pos + write_npy("ph.npy", kvc::NpyDtype::i64, {1, w}, huge)),
          "ph.npy: field 'data': position 1099511627776 needs a RoPE table over 1 GiB");
  // Bad parameter values.
  std::string const base = "score --policy snap_kv --param window_size=8" + f.kq() + out;
  // An even kernel is refused by SnapKVScorer::check() (what ties members together), named by policy and member.
  expect3(base + " --param kernel_size=4", "policy snap_kv: SnapKVScorer: `kernel_size` must be odd");
  expect3(base + " --param kernel_size=0", "--param kernel_size = 0: expected an integer >= 1");
  expect3(base + " --param kernel_size=7.5", "--param kernel_size = '7.5': expected an integer");
  expect3(base + " --param pooling=median", "--param pooling = 'median': expected max or avg");
  expect3(base + " --param gqa=min", "--param gqa = 'min': expected mean, max, sum or per_query_head");
  expect3(base + " --param reference=kvpress --param gqa=max", "reference=kvpress averages over the GQA group");
  expect3(base + " --param reference=paper", "--param reference = 'paper': expected authors or kvpress");
  expect3(base + " --param queries=rotated", "--param queries = 'rotated': expected pre_rope or post_rope");
  expect3(base + " --param gqa=per_query_head", "gqa=per_query_head");  // Hq = 4, Hkv = 2
  expect3("score --policy snap_kv --param window_size=0" + f.kq() + out,
          "--param window_size = 0: expected an "
          "integer >= 1");
  expect3("score --policy random --param seed=-1 --keys " + f.keys + out,
          "--param seed = '-1': expected an integer in [0, 2^64)");
  expect3("score --policy random --param seed=18446744073709551616 --keys " + f.keys + out, "--param seed");
}

TEST_CASE("cli: expected_attention and h2o read what they document and write the documented shapes", "[tools][cli]") {
  WindowFiles const f("stateful");
  Index const n = WindowFiles::n;
  auto expect = [](int code, std::string const& args, std::vector<std::string> const& needles) {
    auto const r = run(args);
    INFO(args << "\n" << r.output);
    CHECK(r.code == code);
    for (auto const& needle : needles)
      CHECK(contains(r.output, needle));
  };
  std::string const out = " --out " + f.out("x.npy");
  std::string const ea = "score --policy expected_attention";
  // ExpectedAttention weights by ||v||: --values, unless use_vnorm=false.
  expect(2, ea + f.kq() + out, {"policy expected_attention", "--values", "use_vnorm=false"});
  CHECK(run(ea + " --param use_vnorm=false" + f.kq() + out).code == 0);
  // Its statistics are of pre-RoPE queries: post_rope is invalid input.
  expect(3, ea + " --param queries=post_rope" + f.kq() + " --values " + f.values + out,
         {"queries = post_rope", "pre-RoPE"});
  expect(3,
         "compress --policy expected_attention --param queries=post_rope --budget 12" + f.kv() + " --queries " +
             f.queries + " --out-dir " + f.out("d"),
         {"pre-RoPE"});
  // Both read queries: --queries is required.
  expect(2, ea + f.kv() + out, {"policy expected_attention reads queries: pass --queries Q.npy"});
  expect(2, "score --policy h2o --keys " + f.keys + out, {"policy h2o reads queries: pass --queries Q.npy"});
  expect(2, "compress --policy h2o --ratio 0.5" + f.kv() + " --out-dir " + f.out("d"),
         {"policy h2o reads queries: pass --queries Q.npy"});
  // recent_share is a fraction of the budget (compress only: score rejects it as a selection parameter).
  for (char const* share : {"1.5", "-0.1", "half"})
    expect(3,
           std::string("compress --policy h2o --param recent_share=") + share + " --budget 12" + f.kv() +
               " --queries " + f.queries + " --out-dir " + f.out("d"),
           {"--param recent_share = '" + std::string(share) + "': expected a number in [0"});
  expect(2, "score --policy h2o --param recent_share=0.5" + f.kq() + out, {"'recent_share' of policy h2o"});
  // Declared parameters are checked before any file is read: a missing keys file is not reached.
  expect(3,
         "compress --policy h2o --param recent_share=2 --budget 12 --keys " + f.out("missing.npy") + " --values " +
             f.values + " --queries " + f.queries + " --out-dir " + f.out("d"),
         {"--param recent_share = '2': expected a number in [0, 1]"});
  expect(
      3,
      "score --policy snap_kv --param kernel_size=4 --keys " + f.out("missing.npy") + " --queries " + f.queries + out,
      {"policy snap_kv: SnapKVScorer: `kernel_size` must be odd"});
  // Bad values of the other parameters.
  expect(3, ea + " --param gqa=sum" + f.kq() + " --values " + f.values + out, {"--param gqa = 'sum'"});
  expect(3, ea + " --param use_covariance=yes" + f.kq() + " --values " + f.values + out,
         {"--param use_covariance = 'yes': expected true or false"});
  expect(3, ea + " --param n_future_positions=0" + f.kq() + " --values " + f.values + out,
         {"--param n_future_positions = 0: expected an integer >= 1"});

  // Happy paths: score writes [B, Hkv, N] float32; compress the kept rows, sinks (ExpectedAttention) and H2O's
  // recent window (recent_share x budget) included.
  auto scores = [&](std::string const& args) {
    auto const r = run("score " + args + " --out " + f.out("s.npy"));
    INFO(args << "\n" << r.output);
    REQUIRE(r.code == 0);
    auto const a = read(f.out("s.npy"));
    CHECK(a.dtype == kvc::NpyDtype::f32);
    CHECK(a.shape == std::vector<Index>{1, 2, n});
    return floats(a);
  };
  auto const e = scores("--policy expected_attention" + f.kv() + " --queries " + f.queries);
  for (float x : e)
    CHECK(x > 0.0f);
  CHECK(e != scores("--policy expected_attention --param use_vnorm=false" + f.kq()));
  CHECK(e != scores("--policy expected_attention" + f.kv() + " --queries " + f.queries + " --rope style=interleaved"));
  auto const h = scores("--policy h2o" + f.kq());
  // Each of the 32 queries' attention (a probability row) is accumulated, averaged over the 2 query heads per KV head.
  double sum = 0;
  for (float x : h)
    sum += x;
  CHECK(std::abs(sum - 2.0 * WindowFiles::w) < 1e-3);
  CHECK(h != scores("--policy h2o --param reference=kvpress" + f.kq()));
  auto compress = [&](std::string const& policy, std::string const& more) {
    std::string const dir = f.out("c_" + policy);
    auto const r = run("compress --policy " + policy + " --budget 12" + more + f.kv() + " --queries " + f.queries +
                       " --out-dir " + dir);
    INFO(policy << more << "\n" << r.output);
    REQUIRE(r.code == 0);
    CHECK(read(dir + "/keys.npy").shape == std::vector<Index>{1, 2, 12, 4});
    CHECK(read(dir + "/values.npy").shape == std::vector<Index>{1, 2, 12, 4});
    CHECK(ints(read(dir + "/counts.npy")) == std::vector<std::int64_t>{12, 12});
    auto const idx = read(dir + "/indices.npy");
    CHECK(idx.shape == std::vector<Index>{1, 2, 12});
    return ints(idx);
  };
  auto const ek = compress("expected_attention", "");
  auto const hk = compress("h2o", "");
  for (Index head = 0; head < 2; ++head) {
    for (Index t = 0; t < 4; ++t)  // n_sink = 4
      CHECK(ek[static_cast<std::size_t>(head * 12 + t)] == t);
    for (Index t = 0; t < 6; ++t)  // recent_share 0.5 of 12
      CHECK(hk[static_cast<std::size_t>(head * 12 + 6 + t)] == n - 6 + t);
  }
}

TEST_CASE("cli: options belong to their command and are given once", "[tools][cli]") {
  WindowFiles const f("options");
  auto r = run("score --policy knorm --ratio 0.5 --keys " + f.keys + " --out " + f.out("x.npy"));
  CHECK(r.code == 2);
  CHECK(contains(r.output, "--ratio is not an option of `kvc score`"));
  r = run("compress --policy knorm --ratio 0.5" + f.kv() + " --out " + f.out("x.npy"));
  CHECK(r.code == 2);
  CHECK(contains(r.output, "--out is not an option of `kvc compress`"));
  r = run("policies --policy knorm");
  CHECK(r.code == 2);
  CHECK(contains(r.output, "--policy is not an option of `kvc policies`"));
  r = run("score --policy knorm --keys " + f.keys + " --keys " + f.keys + " --out " + f.out("x.npy"));
  CHECK(r.code == 2);
  CHECK(contains(r.output, "--keys given twice"));
  r = run("score --policy knorm --keys " + f.keys + " --out");
  CHECK(r.code == 2);
  CHECK(contains(r.output, "--out needs a value"));
  // One value per occurrence: a stray word after it is an unknown argument, as is an unknown --name=value.
  r = run("score --policy knorm --keys " + f.keys + " --out " + f.out("x.npy") + " extra");
  CHECK(r.code == 2);
  CHECK(contains(r.output, "unknown argument 'extra'"));
  r = run("score --policy knorm --keys " + f.keys + " --bogus=3 --out " + f.out("x.npy"));
  CHECK(r.code == 2);
  CHECK(contains(r.output, "unknown argument '--bogus=3'"));
  r = run("score --policy knorm --keys " + f.keys + " --out " + f.out("x.npy") + " --ratio=0.5");
  CHECK(r.code == 2);
  CHECK(contains(r.output, "--ratio is not an option of `kvc score`"));
}

TEST_CASE("cli: --name=value and --name value are the same option", "[tools][cli]") {
  WindowFiles const f("equals");
  auto const spaced = run("score --policy snap_kv --param window_size=4" + f.kq() + " --out " + f.out("a.npy"));
  REQUIRE(spaced.code == 0);
  auto const joined = run("score --policy=snap_kv --param=window_size=4 --keys=" + f.keys + " --queries=" + f.queries +
                          " --out=" + f.out("b.npy"));
  INFO(joined.output);
  REQUIRE(joined.code == 0);
  CHECK(floats(read(f.out("a.npy"))) == floats(read(f.out("b.npy"))));
  // A joined value given twice is still given twice; --param repeats.
  auto const twice = run("score --policy=knorm --policy=knorm --keys=" + f.keys + " --out=" + f.out("c.npy"));
  CHECK(twice.code == 2);
  CHECK(contains(twice.output, "--policy given twice"));
}

// ---------------------------------------------------------------------------------------------------------------
// .safetensors inputs (FILE.safetensors:TENSOR, or FILE.safetensors holding one tensor).

namespace {

/// Writes `tensors` to the .safetensors file `name` in the work folder (kvc::write_safetensors is checked byte for
/// byte against hand-built files in tests/io/safetensors_test.cpp).
std::string write_st(std::string const& name, std::vector<kvc::SafetensorsView> const& tensors) {
  std::string const path = work(name);
  std::string error;
  INFO(error);
  REQUIRE(kvc::write_safetensors(path, tensors, error));
  return path;
}

std::vector<std::byte> file_bytes(std::string const& path) {
  std::ifstream f(path, std::ios::binary);
  std::string s{std::istreambuf_iterator<char>(f), {}};
  std::vector<std::byte> b(s.size());
  if (!s.empty())
    std::memcpy(b.data(), s.data(), s.size());
  return b;
}

}  // namespace

TEST_CASE("cli: .safetensors inputs give the outputs of the same data as .npy", "[tools][cli][safetensors]") {
  WindowFiles const f("st");
  Index const n = WindowFiles::n, w = WindowFiles::w;
  auto const k = randoms(2 * n * 4, 2), v = randoms(2 * n * 4, 3), q = randoms(4 * w * 4, 4);  // WindowFiles' data
  std::vector<std::int64_t> positions(static_cast<std::size_t>(w));
  for (Index i = 0; i < w; ++i)
    positions[static_cast<std::size_t>(i)] = 100 + 2 * i;  // not the default positions: the file is really read
  auto const p_npy = write_npy("st_p.npy", kvc::NpyDtype::i64, {1, w}, positions);
  // One file with every input (names in another order than they are used), and a file with the keys alone.
  std::string const all =
      write_st("st_all.safetensors", {{"model.q", kvc::SafetensorsDtype::f32, {1, 4, w, 4}, q.data()},
                                      {"pos", kvc::SafetensorsDtype::i64, {1, w}, positions.data()},
                                      {"model.k", kvc::SafetensorsDtype::f32, {1, 2, n, 4}, k.data()},
                                      {"model.v", kvc::SafetensorsDtype::f32, {1, 2, n, 4}, v.data()}});
  std::string const only_k = write_st("st_k.safetensors", {{"k", kvc::SafetensorsDtype::f32, {1, 2, n, 4}, k.data()}});

  auto same_output = [&](std::string const& npy_args, std::string const& st_args, std::string const& command) {
    bool const compress = command == "compress";
    std::string const a = compress ? " --out-dir " + f.out("npy_dir") : " --out " + f.out("npy.npy");
    std::string const b = compress ? " --out-dir " + f.out("st_dir") : " --out " + f.out("st.npy");
    auto const r1 = run(command + " " + npy_args + a), r2 = run(command + " " + st_args + b);
    INFO(npy_args << "\n" << r1.output << "\n" << st_args << "\n" << r2.output);
    REQUIRE(r1.code == 0);
    REQUIRE(r2.code == 0);
    if (!compress) {
      CHECK(file_bytes(f.out("npy.npy")) == file_bytes(f.out("st.npy")));
      return;
    }
    for (char const* name : {"/keys.npy", "/values.npy", "/indices.npy", "/counts.npy"})
      CHECK(file_bytes(f.out("npy_dir") + name) == file_bytes(f.out("st_dir") + name));
  };
  same_output("--policy key_diff --keys " + f.keys, "--policy key_diff --keys " + all + ":model.k", "score");
  same_output("--policy knorm --keys " + f.keys, "--policy knorm --keys " + only_k, "score");  // the only tensor
  same_output("--policy snap_kv --param window_size=8" + f.kq() + " --positions " + p_npy,
              "--policy snap_kv --param window_size=8 --keys " + all + ":model.k --queries " + all +
                  ":model.q --positions " + all + ":pos",
              "score");
  same_output(
      "--policy tova --budget 10" + f.kv() + " --queries " + f.queries,
      "--policy tova --budget 10 --keys " + all + ":model.k --values " + all + ":model.v --queries " + all + ":model.q",
      "compress");
  // The scores are not those of the default positions: --positions was read from the file.
  REQUIRE(run("score --policy snap_kv --param window_size=8" + f.kq() + " --out " + f.out("default.npy")).code == 0);
  CHECK(file_bytes(f.out("default.npy")) != file_bytes(f.out("st.npy")));
}

TEST_CASE("cli: bfloat16 .safetensors keys score as their exact float32 values, compress writes float32",
          "[tools][cli][safetensors]") {
  // bfloat16 values (the top 16 bits of a float) and the same values as float32 .npy: widening is exact.
  Index const n = 12;
  auto const src = randoms(static_cast<std::size_t>(2 * n * 4), 9);
  std::vector<std::uint16_t> bits;
  std::vector<float> exact;
  for (float x : src) {
    std::uint32_t u = 0;
    std::memcpy(&u, &x, 4);
    bits.push_back(static_cast<std::uint16_t>(u >> 16));  // truncation: any bfloat16 will do
    u &= 0xFFFF0000u;
    float y = 0;
    std::memcpy(&y, &u, 4);
    exact.push_back(y);
  }
  auto const k_npy = write_npy("bf_k.npy", kvc::NpyDtype::f32, {1, 2, n, 4}, exact);
  auto const k_st = write_st("bf_k.safetensors", {{"k", kvc::SafetensorsDtype::bf16, {1, 2, n, 4}, bits.data()}});
  for (char const* policy : {"knorm", "key_diff"}) {
    INFO(policy);
    REQUIRE(run(std::string("score --policy ") + policy + " --keys " + k_npy + " --out " + work("bf_a.npy")).code == 0);
    REQUIRE(run(std::string("score --policy ") + policy + " --keys " + k_st + " --out " + work("bf_b.npy")).code == 0);
    auto const a = floats(read(work("bf_a.npy"))), b = floats(read(work("bf_b.npy")));
    REQUIRE(a.size() == b.size());
    for (std::size_t i = 0; i < a.size(); ++i)  // the same values; kernels may sum in another order per dtype
      CHECK(std::abs(a[i] - b[i]) <= 1e-5f * std::max(1.0f, std::abs(a[i])));
  }
  REQUIRE(
      run("compress --policy knorm --budget 5 --keys " + k_st + " --values " + k_st + " --out-dir " + work("bf_out"))
          .code == 0);
  auto const kept = read(work("bf_out/keys.npy"));
  CHECK(kept.dtype == kvc::NpyDtype::f32);
  REQUIRE(kept.shape == std::vector<Index>{1, 2, 5, 4});
  auto const idx = ints(read(work("bf_out/indices.npy")));
  auto const kf = floats(kept);
  for (Index h = 0; h < 2; ++h)
    for (Index j = 0; j < 5; ++j)
      for (Index d = 0; d < 4; ++d)
        CHECK(kf[static_cast<std::size_t>((h * 5 + j) * 4 + d)] ==
              exact[static_cast<std::size_t>((h * n + idx[static_cast<std::size_t>(h * 5 + j)]) * 4 + d)]);
}

/// An fp8 cache in .safetensors (keys scaled by 0.02, values by 0.05) and the float32 .npy of the values it holds.
struct Fp8Files {
  static constexpr Index n = 40, w = 32;
  static constexpr float k_scale = 0.02f, v_scale = 0.05f;
  std::string fp8, keys, values;
  explicit Fp8Files(std::string const& tag, kvc::SafetensorsDtype dtype) {
    std::vector<std::uint8_t> kb, vb;
    std::vector<float> kx, vx;
    auto quantise = [&](std::vector<float> const& x, float scale, std::vector<std::uint8_t>& bytes,
                        std::vector<float>& exact) {
      for (float v : x) {
        if (dtype == kvc::SafetensorsDtype::f8_e4m3) {
          kvc::float8_e4m3 const q(v / scale);
          bytes.push_back(q.bits);
          exact.push_back(static_cast<float>(q) * scale);  // the dequantised value, rounded once
        } else {
          kvc::float8_e5m2 const q(v / scale);
          bytes.push_back(q.bits);
          exact.push_back(static_cast<float>(q) * scale);
        }
      }
    };
    quantise(randoms(2 * n * 4, 2), k_scale, kb, kx);
    quantise(randoms(2 * n * 4, 3), v_scale, vb, vx);
    fp8 =
        write_st(tag + ".safetensors", {{"k", dtype, {1, 2, n, 4}, kb.data()}, {"v", dtype, {1, 2, n, 4}, vb.data()}});
    keys = write_npy(tag + "_k.npy", kvc::NpyDtype::f32, {1, 2, n, 4}, kx);
    values = write_npy(tag + "_v.npy", kvc::NpyDtype::f32, {1, 2, n, 4}, vx);
  }
  std::string fp8_kv() const { return " --keys " + fp8 + ":k --values " + fp8 + ":v --k-scale 0.02 --v-scale 0.05"; }
  std::string f32_kv() const { return " --keys " + keys + " --values " + values; }
};

TEST_CASE("cli: fp8 .safetensors caches give the outputs of their dequantised float32 values",
          "[tools][cli][safetensors][fp8]") {
  for (auto const dtype : {kvc::SafetensorsDtype::f8_e4m3, kvc::SafetensorsDtype::f8_e5m2}) {
    std::string const tag = dtype == kvc::SafetensorsDtype::f8_e4m3 ? "e4m3" : "e5m2";
    Fp8Files const f("fp8_" + tag, dtype);
    std::string const q = " --queries " + write_npy("fp8_q.npy", kvc::NpyDtype::f32, {1, 4, Fp8Files::w, 4},
                                                    randoms(4 * Fp8Files::w * 4, 4));
    for (std::string const& policy : all_policies) {
      INFO(tag << " " << policy);
      std::string const queries = reads_queries(policy) ? q : std::string();
      // score: the same scores bit for bit (every element reads as decode(byte) * scale, exactly the .npy's value).
      REQUIRE(run("score --policy " + policy + f.fp8_kv() + queries + " --out " + work("fp8_a.npy")).code == 0);
      REQUIRE(run("score --policy " + policy + f.f32_kv() + queries + " --out " + work("fp8_b.npy")).code == 0);
      CHECK(file_bytes(work("fp8_a.npy")) == file_bytes(work("fp8_b.npy")));
      // compress: the same kept rows, written as float32 values.
      REQUIRE(run("compress --policy " + policy + " --budget 9 --allocator ada_kv" + f.fp8_kv() + queries +
                  " --out-dir " + work("fp8_c"))
                  .code == 0);
      REQUIRE(run("compress --policy " + policy + " --budget 9 --allocator ada_kv" + f.f32_kv() + queries +
                  " --out-dir " + work("fp8_d"))
                  .code == 0);
      for (char const* file : {"keys.npy", "values.npy", "indices.npy", "counts.npy", "ragged_keys.npy",
                               "ragged_values.npy", "offsets.npy"})
        CHECK(file_bytes(work(std::string("fp8_c/") + file)) == file_bytes(work(std::string("fp8_d/") + file)));
    }
    // attend: the same outputs.
    REQUIRE(run("attend" + f.fp8_kv() + q + " --out-dir " + work("fp8_e")).code == 0);
    REQUIRE(run("attend" + f.f32_kv() + q + " --out-dir " + work("fp8_f")).code == 0);
    CHECK(file_bytes(work("fp8_e/out.npy")) == file_bytes(work("fp8_f/out.npy")));
    CHECK(file_bytes(work("fp8_e/lse.npy")) == file_bytes(work("fp8_f/lse.npy")));
    // The scale is applied: without it the scores differ.
    REQUIRE(run("score --policy knorm --keys " + f.fp8 + ":k --out " + work("fp8_g.npy")).code == 0);
    REQUIRE(run("score --policy knorm --keys " + f.fp8 + ":k --k-scale 0.02 --out " + work("fp8_h.npy")).code == 0);
    CHECK(file_bytes(work("fp8_g.npy")) != file_bytes(work("fp8_h.npy")));
  }
}

TEST_CASE("cli: fp8 scale errors exit 3 naming the option and the file", "[tools][cli][safetensors][fp8]") {
  auto expect3 = [](std::string const& args, std::string const& needle) {
    auto const r = run(args);
    INFO(args << "\n" << r.output);
    CHECK(r.code == 3);
    CHECK(r.output.find(needle) != std::string::npos);
  };
  Fp8Files const f("fp8_err", kvc::SafetensorsDtype::f8_e4m3);
  std::string const out = " --out " + work("fp8_err.npy");
  expect3("score --policy knorm --keys " + f.keys + " --k-scale 2" + out,
          "--k-scale given, but keys file " + f.keys + " holds <f4: a scale applies to F8_E4M3 and F8_E5M2 tensors");
  for (char const* bad : {"0", "-1", "nan", "inf", "x"})
    expect3("score --policy knorm --keys " + f.fp8 + ":k --k-scale " + bad + out,
            std::string("--k-scale '") + bad + "': expected a finite number > 0");
  expect3("score --policy knorm --keys " + f.fp8 + ":k --v-scale 2" + out, "--v-scale given without --values");
  expect3("score --policy knorm --keys " + f.fp8 + ":k --values " + f.values + out, "must equal the keys' dtype");
  expect3("score --policy snap_kv --keys " + f.fp8 + ":k --queries " + f.fp8 + ":k" + out,
          "queries file " + f.fp8 + ":k: field 'dtype' is F8_E4M3, expected F32, F16 or BF16");
}

TEST_CASE("cli: .safetensors input errors exit 3 naming the file, the tensor and what was expected",
          "[tools][cli][safetensors]") {
  auto expect3 = [](std::string const& args, std::string const& needle) {
    auto const r = run(args);
    INFO(args << "\n" << r.output);
    CHECK(r.code == 3);
    CHECK(r.output.find(needle) != std::string::npos);
  };
  std::string const out = " --out " + work("st_bad.npy");
  auto const k = randoms(8);
  std::vector<double> k64(k.begin(), k.end());
  std::string const two = write_st("st_two.safetensors", {{"a", kvc::SafetensorsDtype::f32, {1, 1, 4, 2}, k.data()},
                                                          {"b", kvc::SafetensorsDtype::f32, {1, 1, 4, 2}, k.data()},
                                                          {"c64", kvc::SafetensorsDtype::f64, {1, 1, 4, 2}, k64.data()},
                                                          {"flat", kvc::SafetensorsDtype::f32, {8}, k.data()}});
  expect3("score --policy knorm --keys " + two + ":nope" + out,
          "keys file " + two + ":nope: no tensor named 'nope'; the file holds 'a', 'b', 'c64', 'flat'");
  expect3("score --policy knorm --keys " + two + out,
          "keys file " + two + ": the file holds 4 tensors ('a', 'b', 'c64', 'flat'); name one as " + two + ":TENSOR");
  expect3("score --policy knorm --keys " + two + ":c64" + out,
          "keys file " + two + ":c64: field 'dtype' is F64, expected F32, F16, BF16, F8_E4M3 or F8_E5M2");
  expect3("score --policy knorm --keys " + two + ":flat" + out,
          "field 'shape' has 1 dimensions, expected 4 ([batch, kv_heads, tokens, head_dim])");
  // Not a .safetensors file: .npy bytes, text, a truncated header.
  auto const npy = kvc::serialize_npy(kvc::NpyDtype::f32, std::vector<Index>{1, 1, 4, 2}, k.data());
  expect3("score --policy knorm --keys " + write_file("st_npy.safetensors", npy) + out,
          "st_npy.safetensors: header length N is");
  expect3("score --policy knorm --keys " + write_file("st_text.safetensors", {std::byte{'h'}, std::byte{'i'}}) + out,
          "st_text.safetensors: not a .safetensors file: 2 bytes");
  auto truncated = file_bytes(two);
  truncated.resize(truncated.size() - 1);  // data: a 32 + b 32 + c64 64 + flat 32 = 160 bytes, one missing
  expect3("score --policy knorm --keys " + write_file("st_trunc.safetensors", truncated) + ":a" + out,
          "st_trunc.safetensors:a: tensor 'flat': field 'data_offsets' end 160 is past the data buffer of 159 bytes");
  expect3("score --policy knorm --keys " + work("st_missing.safetensors") + ":a" + out, "cannot open");
  // Values must have the keys' dtype; --positions must be I64.
  std::vector<kvc::half> h16(k.begin(), k.end());
  std::string const mixed =
      write_st("st_mixed.safetensors", {{"k", kvc::SafetensorsDtype::f32, {1, 1, 4, 2}, k.data()},
                                        {"v", kvc::SafetensorsDtype::f16, {1, 1, 4, 2}, h16.data()},
                                        {"p", kvc::SafetensorsDtype::f32, {1, 4}, k.data()}});
  expect3(
      "compress --policy knorm --budget 2 --keys " + mixed + ":k --values " + mixed + ":v --out-dir " + work("st_d"),
      "values file " + mixed + ":v: field 'dtype' must equal the keys' dtype");
  expect3("score --policy tova --keys " + mixed + ":k --queries " + mixed + ":k --positions " + mixed + ":p" + out,
          "positions file " + mixed + ":p: field 'dtype' is F32, expected I64");
  // The output is compared with the file part of each input.
  auto const r = run("score --policy knorm --keys " + two + ":a --out " + two);
  CHECK(r.code == 3);
  CHECK(contains(r.output, "is the same file as --keys " + two + ":a"));
  CHECK(file_bytes(two).size() > 8);  // untouched
}

// ---------------------------------------------------------------------------------------------------------------
// Allocators (--allocator ada_kv, pyramid_kv, pyramid_kv+ada_kv), the ragged store, the memory figures and --dump.

namespace {

/// The lines of `text` that hold `needle`.
std::vector<std::string> lines_with(std::string const& text, std::string const& needle) {
  std::vector<std::string> out;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);)
    if (contains(line, needle))
      out.push_back(line);
  return out;
}

/// The integer after "KEY": in a JSON line.
long long json_int(std::string const& line, std::string const& key) {
  auto const at = line.find("\"" + key + "\":");
  INFO(line << " has no " << key);
  REQUIRE(at != std::string::npos);
  return std::stoll(line.substr(at + key.size() + 3));
}

/// Checks compress's outputs in `dir` over float32 keys k [B, H, N, d] and values v [B, H, N, dv]: keys.npy holds
/// each head's kept rows, padded to the longest head; with `ragged`, offsets.npy is the prefix sum of the counts and
/// ragged_keys.npy / ragged_values.npy hold exactly those rows; and the memory of the --time line `time` (when
/// given) is that of B*H*N input rows, B*H*n_kept padded rows and sum(counts) ragged rows. Returns the counts.
std::vector<std::int64_t> check_store(std::string const& dir, std::vector<float> const& k, std::vector<float> const& v,
                                      std::vector<Index> const& shape, Index dv, bool ragged,
                                      std::string const& time = "") {
  Index const B = shape[0], H = shape[1], N = shape[2], d = shape[3];
  auto const counts = ints(read(dir + "/counts.npy"));
  REQUIRE(counts.size() == static_cast<std::size_t>(B * H));
  Index const kept_max = *std::max_element(counts.begin(), counts.end());
  Index total = 0;
  for (auto c : counts)
    total += c;
  auto const keys = read(dir + "/keys.npy"), values = read(dir + "/values.npy");
  REQUIRE(keys.shape == std::vector<Index>{B, H, kept_max, d});
  REQUIRE(values.shape == std::vector<Index>{B, H, kept_max, dv});
  auto const idx = ints(read(dir + "/indices.npy"));
  auto const kf = floats(keys), vf = floats(values);
  for (Index bh = 0; bh < B * H; ++bh)
    for (Index j = 0; j < counts[static_cast<std::size_t>(bh)]; ++j) {
      auto const t = idx[static_cast<std::size_t>(bh * kept_max + j)];
      for (Index x = 0; x < d; ++x)
        CHECK(kf[static_cast<std::size_t>((bh * kept_max + j) * d + x)] ==
              k[static_cast<std::size_t>((bh * N + t) * d + x)]);
      for (Index x = 0; x < dv; ++x)
        CHECK(vf[static_cast<std::size_t>((bh * kept_max + j) * dv + x)] ==
              v[static_cast<std::size_t>((bh * N + t) * dv + x)]);
    }
  if (ragged) {
    auto const offsets = read(dir + "/offsets.npy");
    CHECK(offsets.dtype == kvc::NpyDtype::i64);
    REQUIRE(offsets.shape == std::vector<Index>{B * H + 1});
    auto const off = ints(offsets);
    CHECK(off[0] == 0);
    for (Index bh = 0; bh < B * H; ++bh)
      CHECK(off[static_cast<std::size_t>(bh + 1)] - off[static_cast<std::size_t>(bh)] ==
            counts[static_cast<std::size_t>(bh)]);
    auto const rk = read(dir + "/ragged_keys.npy"), rv = read(dir + "/ragged_values.npy");
    REQUIRE(rk.shape == std::vector<Index>{total, d});
    REQUIRE(rv.shape == std::vector<Index>{total, dv});
    auto const rkf = floats(rk), rvf = floats(rv);
    // Round trip: ragged row off[bh] + j is row j of head bh in keys.npy (and values.npy).
    for (Index bh = 0; bh < B * H; ++bh)
      for (Index j = 0; j < counts[static_cast<std::size_t>(bh)]; ++j) {
        auto const row = off[static_cast<std::size_t>(bh)] + j;
        for (Index x = 0; x < d; ++x)
          CHECK(rkf[static_cast<std::size_t>(row * d + x)] ==
                kf[static_cast<std::size_t>((bh * kept_max + j) * d + x)]);
        for (Index x = 0; x < dv; ++x)
          CHECK(rvf[static_cast<std::size_t>(row * dv + x)] ==
                vf[static_cast<std::size_t>((bh * kept_max + j) * dv + x)]);
      }
  } else {
    CHECK(!std::filesystem::exists(dir + "/ragged_keys.npy"));
    CHECK(!std::filesystem::exists(dir + "/offsets.npy"));
  }
  if (!time.empty()) {
    long long const row = (d + dv) * 4;
    CHECK(json_int(time, "row_bytes") == row);
    CHECK(json_int(time, "input_bytes") == B * H * N * row);
    CHECK(json_int(time, "padded_bytes") == B * H * kept_max * row);
    CHECK(json_int(time, "ragged_bytes") == total * row);
    CHECK(json_int(time, "input_tokens") == B * H * N);
    CHECK(json_int(time, "kept_tokens") == total);
  }
  return counts;
}

}  // namespace

TEST_CASE("cli: compress --allocator ada_kv gives each head its own count and writes the ragged store",
          "[tools][cli][allocator]") {
  // Knorm keeps low-norm keys: heads (0, 0) and (1, 2) have 5x the norms, so AdaKV's global ranking gives them less.
  Index const B = 2, H = 3, N = 40, d = 8, dv = 6;
  auto k = randoms(static_cast<std::size_t>(B * H * N * d), 21);
  for (Index bh : {0, 5})
    for (Index i = 0; i < N * d; ++i)
      k[static_cast<std::size_t>(bh * N * d + i)] *= 5.0f;
  auto const v = randoms(static_cast<std::size_t>(B * H * N * dv), 22);
  std::string const kv = " --keys " + write_npy("ada_k.npy", kvc::NpyDtype::f32, {B, H, N, d}, k) + " --values " +
                         write_npy("ada_v.npy", kvc::NpyDtype::f32, {B, H, N, dv}, v);
  auto compress = [&](std::string const& args, std::string const& out) {
    auto const r = run("compress --policy knorm" + args + kv + " --out-dir " + work(out) + " --time");
    INFO(args << "\n" << r.output);
    REQUIRE(r.code == 0);
    auto const lines = lines_with(r.output, "\"command\":\"compress\"");
    REQUIRE(lines.size() == 1);
    return lines[0];
  };
  // authors (the default): per-head counts differ; the scaled heads keep the fewest.
  auto line = compress(" --ratio 0.5 --allocator ada_kv", "ada_authors");
  CHECK(contains(line, "\"policy\":\"knorm\",\"allocator\":\"ada_kv\",\"seconds\":"));
  auto counts = check_store(work("ada_authors"), k, v, {B, H, N, d}, dv, true, line);
  for (Index b = 0; b < B; ++b) {
    auto const* c = counts.data() + b * H;
    CHECK(*std::min_element(c, c + H) != *std::max_element(c, c + H));
  }
  CHECK(counts[0] < counts[1]);
  CHECK(counts[5] < counts[4]);
  // kvpress: exactly Hkv x kept per sequence (kept = floor(40 x 0.5) = 20), still uneven.
  line =
      compress(" --ratio 0.5 --allocator ada_kv --param reference=kvpress --param alpha_safeguard=0.3", "ada_kvpress");
  counts = check_store(work("ada_kvpress"), k, v, {B, H, N, d}, dv, true, line);
  for (Index b = 0; b < B; ++b) {
    auto const* c = counts.data() + b * H;
    CHECK(c[0] + c[1] + c[2] == H * 20);
    CHECK(*std::min_element(c, c + H) != *std::max_element(c, c + H));
    for (Index h = 0; h < H; ++h)
      CHECK(c[h] >= 6);  // the safeguard: floor(0.3 x 20) per head
  }
  // alpha 1 is uniform; without --allocator no ragged files, and the memory line still reports the three sizes.
  line = compress(" --budget 12 --allocator ada_kv --param alpha_safeguard=1", "ada_uniform");
  CHECK(check_store(work("ada_uniform"), k, v, {B, H, N, d}, dv, true, line) == std::vector<std::int64_t>(6, 12));
  line = compress(" --budget 12", "no_allocator");
  CHECK(!contains(line, "allocator"));
  CHECK(check_store(work("no_allocator"), k, v, {B, H, N, d}, dv, false, line) == std::vector<std::int64_t>(6, 12));
  CHECK(json_int(line, "ragged_bytes") == json_int(line, "padded_bytes"));
  // pyramid_kv+ada_kv and --threads: the same outputs on every thread count.
  compress(" --budget 16 --allocator pyramid_kv+ada_kv --param layer=1 --param num_layers=3", "py_ada1");
  compress(" --budget 16 --allocator pyramid_kv+ada_kv --param layer=1 --param num_layers=3 --threads 3", "py_ada3");
  for (char const* f : {"/indices.npy", "/counts.npy", "/offsets.npy", "/ragged_keys.npy", "/ragged_values.npy"})
    CHECK(file_bytes(work("py_ada1") + f) == file_bytes(work("py_ada3") + f));
  check_store(work("py_ada1"), k, v, {B, H, N, d}, dv, true);

  // float16 stays float16, in the ragged store too; the memory is in the input dtype.
  std::vector<kvc::half> h16;
  for (float x : k)
    h16.emplace_back(x);
  auto const k16 = write_npy("ada_k16.npy", kvc::NpyDtype::f16, {B, H, N, d}, h16);
  auto const r = run("compress --policy knorm --ratio 0.5 --allocator ada_kv --keys " + k16 + " --values " + k16 +
                     " --out-dir " + work("ada16") + " --time");
  REQUIRE(r.code == 0);
  auto const rk = read(work("ada16/ragged_keys.npy"));
  CHECK(rk.dtype == kvc::NpyDtype::f16);
  CHECK(json_int(r.output, "row_bytes") == 2 * d * 2);
  CHECK(json_int(r.output, "ragged_bytes") == rk.shape[0] * 2 * d * 2);
}

TEST_CASE("cli: ada_kv's counts are those of the worked examples of the AdaKV spec", "[tools][cli][allocator]") {
  // original_baselines.md 5.7: two heads of 10 prefix tokens, B = 5. Knorm scores -|k| (d = 1): keys 1 - s rank as s.
  auto counts = [](std::vector<float> const& s, std::string const& params, std::string const& tag) {
    std::vector<float> k;
    for (float x : s)
      k.push_back(1.0f - x);
    auto const keys = write_npy("spec_" + tag + ".npy", kvc::NpyDtype::f32, {1, 2, 10, 1}, k);
    auto const r = run("compress --policy knorm --budget 5 --allocator ada_kv" + params + " --keys " + keys +
                       " --values " + keys + " --out-dir " + work("spec_" + tag));
    INFO(params << "\n" << r.output);
    REQUIRE(r.code == 0);
    return ints(read(work("spec_" + tag + "/counts.npy")));
  };
  std::vector<float> const first = {0.30f,  0.25f,  0.20f, 0.15f, 0.12f,  0.10f,  0.09f,  0.08f,  0.01f,  0.005f,
                                    0.085f, 0.082f, 0.02f, 0.01f, 0.009f, 0.008f, 0.007f, 0.006f, 0.004f, 0.003f};
  CHECK(counts(first, "", "a") == std::vector<std::int64_t>{7, 3});  // b = (round(7.4), round(2.6))
  auto const kept = ints(read(work("spec_a/indices.npy")));
  CHECK(kept == std::vector<std::int64_t>{0, 1, 2, 3, 4, 5, 6, 0, 1, 2, -1, -1, -1, -1});
  CHECK(counts(first, " --param reference=kvpress", "b") == std::vector<std::int64_t>{8, 2});
  std::vector<float> second = {0.9f, 0.8f, 0.7f, 0.6f, 0.5f, 0.4f, 0.3f, 0.2f, 0.15f, 0.001f, 0.12f};
  second.resize(20, 0.0001f);
  CHECK(counts(second, " --param alpha_safeguard=0.5", "c") == std::vector<std::int64_t>{6, 2});  // sum 8, not 10
  CHECK(counts(second, " --param alpha_safeguard=0.5 --param reference=kvpress", "d") ==
        std::vector<std::int64_t>{8, 2});
}

namespace {

/// A dump folder as `kvc-eval dump` writes it: layer<L>/keys.npy, values.npy [1, 2, n, 8], queries.npy and
/// queries_prerope.npy [1, 4, n, 8], float32, and meta.json (`meta`, or the sizes with RoPE theta 500000,
/// interleaved). `n_of(L)` is layer L's token count. Returns the folder.
std::string make_dump(std::string const& name, Index layers, Index n, std::string meta = "",
                      Index (*n_of)(Index, Index) = nullptr) {
  std::string const dir = work(name);
  std::filesystem::remove_all(dir);
  for (Index l = 0; l < layers; ++l) {
    std::string const ld = name + "/layer" + std::to_string(l);
    std::filesystem::create_directories(work(ld));
    Index const t = n_of ? n_of(l, n) : n;
    auto const seed = static_cast<std::uint64_t>(100 + 4 * l);
    write_npy(ld + "/keys.npy", kvc::NpyDtype::f32, {1, 2, t, 8}, randoms(static_cast<std::size_t>(2 * t * 8), seed));
    write_npy(ld + "/values.npy", kvc::NpyDtype::f32, {1, 2, t, 8},
              randoms(static_cast<std::size_t>(2 * t * 8), seed + 1));
    write_npy(ld + "/queries.npy", kvc::NpyDtype::f32, {1, 4, t, 8},
              randoms(static_cast<std::size_t>(4 * t * 8), seed + 2));
    write_npy(ld + "/queries_prerope.npy", kvc::NpyDtype::f32, {1, 4, t, 8},
              randoms(static_cast<std::size_t>(4 * t * 8), seed + 3));
  }
  if (meta.empty())
    meta = "{\"model\": \"synthetic\", \"tokens\": " + std::to_string(n) + ", \"layers\": " + std::to_string(layers) +
           ", \"query_heads\": 4, \"kv_heads\": 2, \"head_dim\": 8, \"rope\": {\"theta\": 500000, \"style\": "
           "\"interleaved\", \"scaled\": false}}\n";
  std::ofstream(work(name + "/meta.json")) << meta;
  return dir;
}

std::vector<float> floats_of(std::string const& path) {
  return floats(read(path));
}

}  // namespace

TEST_CASE("cli: compress --dump compresses every layer, with pyramid_kv's layer budgets on the schedule",
          "[tools][cli][allocator][dump]") {
  Index const L = 4, N = 100;
  std::string const dump = make_dump("dump4", L, N);
  auto compress = [&](std::string const& args, std::string const& out) {
    auto const r = run("compress " + args + " --dump " + dump + " --out-dir " + work(out) + " --time");
    INFO(args << "\n" << r.output);
    REQUIRE(r.code == 0);
    return r.output;
  };
  auto layer_counts = [&](std::string const& out, Index l) {
    return ints(read(work(out) + "/layer" + std::to_string(l) + "/counts.npy"));
  };
  // The authors' schedule (original_baselines.md 6.6: N = 100, C = 30, w = 4, beta = 5, L = 4): 51, 37, 23, 9,
  // each head the same (top-k), the window's 4 tokens on top.
  auto text = compress("--policy knorm --budget 30 --allocator pyramid_kv --param window_size=4 --param beta=5", "py");
  std::int64_t const authors[] = {51, 37, 23, 9};
  long long ragged = 0, padded = 0;
  for (Index l = 0; l < L; ++l) {
    std::string const ld = work("py") + "/layer" + std::to_string(l);
    CHECK(layer_counts("py", l) == std::vector<std::int64_t>(2, authors[l]));
    auto const idx = ints(read(ld + "/indices.npy"));
    for (Index t = 0; t < 4; ++t)
      CHECK(idx[static_cast<std::size_t>(authors[l] - 4 + t)] == N - 4 + t);
    std::string const lw = "dump4/layer" + std::to_string(l);
    auto const lines = lines_with(text, "\"layer\":" + std::to_string(l) + ",");
    REQUIRE(lines.size() == 1);
    CHECK(contains(lines[0], "\"allocator\":\"pyramid_kv\",\"layer\":" + std::to_string(l) + ",\"seconds\""));
    check_store(ld, floats_of(work(lw + "/keys.npy")), floats_of(work(lw + "/values.npy")), {1, 2, N, 8}, 8, true,
                lines[0]);
    ragged += json_int(lines[0], "ragged_bytes");
    padded += json_int(lines[0], "padded_bytes");
  }
  // The total: one line with "layers", the sums (row = 16 floats).
  auto const total = lines_with(text, "\"layers\":4");
  REQUIRE(total.size() == 1);
  CHECK(json_int(total[0], "ragged_bytes") == ragged);
  CHECK(ragged == (51 + 37 + 23 + 9) * 2 * 64);
  CHECK(json_int(total[0], "padded_bytes") == padded);
  CHECK(json_int(total[0], "input_bytes") == L * 2 * N * 64);
  CHECK(json_int(total[0], "kept_tokens") == (51 + 37 + 23 + 9) * 2);

  // kvpress's schedule (6.6: N = 100, kept 30 (r = 0.7), w = 4, beta = 5, L = 4): 54, 38, 22, 6; mean 30.
  compress(
      "--policy snap_kv --ratio 0.7 --allocator pyramid_kv --param reference=kvpress --param window_size=4 "
      "--param beta=5",
      "pk");
  std::int64_t const kvpress[] = {54, 38, 22, 6};
  for (Index l = 0; l < L; ++l)
    CHECK(layer_counts("pk", l) == std::vector<std::int64_t>(2, kvpress[l]));

  // Each layer is the job `--keys/--values/--queries` of its files would be, with meta.json's RoPE; post-RoPE
  // queries (queries=post_rope) come from queries.npy.
  compress("--policy snap_kv --budget 20 --param window_size=8", "plain");
  compress("--policy snap_kv --budget 20 --param window_size=8 --param queries=post_rope", "post");
  compress("--policy snap_kv --budget 20 --allocator pyramid_kv+ada_kv", "both");
  for (Index l = 0; l < L; ++l) {
    std::string const lw = work("dump4/layer" + std::to_string(l)),
                      kv = " --keys " + lw + "/keys.npy --values " + lw + "/values.npy";
    std::string const layer = "/layer" + std::to_string(l);
    REQUIRE(run("compress --policy snap_kv --budget 20 --param window_size=8" + kv + " --queries " + lw +
                "/queries_prerope.npy --rope theta=500000,style=interleaved --out-dir " + work("one"))
                .code == 0);
    CHECK(file_bytes(work("one/indices.npy")) == file_bytes(work("plain") + layer + "/indices.npy"));
    CHECK(!std::filesystem::exists(work("plain") + layer + "/offsets.npy"));  // no allocator: no ragged store
    REQUIRE(run("compress --policy snap_kv --budget 20 --param window_size=8 --param queries=post_rope" + kv +
                " --queries " + lw + "/queries.npy --out-dir " + work("one"))
                .code == 0);
    CHECK(file_bytes(work("one/indices.npy")) == file_bytes(work("post") + layer + "/indices.npy"));
    // pyramid_kv+ada_kv: layer l of 4 (set by --dump) is what --param layer=l --param num_layers=4 gives.
    REQUIRE(run("compress --policy snap_kv --budget 20 --allocator pyramid_kv+ada_kv --param layer=" +
                std::to_string(l) + " --param num_layers=4" + kv + " --queries " + lw +
                "/queries_prerope.npy --rope theta=500000,style=interleaved --out-dir " + work("one"))
                .code == 0);
    for (char const* f : {"/indices.npy", "/counts.npy", "/ragged_keys.npy", "/ragged_values.npy", "/offsets.npy"})
      CHECK(file_bytes(work("one") + f) == file_bytes(work("both") + layer + f));
  }
}

TEST_CASE("cli: allocator and --dump errors exit 2 or 3 naming the option, the file or the field",
          "[tools][cli][allocator][dump]") {
  WindowFiles const f("alloc_err");
  auto expect = [](int code, std::string const& args, std::vector<std::string> const& needles) {
    auto const r = run(args);
    INFO(args << "\n" << r.output);
    CHECK(r.code == code);
    for (auto const& n : needles)
      CHECK(contains(r.output, n));
  };
  std::string const knorm = "compress --policy knorm --budget 10" + f.kv() + " --out-dir " + f.out("d");
  // Usage (exit 2).
  expect(2, knorm + " --allocator foo", {"--allocator 'foo': unknown allocator 'foo'", "usage: kvc compress"});
  expect(2, knorm + " --allocator ada_kv+ada_kv", {"allocator 'ada_kv' named twice"});
  expect(2, knorm + " --allocator ada_kv --allocator pyramid_kv", {"--allocator given twice"});
  expect(2, knorm + " --param alpha_safeguard=0.3", {"'alpha_safeguard' is not a parameter of policy knorm"});
  expect(2, knorm + " --allocator ada_kv --param beta=4", {"'beta' is not a parameter of policy knorm"});
  expect(2, "score --policy knorm --allocator ada_kv --keys " + f.keys + " --out " + f.out("x.npy"),
         {"--allocator is not an option of `kvc score`"});
  expect(2, knorm + " --ratio 0.5 --allocator pyramid_kv", {"exactly one of --ratio and --budget"});
  expect(2, knorm + " --allocator pyramid_kv --param reference=kvpress",
         {"pyramid_kv with reference=kvpress schedules from a ratio: use --ratio, not --budget"});
  std::string const dump = make_dump("dump_err", 3, 40);
  std::string const on_dump = "compress --policy knorm --budget 10 --dump " + dump + " --out-dir " + f.out("dd");
  expect(2, on_dump + " --keys " + f.keys, {"--keys given with --dump"});
  expect(2, on_dump + " --rope theta=10000", {"--rope given with --dump"});
  expect(2, on_dump + " --allocator pyramid_kv --param layer=1", {"--param layer given with --dump"});
  expect(2, on_dump + " --allocator pyramid_kv --param num_layers=3", {"--param num_layers given with --dump"});
  expect(2, "compress --policy knorm --budget 10 --keys " + f.keys + " --out-dir " + f.out("d"),
         {"compress needs --policy, --out-dir, and --keys and --values or --dump"});
  // Invalid input (exit 3).
  expect(3, knorm + " --allocator pyramid_kv --param layer=4 --param num_layers=4",
         {"policy pyramid_kv: PyramidKVBudget: need num_layers >= 1 and layer in [0, num_layers)"});
  expect(3, knorm + " --allocator ada_kv --param alpha_safeguard=1.5", {"--param alpha_safeguard = '1.5'"});
  expect(3, knorm + " --allocator pyramid_kv --param beta=0", {"--param beta = 0: expected an integer >= 1"});
  expect(3, knorm + " --allocator ada_kv --param reference=both", {"--param reference = 'both'"});
  expect(3, "compress --policy knorm --budget 10 --dump " + work("no_such_dump") + " --out-dir " + f.out("dd"),
         {"--dump " + work("no_such_dump") + ": " + work("no_such_dump") + "/meta.json: ", "kvc-eval dump"});
  make_dump("dump_bad_json", 1, 40, "{\"layers\": 1,");
  expect(3, "compress --policy knorm --budget 10 --dump " + work("dump_bad_json") + " --out-dir " + f.out("dd"),
         {"dump_bad_json/meta.json: not JSON"});
  make_dump("dump_no_layers", 1, 40, "{\"tokens\": 40}");
  expect(3, "compress --policy knorm --budget 10 --dump " + work("dump_no_layers") + " --out-dir " + f.out("dd"),
         {"dump_no_layers/meta.json: field 'layers' is missing"});
  make_dump("dump_no_rope", 2, 40, "{\"layers\": 2}");
  expect(3, "compress --policy snap_kv --budget 10 --dump " + work("dump_no_rope") + " --out-dir " + f.out("dd"),
         {"dump_no_rope/meta.json: field 'rope' is missing", "queries=post_rope"});
  CHECK(run("compress --policy knorm --budget 10 --dump " + work("dump_no_rope") + " --out-dir " + f.out("dd")).code ==
        0);  // a policy that reads no queries needs no RoPE
  make_dump("dump_scaled", 2, 40,
            "{\"layers\": 2, \"rope\": {\"theta\": 10000, \"style\": \"neox\", \"scaled\": true}}");
  expect(3, "compress --policy snap_kv --budget 10 --dump " + work("dump_scaled") + " --out-dir " + f.out("dd"),
         {"field 'rope.scaled' is true", "--param queries=post_rope"});
  CHECK(run("compress --policy snap_kv --budget 10 --param queries=post_rope --dump " + work("dump_scaled") +
            " --out-dir " + f.out("dd"))
            .code == 0);
  make_dump("dump_bad_rope", 2, 40, "{\"layers\": 2, \"rope\": {\"theta\": 10000, \"style\": \"gptj\"}}");
  expect(3, "compress --policy snap_kv --budget 10 --dump " + work("dump_bad_rope") + " --out-dir " + f.out("dd"),
         {"field 'rope.style'"});
  // meta.json lists more layers than the folder has.
  make_dump("dump_short", 2, 40, "{\"layers\": 3}");
  expect(3, "compress --policy knorm --budget 10 --dump " + work("dump_short") + " --out-dir " + f.out("dd"),
         {"dump_short/layer2/keys.npy: No such file or directory", "lists 3 layers; layer 2 has no keys.npy"});
  std::filesystem::remove(work("dump_err/layer1/queries_prerope.npy"));
  expect(3, "compress --policy tova --budget 10 --dump " + dump + " --out-dir " + f.out("dd"),
         {"layer 1 has no queries_prerope.npy"});
  // Layers of another shape: against meta.json's sizes, or layer 0's when meta.json has none. Nothing is written.
  auto const other = [](Index l, Index n) { return l == 2 ? n - 10 : n; };
  make_dump("dump_mixed", 3, 40, "", other);
  std::filesystem::remove_all(f.out("mixed_out"));
  expect(3, "compress --policy knorm --budget 10 --dump " + work("dump_mixed") + " --out-dir " + f.out("mixed_out"),
         {"keys file " + work("dump_mixed") + "/layer2/keys.npy: field 'shape': tokens (shape[2]) is 30, expected " +
          work("dump_mixed") + "/meta.json's tokens 40"});
  CHECK(!std::filesystem::exists(f.out("mixed_out")));
  make_dump("dump_mixed2", 3, 40, "{\"layers\": 3}", other);
  expect(3,
         "compress --policy knorm --budget 10 --allocator ada_kv --dump " + work("dump_mixed2") + " --out-dir " +
             f.out("mixed_out"),
         {"layer2/keys.npy: field 'shape' is (1, 2, 30, 8), expected layer 0's (1, 2, 40, 8)"});
  CHECK(!std::filesystem::exists(f.out("mixed_out")));
  // The outputs may not replace the dump's own files.
  expect(3, "compress --policy knorm --budget 10 --dump " + dump + " --out-dir " + dump,
         {"output file " + dump + "/layer0/keys.npy is the same file as --dump input " + dump + "/layer0/keys.npy"});
}

// ---------------------------------------------------------------------------------------------------------------
// MomentKV: compress --policy moment_kv (the kept cache and the moments of the evicted sets), score with empty
// moments, and kvc attend (plain and corrected). The values themselves are checked against NumPy by check_cli.py.

namespace {

/// The moments of head `bh`'s evicted slots (those not in `kept`), in double: (n, k_mean, v_mean, C [dv, dk]).
struct RefMoments {
  std::int64_t n = 0;
  std::vector<double> km, vm, c;
};

RefMoments evicted_moments(std::vector<float> const& k, std::vector<float> const& v, Index bh, Index n, Index dk,
                           Index dv, std::vector<std::int64_t> const& kept) {
  RefMoments m;
  m.km.assign(static_cast<std::size_t>(dk), 0.0);
  m.vm.assign(static_cast<std::size_t>(dv), 0.0);
  m.c.assign(static_cast<std::size_t>(dv * dk), 0.0);
  std::vector<Index> ev;
  for (Index t = 0; t < n; ++t)
    if (std::find(kept.begin(), kept.end(), t) == kept.end())
      ev.push_back(t);
  m.n = static_cast<std::int64_t>(ev.size());
  auto kat = [&](Index t, Index x) { return static_cast<double>(k[static_cast<std::size_t>((bh * n + t) * dk + x)]); };
  auto vat = [&](Index t, Index a) { return static_cast<double>(v[static_cast<std::size_t>((bh * n + t) * dv + a)]); };
  for (Index t : ev) {
    for (Index x = 0; x < dk; ++x)
      m.km[static_cast<std::size_t>(x)] += kat(t, x) / static_cast<double>(ev.size());
    for (Index a = 0; a < dv; ++a)
      m.vm[static_cast<std::size_t>(a)] += vat(t, a) / static_cast<double>(ev.size());
  }
  for (Index t : ev)
    for (Index a = 0; a < dv; ++a)
      for (Index x = 0; x < dk; ++x)
        m.c[static_cast<std::size_t>(a * dk + x)] +=
            (vat(t, a) - m.vm[static_cast<std::size_t>(a)]) * (kat(t, x) - m.km[static_cast<std::size_t>(x)]);
  return m;
}

double max_abs_diff(std::vector<float> const& a, std::vector<double> const& b) {
  REQUIRE(a.size() == b.size());
  double e = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    e = std::max(e, std::abs(static_cast<double>(a[i]) - b[i]));
  return e;
}

std::vector<float> halves(kvc::NpyArray const& a) {
  std::vector<float> out;
  for (Index i = 0; i < a.size(); ++i)
    out.push_back(kvc::to_float(a.as<kvc::half>()[i]));
  return out;
}

char const* const moment_files[] = {"moment_count.npy", "moment_key_mean.npy", "moment_value_mean.npy",
                                    "moment_comoment.npy"};

}  // namespace

TEST_CASE("cli: compress --policy moment_kv writes the kept cache and the moments of each head's evicted set",
          "[tools][cli][moment_kv]") {
  WindowFiles const f("mkv");
  std::string const base =
      "compress --policy moment_kv --budget 12 --param n_recent=4" + f.kv() + " --queries " + f.queries + " --out-dir ";
  auto const r = run(base + f.out("o") + " --time");
  INFO(r.output);
  REQUIRE(r.code == 0);
  Index const n = WindowFiles::n, dk = 4, dv = 4;
  auto const keys = floats_of(f.keys), values = floats_of(f.values);
  auto const counts = ints(read(f.out("o/counts.npy")));
  auto const idx = read(f.out("o/indices.npy"));
  CHECK(counts == std::vector<std::int64_t>{12, 12});
  REQUIRE(idx.shape == std::vector<Index>{1, 2, 12});
  auto const count = read(f.out("o/moment_count.npy"));
  CHECK(count.dtype == kvc::NpyDtype::i64);
  CHECK(count.shape == std::vector<Index>{1, 2});
  CHECK(ints(count) == std::vector<std::int64_t>{28, 28});
  auto const km = read(f.out("o/moment_key_mean.npy")), vm = read(f.out("o/moment_value_mean.npy")),
             cm = read(f.out("o/moment_comoment.npy"));
  CHECK(km.dtype == kvc::NpyDtype::f32);
  CHECK(km.shape == std::vector<Index>{1, 2, dk});
  CHECK(vm.shape == std::vector<Index>{1, 2, dv});
  CHECK(cm.shape == std::vector<Index>{1, 2, dv, dk});
  auto const kk = floats_of(f.out("o/keys.npy"));
  auto const all_kept = ints(idx);
  for (Index h = 0; h < 2; ++h) {
    std::vector<std::int64_t> const kept(all_kept.begin() + h * 12, all_kept.begin() + (h + 1) * 12);
    CHECK(kept.front() == 0);  // the sink
    for (Index t = 0; t < 4; ++t)
      CHECK(kept[static_cast<std::size_t>(8 + t)] == n - 4 + t);  // the recent window
    for (Index j = 0; j < 12; ++j)                                // keys.npy holds the kept rows
      for (Index x = 0; x < dk; ++x)
        CHECK(kk[static_cast<std::size_t>((h * 12 + j) * dk + x)] ==
              keys[static_cast<std::size_t>((h * n + kept[static_cast<std::size_t>(j)]) * dk + x)]);
    RefMoments const ref = evicted_moments(keys, values, h, n, dk, dv, kept);
    CHECK(ref.n == 28);
    auto part = [](std::vector<float> const& all, Index h_, Index size) {
      return std::vector<float>(all.begin() + h_ * size, all.begin() + (h_ + 1) * size);
    };
    CHECK(max_abs_diff(part(floats(km), h, dk), ref.km) < 1e-5);
    CHECK(max_abs_diff(part(floats(vm), h, dv), ref.vm) < 1e-5);
    CHECK(max_abs_diff(part(floats(cm), h, dv * dk), ref.c) < 1e-4);
  }
  // --time: the moments' memory beside the kept cache's: per head (16 + 4 + 4) fp32 + the 8-byte count.
  auto const line = lines_with(r.output, "\"command\":\"compress\"");
  REQUIRE(line.size() == 1);
  CHECK(json_int(line[0], "moment_head_bytes") == 104);
  CHECK(json_int(line[0], "moment_bytes") == 208);
  CHECK(json_int(line[0], "ragged_bytes") == 24 * 32);
  CHECK(json_real(line[0], "moment_ratio") == Approx(208.0 / 768).epsilon(1e-12));
  CHECK(!contains(line[0], "select_seconds"));  // the selection is inside the rounds

  // --threads changes nothing; storage fp16 writes float16 moments (the same kept set here), bf16 float32.
  REQUIRE(run(base + f.out("t2") + " --threads 2").code == 0);
  for (char const* name : {"indices.npy", "keys.npy", "moment_comoment.npy", "moment_count.npy"})
    CHECK(file_bytes(f.out("o/") + name) == file_bytes(f.out("t2/") + name));
  REQUIRE(run(base + f.out("f16") + " --param storage=fp16 --time").code == 0);
  auto const cm16 = read(f.out("f16/moment_comoment.npy"));
  CHECK(cm16.dtype == kvc::NpyDtype::f16);
  CHECK(cm16.shape == cm.shape);
  auto const c32 = floats(cm), c16 = halves(cm16);
  for (std::size_t i = 0; i < c32.size(); ++i)
    CHECK(std::abs(c32[i] - c16[i]) <= 2e-2f * std::max(1.0f, std::abs(c32[i])));
  REQUIRE(run(base + f.out("bf16") + " --param storage=bf16").code == 0);
  CHECK(read(f.out("bf16/moment_key_mean.npy")).dtype == kvc::NpyDtype::f32);

  // mi=false: the base score's selection, the moments of what it evicted; prefill_rounds=1 differs from 8 only in
  // the set (the counts stay the budget's).
  REQUIRE(run(base + f.out("nc") + " --param mi=false").code == 0);
  CHECK(ints(read(f.out("nc/moment_count.npy"))) == std::vector<std::int64_t>{28, 28});
  REQUIRE(run(base + f.out("r1") + " --param prefill_rounds=1").code == 0);
  CHECK(ints(read(f.out("r1/counts.npy"))) == std::vector<std::int64_t>{12, 12});

  // With an allocator: the ragged store and the moments, eleven files; counts and moments add up per head.
  REQUIRE(run(base + f.out("ada") + " --allocator ada_kv").code == 0);
  auto const ac = ints(read(f.out("ada/counts.npy"))), an = ints(read(f.out("ada/moment_count.npy")));
  for (std::size_t h = 0; h < 2; ++h)
    CHECK(ac[h] + an[h] == n);
  for (char const* name : {"ragged_keys.npy", "offsets.npy", "moment_comoment.npy"})
    CHECK(std::filesystem::exists(f.out("ada/") + name));
}

TEST_CASE("cli: compress --policy moment_kv --dump writes each layer's moments, and the total memory line",
          "[tools][cli][moment_kv][dump]") {
  std::string const dump = make_dump("mkv_dump", 2, 48);
  auto const r = run("compress --policy moment_kv --budget 16 --param window_size=8 --param n_recent=8 --dump " + dump +
                     " --out-dir " + work("mkv_dump_out") + " --time");
  INFO(r.output);
  REQUIRE(r.code == 0);
  for (Index l = 0; l < 2; ++l) {
    std::string const ld = work("mkv_dump_out/layer" + std::to_string(l) + "/");
    CHECK(ints(read(ld + "moment_count.npy")) == std::vector<std::int64_t>{32, 32});
    CHECK(read(ld + "moment_comoment.npy").shape == std::vector<Index>{1, 2, 8, 8});
    // The layer is the single-file job with meta.json's RoPE.
    std::string const lw = work("mkv_dump/layer" + std::to_string(l));
    REQUIRE(run("compress --policy moment_kv --budget 16 --param window_size=8 --param n_recent=8 --keys " + lw +
                "/keys.npy --values " + lw + "/values.npy --queries " + lw +
                "/queries_prerope.npy --rope theta=500000,style=interleaved --out-dir " + work("mkv_one"))
                .code == 0);
    for (char const* name : {"indices.npy", "moment_comoment.npy"})
      CHECK(file_bytes(work("mkv_one/") + name) == file_bytes(ld + name));
  }
  auto const total = lines_with(r.output, "\"layers\":2");
  REQUIRE(total.size() == 1);
  CHECK(json_int(total[0], "moment_bytes") == 2 * 2 * ((64 + 16) * 4 + 8));
}

TEST_CASE("cli: score --policy moment_kv writes the base score times the value norms (empty moments)",
          "[tools][cli][moment_kv]") {
  WindowFiles const f("mkv_score");
  REQUIRE(run("score --policy moment_kv" + f.kq() + " --values " + f.values + " --out " + f.out("mi.npy")).code == 0);
  REQUIRE(run("score --policy moment_kv --param mi=false" + f.kq() + " --out " + f.out("base.npy")).code == 0);
  auto const mi = floats_of(f.out("mi.npy")), base = floats_of(f.out("base.npy")), v = floats_of(f.values);
  REQUIRE(mi.size() == 80);
  for (std::size_t i = 0; i < mi.size(); ++i) {
    double norm = 0;
    for (std::size_t a = 0; a < 4; ++a)
      norm += static_cast<double>(v[i * 4 + a]) * v[i * 4 + a];
    CHECK(std::abs(mi[i] - base[i] * std::sqrt(norm)) <= 1e-5 * std::max(1.0, std::abs(static_cast<double>(mi[i]))));
  }
  // The storage does not change scores before any eviction; --values is needed unless mi=false.
  REQUIRE(run("score --policy moment_kv --param storage=fp16" + f.kq() + " --values " + f.values + " --out " +
              f.out("mi16.npy"))
              .code == 0);
  CHECK(file_bytes(f.out("mi.npy")) == file_bytes(f.out("mi16.npy")));
  auto const r = run("score --policy moment_kv" + f.kq() + " --out " + f.out("x.npy"));
  CHECK(r.code == 2);
  CHECK(contains(r.output, "policy moment_kv weights scores by the norms of the values' residuals: pass --values"));
  auto const s = run("score --policy moment_kv --param n_recent=3" + f.kq() + " --values " + f.values + " --out " +
                     f.out("x.npy"));
  CHECK(s.code == 2);
  CHECK(contains(s.output, "'n_recent' of policy moment_kv"));
}

TEST_CASE("cli: moment_kv's bad parameters and inputs exit 3 or 2 and write nothing", "[tools][cli][moment_kv]") {
  WindowFiles const f("mkv_bad");
  std::filesystem::remove_all(f.out("bad"));
  std::string const args = " --budget 12 --param n_recent=4" + f.kv() + " --queries " + f.queries + " --out-dir ";
  auto expect = [&](int code, std::string const& extra, std::string const& needle) {
    auto const r = run("compress --policy moment_kv" + args + f.out("bad") + " " + extra);
    INFO(extra << "\n" << r.output);
    CHECK(r.code == code);
    CHECK(contains(r.output, needle));
    CHECK(!std::filesystem::exists(f.out("bad")));
  };
  expect(3, "--param storage=fp8", "--param storage = 'fp8': expected fp32, fp16 or bf16");
  expect(3, "--param prefill_rounds=0", "--param prefill_rounds = 0: expected an integer >= 1");
  expect(3, "--param pooling=max", "pooling=max needs an odd kernel_size");
  expect(3, "--param order=third", "--param order = 'third'");
  expect(3, "--param clamp_tau=-1", "--param clamp_tau = '-1'");
  expect(3, "--param window_size=33", "policy moment_kv reads the last 33 query rows");
  expect(2, "--param bogus=1", "'bogus' is not a parameter of policy moment_kv");
  expect(2, "--rope theta=1e4 --param queries=post_rope", "--rope given, but --param queries=post_rope");
  // Values too large for the co-moment in 16 bits: refused, naming the files and the way out.
  std::vector<float> big = randoms(2 * 40 * 4, 3);
  for (float& x : big)
    x *= 50000.0f;
  auto const v = write_npy("mkv_bad_big.npy", kvc::NpyDtype::f32, {1, 2, 40, 4}, big);
  auto const r = run("compress --policy moment_kv --budget 12 --param n_recent=4 --param storage=fp16 --keys " +
                     f.keys + " --values " + v + " --queries " + f.queries + " --out-dir " + f.out("bad"));
  INFO(r.output);
  CHECK(r.code == 3);
  CHECK(contains(r.output, "are not finite in fp16"));
  CHECK(contains(r.output, "try --param storage=fp32"));
  CHECK(!std::filesystem::exists(f.out("bad")));
}

TEST_CASE("cli: attend writes plain and corrected attention over a compressed cache", "[tools][cli][moment_kv]") {
  WindowFiles const f("att");
  REQUIRE(run("compress --policy moment_kv --budget 12 --param n_recent=4" + f.kv() + " --queries " + f.queries +
              " --out-dir " + f.out("c"))
              .code == 0);
  std::string const c = f.out("c/");
  auto const dq = write_npy("att_dq.npy", kvc::NpyDtype::f32, {1, 4, 3, 4}, randoms(48, 11));
  auto const dp = write_npy("att_dp.npy", kvc::NpyDtype::i64, {1, 3}, std::vector<std::int64_t>{40, 41, 42});
  std::string const cache = " --keys " + c + "keys.npy --values " + c + "values.npy --indices " + c + "indices.npy";
  std::string const q = " --queries " + dq + " --positions " + dp;
  auto const r = run("attend" + cache + q + " --moments " + f.out("c") + " --out-dir " + f.out("a") + " --time");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(r.output.rfind("{\"command\":\"attend\",\"seconds\":", 0) == 0);
  CHECK(contains(r.output, "\"corrected_seconds\":"));
  CHECK(json_int(r.output, "moment_bytes") == 208);
  auto const out = read(f.out("a/out.npy")), lse = read(f.out("a/lse.npy"));
  CHECK(out.dtype == kvc::NpyDtype::f32);
  CHECK(out.shape == std::vector<Index>{1, 4, 3, 4});
  CHECK(lse.shape == std::vector<Index>{1, 4, 3});
  auto const plain = floats_of(f.out("a/plain_out.npy")), plain_lse = floats_of(f.out("a/plain_lse.npy"));
  // The evicted set adds mass: lse = logaddexp(lse_R, lse_E) > lse_R, and the output moves.
  for (std::size_t i = 0; i < plain_lse.size(); ++i)
    CHECK(floats(lse)[i] > plain_lse[i]);
  CHECK(floats(out) != plain);
  // Without --moments: kvc::attend alone, out.npy and lse.npy are the plain ones; no other file.
  REQUIRE(run("attend" + cache + q + " --out-dir " + f.out("p")).code == 0);
  CHECK(floats_of(f.out("p/out.npy")) == plain);
  CHECK(floats_of(f.out("p/lse.npy")) == plain_lse);
  CHECK(!std::filesystem::exists(f.out("p/plain_out.npy")));
  // Nothing evicted (count 0 everywhere): the corrected attention is the plain one.
  REQUIRE(run("compress --policy moment_kv --budget 40 --param n_recent=4" + f.kv() + " --queries " + f.queries +
              " --out-dir " + f.out("full"))
              .code == 0);
  CHECK(ints(read(f.out("full/moment_count.npy"))) == std::vector<std::int64_t>{0, 0});
  REQUIRE(run("attend --keys " + f.keys + " --values " + f.values + q + " --moments " + f.out("full") + " --out-dir " +
              f.out("z"))
              .code == 0);
  CHECK(floats_of(f.out("z/out.npy")) == floats_of(f.out("z/plain_out.npy")));
  // order=zeroth differs from first; the clamp at a huge tau is the zeroth order; float16 moments read back.
  REQUIRE(
      run("attend" + cache + q + " --moments " + f.out("c") + " --param order=zeroth --out-dir " + f.out("z0")).code ==
      0);
  REQUIRE(run("attend" + cache + q + " --moments " + f.out("c") + " --param clamp_tau=1e30 --out-dir " + f.out("zt"))
              .code == 0);
  CHECK(floats_of(f.out("z0/out.npy")) != floats(out));
  auto const z0 = floats_of(f.out("z0/out.npy")), zt = floats_of(f.out("zt/out.npy"));
  for (std::size_t i = 0; i < z0.size(); ++i)
    CHECK(std::abs(z0[i] - zt[i]) <= 1e-6f);
  REQUIRE(run("compress --policy moment_kv --budget 12 --param n_recent=4 --param storage=fp16" + f.kv() +
              " --queries " + f.queries + " --out-dir " + f.out("c16"))
              .code == 0);
  REQUIRE(run("attend --keys " + f.out("c16/keys.npy") + " --values " + f.out("c16/values.npy") + " --indices " +
              f.out("c16/indices.npy") + q + " --moments " + f.out("c16") + " --out-dir " + f.out("a16"))
              .code == 0);
  // Pre-RoPE queries: --rope rotates them to their positions (the same as rotating them first is checked by
  // check_cli.py); default positions are the cache's last ones (indices' last + 1 - n + i), here 37 .. 39.
  REQUIRE(run("attend" + cache + " --queries " + dq + " --rope theta=10000 --out-dir " + f.out("r")).code == 0);
  auto const pos = write_npy("att_pos.npy", kvc::NpyDtype::i64, {1, 3}, std::vector<std::int64_t>{37, 38, 39});
  REQUIRE(run("attend" + cache + " --queries " + dq + " --positions " + pos + " --param queries=pre_rope --out-dir " +
              f.out("r2"))
              .code == 0);
  CHECK(file_bytes(f.out("r/out.npy")) == file_bytes(f.out("r2/out.npy")));
  CHECK(file_bytes(f.out("r/out.npy")) != file_bytes(f.out("p/out.npy")));
}

TEST_CASE("cli: attend refuses hostile inputs with exit 2 or 3, naming the file, and writes nothing",
          "[tools][cli][moment_kv][hostile]") {
  WindowFiles const f("atth");
  std::filesystem::remove_all(f.out("bad"));
  REQUIRE(run("compress --policy moment_kv --budget 12 --param n_recent=4" + f.kv() + " --queries " + f.queries +
              " --out-dir " + f.out("c"))
              .code == 0);
  std::string const c = f.out("c");
  auto const dq = write_npy("atth_dq.npy", kvc::NpyDtype::f32, {1, 4, 3, 4}, randoms(48, 11));
  std::string const cache =
      " --keys " + c + "/keys.npy --values " + c + "/values.npy --indices " + c + "/indices.npy --queries " + dq;
  auto expect = [&](int code, std::string const& args, std::vector<std::string> const& needles) {
    auto const r = run("attend " + args + " --out-dir " + f.out("bad"));
    INFO(args << "\n" << r.output);
    CHECK(r.code == code);
    for (auto const& n : needles)
      CHECK(contains(r.output, n));
    CHECK(!std::filesystem::exists(f.out("bad")));
  };
  // A moments folder with one file replaced (copied from the good one first).
  auto moments_with = [&](std::string const& name, std::string const& file, std::vector<std::byte> const& bytes) {
    std::string const dir = f.out(name);
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    for (char const* m : moment_files)
      std::filesystem::copy_file(c + "/" + m, dir + "/" + m);
    if (bytes.empty())
      std::filesystem::remove(dir + "/" + file);
    else
      std::ofstream(dir + "/" + file, std::ios::binary)
          .write(reinterpret_cast<char const*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    return " --moments " + dir;
  };
  auto npy = [](kvc::NpyDtype dt, std::vector<Index> shape, auto const& data) {
    return kvc::serialize_npy(dt, shape, data.data());
  };
  expect(3, cache + moments_with("m_missing", "moment_comoment.npy", {}),
         {"moments file " + f.out("m_missing") + "/moment_comoment.npy: cannot open"});
  expect(3, cache + moments_with("m_dk", "moment_key_mean.npy", npy(kvc::NpyDtype::f32, {1, 2, 5}, randoms(10))),
         {"moment_key_mean.npy: field 'shape' is (1, 2, 5), expected [B, Hkv, d_k] = (1, 2, 4)"});
  expect(3, cache + moments_with("m_dv", "moment_comoment.npy", npy(kvc::NpyDtype::f32, {1, 2, 4, 3}, randoms(24))),
         {"moment_comoment.npy: field 'shape' is (1, 2, 4, 3), expected [B, Hkv, d_v, d_k] = (1, 2, 4, 4)"});
  expect(3,
         cache + moments_with("m_heads", "moment_count.npy",
                              npy(kvc::NpyDtype::i64, {1, 3}, std::vector<std::int64_t>{1, 2, 3})),
         {"moment_count.npy: field 'shape' is (1, 3), expected [B, Hkv] = (1, 2)"});
  expect(3,
         cache + moments_with("m_neg", "moment_count.npy",
                              npy(kvc::NpyDtype::i64, {1, 2}, std::vector<std::int64_t>{5, -1})),
         {"the count of head (0, 1) is -1, expected >= 0"});
  expect(3, cache + moments_with("m_cdt", "moment_count.npy", npy(kvc::NpyDtype::f32, {1, 2}, randoms(2))),
         {"moment_count.npy: field 'descr' is <f4, expected '<i8' (int64)"});
  std::vector<kvc::half> h16(32, kvc::half(0.5f));
  expect(3, cache + moments_with("m_mix", "moment_comoment.npy", npy(kvc::NpyDtype::f16, {1, 2, 4, 4}, h16)),
         {"moment_comoment.npy: field 'descr' is <f2, expected <f4", "share one dtype"});
  std::vector<float> nan(32, 0.0f);
  nan[7] = std::numeric_limits<float>::quiet_NaN();
  expect(3, cache + moments_with("m_nan", "moment_comoment.npy", npy(kvc::NpyDtype::f32, {1, 2, 4, 4}, nan)),
         {"moment_comoment.npy: field 'data' holds NaN or Inf (element 7)"});
  std::vector<float> huge(32, 3e38f);
  auto const q3 = write_npy("atth_q3.npy", kvc::NpyDtype::f32, {1, 4, 3, 4}, std::vector<float>(48, 3.0f));
  expect(3,
         " --keys " + c + "/keys.npy --values " + c + "/values.npy --indices " + c + "/indices.npy --queries " + q3 +
             moments_with("m_huge", "moment_comoment.npy", npy(kvc::NpyDtype::f32, {1, 2, 4, 4}, huge)),
         {"the corrected attention output of query [0, 0, 0] is not finite"});
  expect(3, cache + " --moments " + f.out("nothing_here"), {"moment_count.npy: cannot open"});
  // --indices: int64 [B, Hkv, N], ascending then -1.
  auto const idx = ints(read(c + "/indices.npy"));
  auto with_indices = [&](std::string const& name, std::vector<std::int64_t> v, kvc::NpyDtype dt = kvc::NpyDtype::i64) {
    return " --keys " + c + "/keys.npy --values " + c + "/values.npy --queries " + dq + " --indices " +
           write_npy(name, dt, {1, 2, 12}, v);
  };
  auto swapped = idx;
  std::swap(swapped[3], swapped[4]);
  expect(3, with_indices("atth_i1.npy", swapped), {"indices file", "head (0, 0) slot 4", "ascending"});
  auto hole = idx;
  hole[5] = -1;
  expect(3, with_indices("atth_i2.npy", hole), {"slot 6 holds", "expected -1 (padding: the head's count is 5)"});
  expect(3, with_indices("atth_i3.npy", idx, kvc::NpyDtype::f64), {"field 'descr' is <f8, expected '<i8' (int64)"});
  expect(3,
         " --keys " + c + "/keys.npy --values " + c + "/values.npy --queries " + dq + " --indices " + c + "/counts.npy",
         {"expected [B, Hkv, N] = [1, 2, 12]"});
  // The cache and the queries.
  expect(3, " --keys " + c + "/keys.npy --values " + f.values + " --queries " + dq,
         {"values file " + f.values + ": field 'shape' [B, Hkv, N] must equal the keys'"});
  auto const q5 = write_npy("atth_q5.npy", kvc::NpyDtype::f32, {1, 4, 3, 5}, randoms(60));
  expect(3, " --keys " + c + "/keys.npy --values " + c + "/values.npy --queries " + q5,
         {"queries file " + q5 + ": field 'shape': head_dim (shape[3]) is 5, expected the keys' 4"});
  auto const q40 = write_npy("atth_q40.npy", kvc::NpyDtype::f32, {1, 4, 13, 4}, randoms(208));
  expect(3, " --keys " + c + "/keys.npy --values " + c + "/values.npy --queries " + q40,
         {"13 query rows (shape[2])", "ends at position 12 (pass --positions P.npy)"});
  // Parameters and options.
  expect(3, cache + " --moments " + c + " --param order=second",
         {"--param order = 'second': expected first or zeroth"});
  expect(3, cache + " --param scale=2", {"--param scale = '2'"});
  expect(2, cache + " --param order=zeroth", {"--param order sets the correction by the moments: pass --moments DIR"});
  expect(2, cache + " --param window_size=4", {"'window_size' is not a parameter of `kvc attend`"});
  expect(2, cache + " --param scale=0 --param scale=0", {"'scale' given twice"});
  expect(2, cache + " --rope theta=1e4 --param queries=post_rope", {"--rope given, but --param queries=post_rope"});
  expect(2, cache + " --policy moment_kv", {"--policy is not an option of `kvc attend`"});
  expect(2, " --keys " + c + "/keys.npy --queries " + dq, {"attend needs --keys, --values, --queries and --out-dir"});
  // An output that is an input is refused before anything is read.
  auto const r = run("attend" + cache + " --moments " + c + " --out-dir " + c);
  CHECK(r.code == 0);  // out.npy ... do not collide with compress's files
  auto const same = run("attend" + cache + " --out-dir " + f.out("same") + " --keys x");
  CHECK(same.code == 2);
  CHECK(run("attend --help", true).code == 0);
  CHECK(contains(run("attend --help", true).output, "plain_out.npy"));
}

// ---------------------------------------------------------------------------------------------------------------
// uncomp_entropy: UNComp's truncated matrix entropy of each query head's rows, [B, Hq] (spec uncomp.md §2.3, §8).

namespace {

/// Queries [2, 3, 16, 8] whose entropies are known by hand (d = 8, 16 rows per head):
///  head 0: [I; -I] (isotropic: every eigenvalue 1/d, so H_k = (k/d) ln d and Ĥ_k = k/d);
///  head 1: rows +-e0, +-e1 repeated (two equal directions: H_k = ln 2 for k >= 2, Ĥ_k = ln 2 / ln 8 = 1/3);
///  head 2: rows (t + 1) v (rank 1 once centred: H = 0, erank 1).
/// Sequence 1 holds the same heads scaled by 5 and translated by 3 (the entropy does not change).
std::vector<float> entropy_queries() {
  constexpr Index d = 8, n = 16;
  std::vector<float> q(2 * 3 * n * d, 0.0f);
  auto at = [&](Index b, Index h, Index t, Index i) -> float& {
    return q[static_cast<std::size_t>(((b * 3 + h) * n + t) * d + i)];
  };
  for (Index b = 0; b < 2; ++b) {
    float const scale = b == 0 ? 1.0f : 5.0f, shift = b == 0 ? 0.0f : 3.0f;
    for (Index t = 0; t < n; ++t)
      for (Index i = 0; i < d; ++i) {
        at(b, 0, t, i) = shift + scale * (i == t % d ? (t < d ? 1.0f : -1.0f) : 0.0f);
        at(b, 1, t, i) = shift + scale * (i == (t / 2) % 2 ? (t % 2 == 0 ? 1.0f : -1.0f) : 0.0f);
        at(b, 2, t, i) = shift + scale * static_cast<float>((t + 1) * (i + 1));
      }
  }
  return q;
}

std::vector<double> doubles(kvc::NpyArray const& a) {
  return {a.as<double>(), a.as<double>() + a.size()};
}

}  // namespace

TEST_CASE("cli: score --policy uncomp_entropy writes each query head's entropy, known by hand",
          "[tools][cli][uncomp]") {
  auto const q = write_npy("ent_q.npy", kvc::NpyDtype::f32, {2, 3, 16, 8}, entropy_queries());
  std::string const post = "score --policy uncomp_entropy --queries " + q + " --param queries=post_rope";
  double const ln8 = std::log(8.0), third = std::log(2.0) / ln8;
  auto entropies = [&](std::string const& params, std::string const& name) {
    auto const r = run(post + params + " --out " + work(name));
    INFO(params << "\n" << r.output);
    REQUIRE(r.code == 0);
    kvc::NpyArray const a = read(work(name));
    CHECK(a.shape == std::vector<Index>{2, 3});
    return a;
  };
  auto near = [](std::vector<double> const& got, std::vector<double> const& want) {
    REQUIRE(got.size() == want.size());
    for (std::size_t i = 0; i < got.size(); ++i) {
      INFO("element " << i << ": " << got[i] << " vs " << want[i]);
      CHECK(std::abs(got[i] - want[i]) <= 1e-12);
    }
  };
  // Default: top_k=auto is d / 4 = 2 (isotropic: Ĥ_2 = 2/8), Ĥ_k in float64; top_k 32 clamps to d = 8.
  kvc::NpyArray a = entropies("", "ent_default.npy");
  CHECK(a.dtype == kvc::NpyDtype::f64);
  near(doubles(a), {0.25, third, 0.0, 0.25, third, 0.0});
  near(doubles(entropies(" --param top_k=32", "ent_k32.npy")), {1.0, third, 0.0, 1.0, third, 0.0});
  // k = 4: Ĥ_k = k / d for the isotropic head; the two-direction head keeps ln 2.
  near(doubles(entropies(" --param top_k=4", "ent_k4.npy")), {0.5, third, 0.0, 0.5, third, 0.0});
  near(doubles(entropies(" --param top_k=4 --param unit=truncated", "ent_h.npy")),
       {0.5 * ln8, std::log(2.0), 0.0, 0.5 * ln8, std::log(2.0), 0.0});
  near(doubles(entropies(" --param top_k=4 --param unit=erank", "ent_e.npy")),
       {std::exp(0.5 * ln8), 2.0, 1.0, std::exp(0.5 * ln8), 2.0, 1.0});
  // renormalize_topk: the isotropic head's top 4 renormalised give ln 4.
  near(doubles(entropies(" --param top_k=4 --param renormalize_topk=true", "ent_r.npy")),
       {std::log(4.0) / ln8, third, 0.0, std::log(4.0) / ln8, third, 0.0});
  // k = 1: only the largest eigenvalue (1/8 for the isotropic head).
  near(doubles(entropies(" --param top_k=1", "ent_k1.npy")),
       {std::log(8.0) / 8.0 / ln8, 0.5 * std::log(2.0) / ln8, 0.0, std::log(8.0) / 8.0 / ln8, 0.5 * std::log(2.0) / ln8,
        0.0});
  // float32 output: the same values, rounded.
  a = entropies(" --param top_k=4 --param dtype=float32", "ent_f32.npy");
  CHECK(a.dtype == kvc::NpyDtype::f32);
  std::vector<double> const k4 = doubles(read(work("ent_k4.npy")));
  for (std::size_t i = 0; i < 6; ++i)  // the float64 values rounded to float32
    CHECK(a.as<float>()[i] == static_cast<float>(k4[i]));
  // normalize_rows=false (Eq. 1's covariance) agrees on these heads, whose centred rows have equal norms per head.
  near(doubles(entropies(" --param top_k=4 --param normalize_rows=false", "ent_cov.npy")),
       {0.5, third, 0.0, 0.5, third, 0.0});

  // Pre-RoPE queries (the default) are rotated to their positions, 0 .. n - 1 unless --positions says otherwise; a
  // shift of every position rotates all features alike and leaves the entropy unchanged.
  auto const rq = write_npy("ent_rq.npy", kvc::NpyDtype::f32, {1, 4, 24, 8}, randoms(4 * 24 * 8, 9));
  std::vector<std::int64_t> pos(24), shifted(24);
  for (std::size_t i = 0; i < 24; ++i) {
    pos[i] = static_cast<std::int64_t>(i);
    shifted[i] = static_cast<std::int64_t>(i) + 1000;
  }
  std::string const pre = "score --policy uncomp_entropy --queries " + rq;
  REQUIRE(run(pre + " --out " + work("ent_pre.npy")).code == 0);
  REQUIRE(run(pre + " --positions " + write_npy("ent_p.npy", kvc::NpyDtype::i64, {1, 24}, pos) + " --out " +
              work("ent_pre_p.npy"))
              .code == 0);
  REQUIRE(run(pre + " --positions " + write_npy("ent_ps.npy", kvc::NpyDtype::i64, {1, 24}, shifted) + " --out " +
              work("ent_pre_s.npy"))
              .code == 0);
  REQUIRE(run(pre + " --param queries=post_rope --out " + work("ent_post.npy")).code == 0);
  auto const base = doubles(read(work("ent_pre.npy")));
  CHECK(doubles(read(work("ent_pre_p.npy"))) == base);
  std::vector<double> const moved = doubles(read(work("ent_pre_s.npy")));
  for (std::size_t i = 0; i < base.size(); ++i)  // up to the fp32 RoPE table's rounding at positions ~1000
    CHECK(std::abs(moved[i] - base[i]) <= 1e-6);
  CHECK(doubles(read(work("ent_post.npy"))) != base);  // the rotation does change the rows' spectrum
  REQUIRE(run(pre + " --rope theta=500000,style=interleaved --out " + work("ent_il.npy")).code == 0);
  CHECK(doubles(read(work("ent_il.npy"))) != base);
}

TEST_CASE("cli: uncomp_entropy refuses bad parameters and inputs with exit 2 or 3, naming them, writing nothing",
          "[tools][cli][uncomp]") {
  auto const q = write_npy("enth_q.npy", kvc::NpyDtype::f32, {1, 2, 6, 4}, randoms(48, 5));
  std::string const out = work("enth_out.npy");
  std::filesystem::remove(out);
  auto expect = [&](int code, std::string const& args, std::vector<std::string> const& needles) {
    auto const r = run("score --policy uncomp_entropy" + args + " --out " + out);
    INFO(args << "\n" << r.output);
    CHECK(r.code == code);
    for (auto const& n : needles)
      CHECK(contains(r.output, n));
    CHECK_FALSE(std::filesystem::exists(out));
  };
  std::string const qs = " --queries " + q;
  for (auto const& [param, needle] : std::vector<std::pair<std::string, std::string>>{
           {"top_k=0", "--param top_k = 0: expected an integer >= 1"},
           {"top_k=abc", "--param top_k = 'abc': expected an integer"},
           {"top_k=2000000", "--param top_k = 2000000: expected auto or an integer in [1, 2^20]"},
           {"normalize_rows=yes", "--param normalize_rows = 'yes': expected true or false"},
           {"renormalize_topk=1", "--param renormalize_topk = '1': expected true or false"},
           {"ridge=-1", "--param ridge = '-1'"},
           {"ridge=0.9", "--param ridge = '0.9'"},
           {"ridge=nan", "--param ridge = 'nan'"},
           {"unit=bits", "--param unit = 'bits': expected normalized, truncated or erank"},
           {"dtype=int8", "--param dtype = 'int8': expected float64 or float32"},
           {"queries=rotated", "--param queries = 'rotated': expected pre_rope or post_rope"}})
    expect(3, qs + " --param " + param, {needle});
  expect(2, qs + " --param n_sink=1", {"'n_sink' is not a parameter of policy uncomp_entropy"});
  expect(2, qs + " --param window_size=8", {"'window_size' is not a parameter of policy uncomp_entropy"});
  expect(2, qs + " --param top_k=4 --param top_k=8", {"'top_k' given twice"});
  expect(2, qs + " --keys " + q, {"--keys given, but policy uncomp_entropy reads only --queries"});
  expect(2, qs + " --values " + q, {"--values given, but policy uncomp_entropy reads only --queries"});
  expect(2, "", {"score --policy uncomp_entropy needs --queries and --out"});
  expect(2, qs + " --param queries=post_rope --rope theta=10000", {"--rope given, but --param queries=post_rope"});
  // Wrong files: dims, dtype, values, positions, an oversized head dim.
  expect(3, " --queries " + write_npy("enth_3d.npy", kvc::NpyDtype::f32, {2, 6, 4}, randoms(48)),
         {"queries file", "enth_3d.npy", "expected 4 ([batch, query_heads, window, head_dim])"});
  expect(3, " --queries " + write_npy("enth_i.npy", kvc::NpyDtype::i64, {1, 2, 6, 4}, std::vector<std::int64_t>(48)),
         {"enth_i.npy", "field 'descr' is <i8, expected '<f4' (float32) or '<f2' (float16)"});
  expect(3, " --queries " + write_npy("enth_0.npy", kvc::NpyDtype::f32, {1, 0, 6, 4}, std::vector<float>{}),
         {"enth_0.npy", "every dimension must be >= 1"});
  auto nan = randoms(48);
  nan[7] = std::numeric_limits<float>::infinity();
  expect(3, " --queries " + write_npy("enth_nan.npy", kvc::NpyDtype::f32, {1, 2, 6, 4}, nan),
         {"enth_nan.npy", "NaN or Inf (element 7)"});
  expect(3, " --queries " + write_npy("enth_odd.npy", kvc::NpyDtype::f32, {1, 2, 6, 3}, randoms(36)),
         {"enth_odd.npy", "expected an even head_dim"});
  expect(3, " --queries " + write_npy("enth_big.npy", kvc::NpyDtype::f32, {1, 1, 1, 1026}, randoms(1026)),
         {"enth_big.npy", "head_dim (shape[3]) is 1026, expected at most 1024"});
  expect(3,
         qs + " --positions " +
             write_npy("enth_p.npy", kvc::NpyDtype::i64, {1, 5}, std::vector<std::int64_t>{0, 1, 2, 3, 4}),
         {"positions file", "expected [batch, window] = [1, 6]"});
  expect(3,
         qs + " --positions " +
             write_npy("enth_pn.npy", kvc::NpyDtype::i64, {1, 6}, std::vector<std::int64_t>{0, 1, -2, 3, 4, 5}),
         {"positions file", "position -2 (element 2) is negative"});
  expect(3, " --queries " + work("enth_missing.npy"), {"enth_missing.npy", "cannot open"});
  // compress has nothing to keep by a per-head value.
  auto const r = run("compress --policy uncomp_entropy --budget 2 --keys " + q + " --values " + q + " --out-dir " +
                     work("enth_d"));
  CHECK(r.code == 2);
  CHECK(contains(r.output, "policy uncomp_entropy writes per-head values (kvc score), not token scores"));
  CHECK_FALSE(std::filesystem::exists(work("enth_d")));
  // The output may not be the input.
  auto const same = run("score --policy uncomp_entropy --queries " + q + " --out " + q);
  CHECK(same.code == 3);
  CHECK(contains(same.output, "is the same file as --queries"));
}

// ---------------------------------------------------------------------------------------------------------------
// uncomp: per-head budgets from a calibration file's head groups, UNComp's window score (spec uncomp.md §2.6-2.7).

namespace {

/// A calibration of `layers` layers, 4 query heads, 2 KV heads, head dim `d`, M = 2: in every layer KV head 1 (query
/// heads 2 and 3) has the higher entropy (group 0).
std::string write_test_calibration(std::string const& name, Index layers, Index d,
                                   kvc::tools::GroupRule rule = kvc::tools::GroupRule::mean) {
  kvc::tools::Calibration c;
  c.model = "synthetic";
  c.layers = layers;
  c.heads = 4;
  c.kv_heads = 2;
  c.head_dim = d;
  c.samples = 1;
  c.tokens = 64;
  c.text = "built-in";
  c.groups = 2;
  c.rule = rule;
  for (Index l = 0; l < layers; ++l) {
    for (double e : {1.5, 2.0, 3.0, 3.5}) {
      c.erank.push_back(e);
      c.truncated.push_back(std::log(e));
      c.normalized.push_back(std::log(e) / std::log(static_cast<double>(d)));
    }
    c.query_group.insert(c.query_group.end(), {1, 1, 0, 0});
    c.kv_erank.insert(c.kv_erank.end(), {1.75, 3.25});
    c.kv_group.insert(c.kv_group.end(), {1, 0});
    c.layer_score.push_back(2.5);
  }
  std::string const path = work(name);
  kvc::eval::write_calibration(c, path);
  return path;
}

}  // namespace

TEST_CASE("cli: compress --policy uncomp keeps each head's calibrated budget by UNComp's window score",
          "[tools][cli][uncomp]") {
  WindowFiles const f("uncomp");  // keys [1, 2, 40, 4], queries [1, 4, 32, 4]
  std::string const cal = write_test_calibration("uncomp_cal.json", 1, 4);
  std::string const base =
      "compress --policy uncomp --calibration " + cal + " --layer 0" + f.kv() + " --queries " + f.queries;
  auto compress = [&](std::string const& args, std::string const& out) {
    auto const r = run(base + args + " --out-dir " + f.out(out));
    INFO(args << "\n" << r.output);
    REQUIRE(r.code == 0);
    return r.output;
  };
  // Preserving, B = 12, M = 2, step auto = 12 * 74 / 384: N = 12 +- step / 2 = 13.16 and 10.84; the largest remainder
  // rounds the layer's total to 24: KV head 1 (group 0) keeps 13, KV head 0 keeps 11.
  std::string const text = compress(" --budget 12 --time", "b12");
  CHECK(ints(read(f.out("b12/counts.npy"))) == std::vector<std::int64_t>{11, 13});
  CHECK(ints(read(f.out("b12/offsets.npy"))) == std::vector<std::int64_t>{0, 11, 24});
  CHECK(read(f.out("b12/ragged_keys.npy")).shape == std::vector<Index>{24, 4});
  CHECK(read(f.out("b12/keys.npy")).shape == std::vector<Index>{1, 2, 13, 4});
  CHECK(contains(text, "\"ragged_bytes\":768"));          // 24 rows of K + V, 4 floats each
  auto const idx = ints(read(f.out("b12/indices.npy")));  // [1, 2, 13], -1 padding
  for (Index t = 0; t < 8; ++t) {                         // the window (the last 8 tokens) is always kept
    CHECK(idx[static_cast<std::size_t>(3 + t)] == 32 + t);
    CHECK(idx[static_cast<std::size_t>(13 + 5 + t)] == 32 + t);
  }
  CHECK(idx[11] == -1);
  CHECK(idx[12] == -1);
  // --ratio 0.7: B = floor(40 * 0.3) = 12, the same budgets.
  compress(" --ratio 0.7", "r07");
  CHECK(ints(read(f.out("r07/indices.npy"))) == idx);

  // The kept prefix tokens are the top of `kvc score --policy uncomp` (ties to the lower index), and those scores
  // are SnapKV's with the authors' reference, w = 8, max pooling 7 and the GQA group's sum on the prefix.
  REQUIRE(run("score --policy uncomp" + f.kq() + " --out " + f.out("us.npy")).code == 0);
  REQUIRE(
      run("score --policy snap_kv --param window_size=8 --param gqa=sum" + f.kq() + " --out " + f.out("ss.npy")).code ==
      0);
  auto const us = floats(read(f.out("us.npy"))), ss = floats(read(f.out("ss.npy")));
  REQUIRE(us.size() == 80);
  for (Index h = 0; h < 2; ++h) {
    std::vector<Index> order(32);
    for (Index j = 0; j < 32; ++j) {
      order[static_cast<std::size_t>(j)] = j;
      CHECK_THAT(us[static_cast<std::size_t>(h * 40 + j)],
                 Catch::Matchers::WithinRel(ss[static_cast<std::size_t>(h * 40 + j)], 1e-5f));
    }
    std::stable_sort(order.begin(), order.end(), [&](Index a, Index b) {
      return us[static_cast<std::size_t>(h * 40 + a)] > us[static_cast<std::size_t>(h * 40 + b)];
    });
    Index const prefix = h == 0 ? 3 : 5;
    order.resize(static_cast<std::size_t>(prefix));
    std::sort(order.begin(), order.end());
    for (Index i = 0; i < prefix; ++i)
      CHECK(idx[static_cast<std::size_t>(h * 13 + i)] == order[static_cast<std::size_t>(i)]);
  }

  // gqa=expand: the authors' per-query-head caches, each query head with its group's budget (heads 2 and 3: 13).
  std::string const ex = compress(" --budget 12 --param gqa=expand --time", "ex");
  CHECK(ints(read(f.out("ex/counts.npy"))) == std::vector<std::int64_t>{11, 11, 13, 13});
  CHECK(read(f.out("ex/keys.npy")).shape == std::vector<Index>{1, 4, 13, 4});
  CHECK(contains(ex, "\"ragged_bytes\":1536"));  // twice the KV-head store
  auto const keys = floats_of(f.keys), kept = floats(read(f.out("ex/keys.npy")));
  auto const xi = ints(read(f.out("ex/indices.npy")));
  for (Index q = 0; q < 4; ++q)  // query head q holds rows of KV head q / 2
    for (Index i = 0; i < (q < 2 ? 11 : 13); ++i)
      for (Index c = 0; c < 4; ++c)
        CHECK(kept[static_cast<std::size_t>((q * 13 + i) * 4 + c)] ==
              keys[static_cast<std::size_t>(((q / 2) * 40 + xi[static_cast<std::size_t>(q * 13 + i)]) * 4 + c)]);

  // Absolute schedules: an explicit list (the smaller budget raised to the window), the paper's, a preset.
  compress(" --param schedule=list --param list=20/4", "list");
  CHECK(ints(read(f.out("list/counts.npy"))) == std::vector<std::int64_t>{8, 20});
  compress(" --param schedule=paper --param largest=30 --param step=12", "paper");
  CHECK(ints(read(f.out("paper/counts.npy"))) == std::vector<std::int64_t>{18, 30});
  compress(" --param preset=narrow_2", "preset");  // 512 and 256 tokens: everything
  CHECK(ints(read(f.out("preset/counts.npy"))) == std::vector<std::int64_t>{40, 40});
  // groups=1 regroups the (rule mean) calibration: every head B tokens, as uniform SnapKV.
  compress(" --budget 12 --param groups=1", "g1");
  CHECK(ints(read(f.out("g1/counts.npy"))) == std::vector<std::int64_t>{12, 12});
  // A step too large for B: the smaller budget is clamped up to the window (the layer total is then above 2 B).
  compress(" --budget 12 --param step=40", "s40");
  CHECK(ints(read(f.out("s40/counts.npy"))) == std::vector<std::int64_t>{8, 32});
  // step=0: uniform, as groups=1.
  compress(" --budget 12 --param step=0", "s0");
  CHECK(ints(read(f.out("s0/counts.npy"))) == std::vector<std::int64_t>{12, 12});
}

TEST_CASE("cli: compress --policy uncomp --dump takes each layer's groups from the calibration",
          "[tools][cli][uncomp][dump]") {
  std::string const dump = make_dump("uncomp_dump", 2, 30);  // [1, 2, 30, 8], queries [1, 4, 30, 8]
  std::string const cal = write_test_calibration("uncomp_dump_cal.json", 2, 8);
  auto const r = run("compress --policy uncomp --calibration " + cal + " --dump " + dump + " --budget 10 --out-dir " +
                     work("uncomp_dump_out") + " --time");
  INFO(r.output);
  REQUIRE(r.code == 0);
  for (int l = 0; l < 2; ++l)
    CHECK(ints(read(work("uncomp_dump_out/layer" + std::to_string(l) + "/counts.npy"))) ==
          std::vector<std::int64_t>{9, 11});
  CHECK(contains(r.output, "\"layers\":2"));
  // A calibration of three layers does not fit a dump of two.
  auto const bad = run("compress --policy uncomp --calibration " + write_test_calibration("uncomp_cal3.json", 3, 8) +
                       " --dump " + dump + " --budget 10 --out-dir " + work("uncomp_dump_bad"));
  CHECK(bad.code == 3);
  CHECK(contains(bad.output, "field 'layers' is 3, but --dump " + dump + " has 2"));
  CHECK_FALSE(std::filesystem::exists(work("uncomp_dump_bad")));
}

TEST_CASE("cli: compress --policy uncomp refuses what it cannot run with exit 2 or 3, writing nothing",
          "[tools][cli][uncomp]") {
  WindowFiles const f("uncomph");
  std::string const cal = write_test_calibration("uncomph_cal.json", 1, 4);
  std::string const out = f.out("d");
  std::filesystem::remove_all(out);
  auto expect = [&](int code, std::string const& args, std::vector<std::string> const& needles) {
    auto const r = run("compress --policy uncomp" + args + f.kv() + " --queries " + f.queries + " --out-dir " + out);
    INFO(args << "\n" << r.output);
    CHECK(r.code == code);
    for (auto const& n : needles)
      CHECK(contains(r.output, n));
    CHECK_FALSE(std::filesystem::exists(out));
  };
  std::string const c = " --calibration " + cal + " --layer 0";
  expect(2, " --layer 0 --budget 12", {"--policy uncomp needs --calibration FILE"});
  expect(2, " --calibration " + cal + " --budget 12", {"needs --layer L"});
  expect(2, c, {"needs exactly one of --ratio and --budget"});
  expect(2, c + " --budget 12 --ratio 0.5", {"needs exactly one of --ratio and --budget"});
  expect(2, c + " --budget 12 --allocator ada_kv", {"UNComp allocates its own per-head budgets"});
  expect(2, c + " --budget 12 --param stages=true", {"kvc-eval only"});
  expect(2, c + " --budget 12 --param rule=majority_vote", {"the calibration file's rule holds"});
  expect(2, c + " --budget 12 --param preset=wide_2", {"the budgets are absolute; drop --ratio and --budget"});
  expect(2, c + " --budget 12 --param n_sink=2", {"'n_sink' is not a parameter of policy uncomp"});
  expect(3, c + " --budget 12 --param gqa=per_head", {"--param gqa = 'per_head': expected kv_heads or expand"});
  expect(3, c + " --budget 12 --param kernel_size=4", {"--param kernel_size = 4: expected an odd integer"});
  expect(3, c + " --budget 12 --param window_size=0", {"--param window_size = 0: expected an integer >= 1"});
  expect(3, c + " --budget 12 --param step=-1", {"--param step = '-1'"});
  expect(3, c + " --budget 12 --param step=1e10", {"--param step = '1e10'"});
  expect(3, c + " --param schedule=list", {"give the budgets with --param list=N1/N2/... or --param preset=NAME"});
  expect(3, c + " --param schedule=list --param list=10/x", {"--param list (entry 1) = 'x': expected an integer"});
  expect(3, c + " --param schedule=list --param list=10/9/8",
         {"--param list: 3 budgets, but the calibration (" + cal + ") has 2 groups"});
  expect(3, c + " --param preset=tiny", {"--param preset = 'tiny': expected authors_384"});
  expect(3, c + " --budget 12 --param groups=0", {"--param groups = 0: expected an integer >= 1"});
  expect(3, " --calibration " + cal + " --layer 1 --budget 12", {"--layer 1: calibration file", "has 1 layers"});
  expect(3, " --calibration " + work("uncomph_missing.json") + " --layer 0 --budget 12",
         {"calibration file " + work("uncomph_missing.json")});
  std::string const vote = write_test_calibration("uncomph_vote.json", 1, 4, kvc::tools::GroupRule::majority_vote);
  expect(3, " --calibration " + vote + " --layer 0 --budget 12 --param groups=1",
         {"groups by majority vote, which cannot be regrouped"});
  std::string const other = write_test_calibration("uncomph_d8.json", 1, 8);
  expect(3, " --calibration " + other + " --layer 0 --budget 12", {"field 'head_dim' is 8, but keys file"});
  std::ofstream(work("uncomph_bad.json")) << "{\"format\": \"kvc.uncomp.calibration\", \"version\": 1}";
  expect(3, " --calibration " + work("uncomph_bad.json") + " --layer 0 --budget 12", {"field 'model' is missing"});
  // Fewer query rows than the window.
  auto const short_q = write_npy("uncomph_q4.npy", kvc::NpyDtype::f32, {1, 4, 4, 4}, randoms(64, 4));
  auto const few =
      run("compress --policy uncomp" + c + " --budget 12" + f.kv() + " --queries " + short_q + " --out-dir " + out);
  CHECK(few.code == 3);
  CHECK(contains(few.output, "window (shape[2]) is 4, but policy uncomp reads the last 8 query rows"));
  CHECK_FALSE(std::filesystem::exists(out));
  // The calibration belongs to uncomp alone; uncomp_entropy does not compress.
  auto const r = run("compress --policy snap_kv --budget 12 --calibration " + cal + f.kv() + " --queries " + f.queries +
                     " --out-dir " + out);
  CHECK(r.code == 2);
  CHECK(contains(r.output, "--calibration goes with --policy uncomp"));
}

// ---------------------------------------------------------------------------------------------------------------
// RDKV and KIVI: compress writes bit plans (int8 .npy) and measures the packed store; score writes the weights.

TEST_CASE("cli: compress --policy rdkv writes bit plans inside the budget and the packed store's memory",
          "[tools][cli][rdkv]") {
  RDKVFiles const f;
  Index const d = RDKVFiles::d, n = RDKVFiles::n;
  for (Index budget : {0, 4, 10, 25}) {
    auto const r = run("compress --policy rdkv --budget " + std::to_string(budget) + f.in() + " --out-dir " +
                       work("rd_b") + " --time");
    INFO("budget " << budget << "\n" << r.output);
    REQUIRE(r.code == 0);
    Int8Npy const vb = read_int8(work("rd_b/v_bits.npy")), kb = read_int8(work("rd_b/k_bits.npy"));
    REQUIRE(vb.shape == std::vector<Index>{1, 2, n});
    REQUIRE(kb.shape == std::vector<Index>{1, 2, d});
    long long payload = 0, kept = 0;
    for (Index h = 0; h < 2; ++h) {
      long long v_sum = 0, t_eff = 0, k_sum = 0;
      for (Index t = 0; t < n; ++t) {
        int const b = vb.data[static_cast<std::size_t>(h * n + t)];
        CHECK(valid_bits(b));
        v_sum += b;
        t_eff += b > 0;
      }
      for (Index c = 0; c < d; ++c) {
        int const b = kb.data[static_cast<std::size_t>(h * d + c)];
        CHECK(valid_bits(b));
        k_sum += b;
      }
      // Exact mode, rho = 0.5: V gets (1 - rho) 2 B d 16 bits, K rho 2 B d 16, never more.
      CHECK(v_sum * d <= budget * d * 16);
      CHECK(k_sum * t_eff <= budget * d * 16);
      payload += v_sum * d + k_sum * t_eff;  // K at 16 bits is stored lossless: it counts 16
      kept += t_eff;
    }
    CHECK(json_int(r.output, "payload_bits") == payload);
    CHECK(json_int(r.output, "kept_tokens") == kept);
    CHECK(json_int(r.output, "input_tokens") == 2 * n);
    CHECK(json_int(r.output, "tail_tokens") == 0);
    CHECK(json_real(r.output, "retention") == Approx(static_cast<double>(payload) / (2.0 * n * 2 * d * 16)));
    CHECK(json_int(r.output, "packed_bytes") == (payload + 7) / 8 + (json_int(r.output, "overhead_bits") + 7) / 8);
    if (budget > 0)
      CHECK(payload > 0);
    else
      CHECK(payload == 0);  // budget 0: everything evicted
  }
  // --ratio R keeps the memory of floor(N (1 - R)) tokens: 0.75 of 40 is the budget 10.
  REQUIRE(run("compress --policy rdkv --budget 10" + f.in() + " --out-dir " + work("rd_b10")).code == 0);
  REQUIRE(run("compress --policy rdkv --ratio 0.75" + f.in() + " --out-dir " + work("rd_r75")).code == 0);
  for (char const* file : {"/v_bits.npy", "/k_bits.npy"})
    CHECK(file_bytes(work("rd_b10") + file) == file_bytes(work("rd_r75") + file));
  CHECK(!std::filesystem::exists(work("rd_b10/indices.npy")));  // the plans, not a kept set
  // reference=authors (lagrangian, integer zero point, K16 clamped to 8) gives bits from the same set.
  REQUIRE(run("compress --policy rdkv --budget 10 --param reference=authors" + f.in() + " --out-dir " +
              work("rd_auth") + " --time")
              .code == 0);
  for (int b : read_int8(work("rd_auth/v_bits.npy")).data)
    CHECK(valid_bits(b));
}

TEST_CASE("cli: rdkv keeps a short context whole: T <= B gives every token and channel 16 bits", "[tools][cli][rdkv]") {
  RDKVFiles const f;
  Index const d = RDKVFiles::d, n = RDKVFiles::n;
  for (std::string const budget : {"--budget 40", "--budget 100", "--ratio 0"}) {
    auto const r = run("compress --policy rdkv " + budget + f.in() + " --out-dir " + work("rd_all") + " --time");
    INFO(budget << "\n" << r.output);
    REQUIRE(r.code == 0);
    for (int b : read_int8(work("rd_all/v_bits.npy")).data)
      CHECK(b == 16);
    for (int b : read_int8(work("rd_all/k_bits.npy")).data)
      CHECK(b == 16);
    CHECK(json_int(r.output, "payload_bits") == 2 * (n * d * 16 + d * n * 16));
    CHECK(json_real(r.output, "retention") == 1.0);
    CHECK(json_int(r.output, "kept_tokens") == 2 * n);
  }
}

TEST_CASE("cli: compress --policy kivi writes the uniform plan, the residual at 16, and its memory by hand",
          "[tools][cli][rdkv]") {
  RDKVFiles const f;
  Index const d = RDKVFiles::d, n = RDKVFiles::n;
  std::string const kv = " --keys " + f.k + " --values " + f.v;
  for (int bits : {2, 4}) {
    Index const residual = 8, m = n - residual;
    auto const r = run("compress --policy kivi --param bits=" + std::to_string(bits) + " --param residual=8" + kv +
                       " --out-dir " + work("kivi") + " --time");
    INFO(r.output);
    REQUIRE(r.code == 0);
    Int8Npy const vb = read_int8(work("kivi/v_bits.npy")), kb = read_int8(work("kivi/k_bits.npy"));
    REQUIRE(vb.shape == std::vector<Index>{1, 2, n});
    REQUIRE(kb.shape == std::vector<Index>{1, 2, d});
    for (Index h = 0; h < 2; ++h)
      for (Index t = 0; t < n; ++t)
        CHECK(vb.data[static_cast<std::size_t>(h * n + t)] == (t < m ? bits : 16));
    for (int b : kb.data)
      CHECK(b == bits);
    // Per head: m tokens of K and V at `bits`, the 8 newest in fp16 (the tail); overhead: a (scale, offset) pair
    // of fp16 per V token (one group of 32 >= d channels), per K channel and group of 32 tokens (m = 32: one),
    // and a 16-bit permutation entry per channel (d = 8 needs no pads at 2 or 4 bits).
    long long const payload = 2 * (2 * m * d * bits + residual * 2 * d * 16);
    long long const overhead = 2 * (m * 1 * 32 + 1 * d * 32 + d * 16);
    CHECK(json_int(r.output, "payload_bits") == payload);
    CHECK(json_int(r.output, "overhead_bits") == overhead);
    CHECK(json_int(r.output, "tail_tokens") == 2 * residual);
    CHECK(json_int(r.output, "kept_tokens") == 2 * n);
    CHECK(json_int(r.output, "packed_bytes") == (payload + 7) / 8 + (overhead + 7) / 8);
    // The compressor's state reserves room for the packed store (the tail stays in the cache); the prefill is timed
    // as one call.
    CHECK(json_int(r.output, "state_bytes") >= (2 * 2 * m * d * bits + overhead) / 8);
    CHECK(!contains(r.output, "select_seconds"));
  }
  // residual >= N: everything stays fp16, nothing is packed.
  REQUIRE(run("compress --policy kivi" + kv + " --out-dir " + work("kivi_all") + " --time").code == 0);
  for (int b : read_int8(work("kivi_all/v_bits.npy")).data)
    CHECK(b == 16);
  // Its memory is what its bits give: no --ratio or --budget; no allocator.
  auto const r = run("compress --policy kivi --ratio 0.5" + kv + " --out-dir " + work("kivi_r"));
  CHECK(r.code == 2);
  CHECK(contains(r.output, "drop --ratio and --budget"));
  CHECK(run("compress --policy rdkv --budget 4 --allocator ada_kv" + f.in() + " --out-dir " + work("kivi_r")).code ==
        2);
  CHECK(!std::filesystem::exists(work("kivi_r")));
}

TEST_CASE("cli: compress --policy rdkv --dump writes each layer's plans and the total memory line",
          "[tools][cli][rdkv][dump]") {
  Index const L = 2, N = 24;
  std::string const dump = make_dump("rd_dump", L, N);
  auto const r = run("compress --policy rdkv --budget 6 --param window_size=8 --dump " + dump + " --out-dir " +
                     work("rd_dump_out") + " --time");
  INFO(r.output);
  REQUIRE(r.code == 0);
  long long payload = 0;
  for (Index l = 0; l < L; ++l) {
    std::string const ld = work("rd_dump_out/layer" + std::to_string(l));
    CHECK(read_int8(ld + "/v_bits.npy").shape == std::vector<Index>{1, 2, N});
    CHECK(read_int8(ld + "/k_bits.npy").shape == std::vector<Index>{1, 2, 8});
    auto const lines = lines_with(r.output, "\"layer\":" + std::to_string(l) + ",");
    REQUIRE(lines.size() == 1);
    payload += json_int(lines[0], "payload_bits");
    // Each layer is the job of its files with meta.json's RoPE.
    std::string const lw = work("rd_dump/layer" + std::to_string(l));
    REQUIRE(run("compress --policy rdkv --budget 6 --param window_size=8 --keys " + lw + "/keys.npy --values " + lw +
                "/values.npy --queries " + lw + "/queries_prerope.npy --rope theta=500000,style=interleaved " +
                "--out-dir " + work("rd_one"))
                .code == 0);
    for (char const* file : {"/v_bits.npy", "/k_bits.npy"})
      CHECK(file_bytes(work("rd_one") + file) == file_bytes(ld + file));
  }
  auto const total = lines_with(r.output, "\"layers\":2");
  REQUIRE(total.size() == 1);
  CHECK(json_int(total[0], "payload_bits") == payload);
  CHECK(json_int(total[0], "input_tokens") == L * 2 * N);
}

TEST_CASE("cli: score --policy rdkv writes token weights and ThinK channel weights known by hand",
          "[tools][cli][rdkv]") {
  // One KV head of 3 tokens, d = 2, two query heads (GQA) with 2 window rows each, post-RoPE, at positions 1 and 2.
  std::vector<float> const k = {1, 0, 0, 2, 1, 1};
  std::vector<float> const q = {1, 0, 0, 1, 2, 1, 1, -1};  // head 0 rows (1, 0), (0, 1); head 1 rows (2, 1), (1, -1)
  auto const kp = write_npy("rdw_k.npy", kvc::NpyDtype::f32, {1, 1, 3, 2}, k);
  auto const qp = write_npy("rdw_q.npy", kvc::NpyDtype::f32, {1, 2, 2, 2}, q);
  auto const r =
      run("score --policy rdkv --param window_size=2 --param kernel_size=1 --param queries=post_rope --keys " + kp +
          " --queries " + qp + " --out " + work("rdw_w.npy") + " --channel-out " + work("rdw_c.npy"));
  INFO(r.output);
  REQUIRE(r.code == 0);
  auto const c = read(work("rdw_c.npy"));
  REQUIRE(c.shape == std::vector<Index>{1, 1, 2});
  // ThinK: mean over the 4 window rows of q_c^2 times mean over the 3 tokens of k_c^2.
  double const q0 = (1 + 0 + 4 + 1) / 4.0, q1 = (0 + 1 + 1 + 1) / 4.0;
  double const k0 = (1 + 0 + 1) / 3.0, k1 = (0 + 4 + 1) / 3.0;
  CHECK(floats(c)[0] == Approx(q0 * k0));
  CHECK(floats(c)[1] == Approx(q1 * k1));
  // attn_linear without pooling: s_j = sum over the group's heads and the window rows that see j of a(q, i, j),
  // divided by the rows that see j (row at position 1 sees tokens 0-1, row at 2 sees 0-2).
  double s[3] = {0, 0, 0};
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 2; ++i) {
      double const* qi = nullptr;
      double qq[2] = {q[static_cast<std::size_t>((h * 2 + i) * 2)], q[static_cast<std::size_t>((h * 2 + i) * 2 + 1)]};
      qi = qq;
      int const seen = i == 0 ? 2 : 3;
      double e[3], total = 0;
      for (int j = 0; j < seen; ++j) {
        e[j] = std::exp((qi[0] * k[static_cast<std::size_t>(2 * j)] + qi[1] * k[static_cast<std::size_t>(2 * j + 1)]) /
                        std::sqrt(2.0));
        total += e[j];
      }
      for (int j = 0; j < seen; ++j)
        s[j] += e[j] / total;
    }
  auto const w = floats(read(work("rdw_w.npy")));
  REQUIRE(w.size() == 3);
  CHECK(w[0] == Approx(s[0] / 2));
  CHECK(w[1] == Approx(s[1] / 2));
  CHECK(w[2] == Approx(s[2] / 1));
  // weight=NAME: that policy's scores, shifted so that the smallest is 0 (knorm: minus the key norm).
  REQUIRE(run("score --policy rdkv --param weight=knorm --param window_size=2 --param queries=post_rope --keys " + kp +
              " --queries " + qp + " --out " + work("rdw_kn.npy"))
              .code == 0);
  auto const kn = floats(read(work("rdw_kn.npy")));
  double const norms[3] = {1.0, 2.0, std::sqrt(2.0)};
  for (int j = 0; j < 3; ++j)
    CHECK(kn[static_cast<std::size_t>(j)] == Approx(2.0 - norms[j]).margin(1e-6));
  // kivi has no scores; --channel-out is rdkv's; allocation parameters do not change weights.
  CHECK(run("score --policy kivi --keys " + kp + " --out " + work("rdw_x.npy")).code == 2);
  CHECK(run("score --policy knorm --keys " + kp + " --out " + work("rdw_x.npy") + " --channel-out " + work("rdw_y.npy"))
            .code == 2);
  auto const a = run("score --policy rdkv --param solver=lagrangian --keys " + kp + " --queries " + qp + " --out " +
                     work("rdw_x.npy"));
  CHECK(a.code == 2);
  CHECK(contains(a.output, "solver"));
  CHECK(!std::filesystem::exists(work("rdw_x.npy")));
}

TEST_CASE("cli: rdkv's and kivi's bad parameters exit 2 or 3 naming them, and write nothing", "[tools][cli][rdkv]") {
  RDKVFiles const f;
  std::string const out = work("rd_bad");
  std::filesystem::remove_all(out);
  struct Case {
    std::string args;
    int code;
    std::string needle;
  };
  std::vector<Case> const cases = {
      {"--policy rdkv --budget -3" + f.in(), 3, "--budget"},
      {"--policy rdkv --ratio 1.5" + f.in(), 3, "--ratio"},
      {"--policy rdkv --ratio -0.1" + f.in(), 3, "--ratio"},
      {"--policy rdkv --budget 4 --param solver=greedy" + f.in(), 3, "solver"},
      {"--policy rdkv --budget 4 --param k_budget_ratio=0" + f.in(), 3, "k_budget_ratio"},
      {"--policy rdkv --budget 4 --param k_budget_ratio=1" + f.in(), 3, "k_budget_ratio"},
      {"--policy rdkv --budget 4 --param k_budget_ratio=1.5" + f.in(), 3, "k_budget_ratio"},
      {"--policy rdkv --budget 4 --param k_budget_ratio=abc" + f.in(), 3, "k_budget_ratio"},
      {"--policy rdkv --budget 4 --param weight=rdkv" + f.in(), 3, "weight"},
      {"--policy rdkv --budget 4 --param eps=llama2" + f.in(), 3, "eps"},
      {"--policy rdkv --budget 4 --param zero_point=zero" + f.in(), 3, "zero_point"},
      {"--policy rdkv --budget 4 --param kernel_size=4" + f.in(), 3, "kernel_size"},
      {"--policy rdkv --budget 4 --param v_group=-1" + f.in(), 3, "v_group"},
      {"--policy rdkv --budget 4 --param scope=model" + f.in(), 3, "scope"},
      {"--policy rdkv --budget 4 --param channel=snap" + f.in(), 3, "channel"},
      {"--policy rdkv --budget 4 --param bits=2" + f.in(), 2, "bits"},
      {"--policy rdkv --budget 4 --keys " + f.k + " --values " + f.v, 2, "--queries"},
      {"--policy rdkv" + f.in(), 2, "--budget"},
      {"--policy kivi --param bits=3 --keys " + f.k + " --values " + f.v, 3, "bits"},
      {"--policy kivi --param group=0 --keys " + f.k + " --values " + f.v, 3, "group"},
      {"--policy kivi --param residual=-1 --keys " + f.k + " --values " + f.v, 3, "residual"},
      {"--policy kivi --budget 4 --keys " + f.k + " --values " + f.v, 2, "--budget"},
  };
  for (Case const& c : cases) {
    auto const r = run("compress " + c.args + " --out-dir " + out);
    INFO(c.args << "\n" << r.output);
    CHECK(r.code == c.code);
    CHECK(contains(r.output, c.needle));
    CHECK(!std::filesystem::exists(out));
  }
}
