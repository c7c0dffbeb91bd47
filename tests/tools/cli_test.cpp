// SPDX-License-Identifier: Apache-2.0
// tests/tools/cli_test.cpp: the `kvc` command-line contract (DESIGN.md §6, docs/cli.md): exit codes 0/2/3,
// messages that name the file, the field and what was expected, --help, exact parameter lists, the query options of
// the window policies (SnapKV, TOVA) and of the stateful ones (ExpectedAttention, H2O), and outputs with the
// documented shapes. The scores themselves are checked against the NumPy oracle by tools/reference/check_cli.py
// (ctest kvc.tools.cli_oracle).
#include <kvc/io/npy.hpp>
#include <kvc/io/safetensors.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <sys/wait.h>
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
  CHECK(r.output.find("{\"command\": \"score\", \"policy\": \"key_diff\", \"seconds\": ") != std::string::npos);
  // KeyDiff's scratch at d = 4, one worker: a 32-row tile (512 B), two rows (64 B each), an fp64 row (64 B), each
  // rounded to 64 B, plus 64 B of alignment slack.
  CHECK(r.output.find("\"bytes_read\": 320, \"workspace_bytes\": 768, \"threads\": 1}") != std::string::npos);
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
  // compress --time reports scoring and selection apart; --threads changes no result.
  auto const t = run("compress --policy key_diff --ratio 0.5 --keys " + k + " --values " + v + " --out-dir " +
                     work("out2") + " --time --threads 2");
  REQUIRE(t.code == 0);
  CHECK(t.output.find("{\"command\": \"compress\", \"policy\": \"key_diff\", \"seconds\": ") != std::string::npos);
  CHECK(t.output.find("\"select_seconds\": ") != std::string::npos);
  CHECK(t.output.find("\"threads\": 2}") != std::string::npos);
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

std::vector<std::string> const all_policies = {"streaming_llm", "key_diff",           "knorm", "snap_kv",
                                               "tova",          "expected_attention", "h2o",   "random"};
std::vector<std::string> const key_only_policies = {"streaming_llm", "key_diff", "knorm", "random"};
std::vector<std::string> const query_policies = {"snap_kv", "tova", "expected_attention", "h2o"};

bool reads_queries(std::string const& policy) {
  return std::find(query_policies.begin(), query_policies.end(), policy) != query_policies.end();
}

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
                        "indices.npy", "counts.npy"})
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
  // Parse "NAME  (reads ...)" headings and "    --param NAME=DEFAULT ..." lines.
  std::map<std::string, std::map<std::string, std::string>> listed;
  std::string current;
  std::istringstream lines(r.output);
  for (std::string line; std::getline(lines, line);) {
    if (contains(line, "  (reads ") && line[0] != ' ') {
      current = line.substr(0, line.find(' '));
      listed[current];
    } else if (line.rfind("    --param ", 0) == 0) {
      std::string const kv = line.substr(12, line.find(' ', 12) - 12);
      listed[current][kv.substr(0, kv.find('='))] = kv.substr(kv.find('=') + 1);
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
  };
  CHECK(listed == expected);
  for (char const* s : {"window_size=32 (kvpress: 64)", "kernel_size=7 (kvpress: 5)", "pooling=max (kvpress: avg)",
                        "epsilon=0.01 (kvpress: 0)", "recent_share=0.5 (kvpress: 0)"})
    CHECK(contains(r.output, s));

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
  CHECK(contains(r.output, "\"policy\": \"snap_kv\""));
  CHECK(contains(r.output, "\"bytes_read\": " + std::to_string((2 * n * 4 + 4 * w * 4) * 4) + ", "));
  r = run("score --policy random --keys " + f.keys + " --out " + f.out("x.npy") + " --time");
  CHECK(contains(r.output, "\"bytes_read\": 0, "));

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
  expect3(base + " --param kernel_size=4", "--param kernel_size = 4: expected an odd integer");
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
          "keys file " + two + ":c64: field 'dtype' is F64, expected F32, F16 or BF16");
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
