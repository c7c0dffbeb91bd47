// SPDX-License-Identifier: Apache-2.0
// tests/tools/hostile_test.cpp: the `kvc` tool against hostile inputs and output paths (issue 6). For each class of
// hostile input the tool exits 3 (2 for usage) with one line "kvc: error: ..." naming the file or option and what
// was wrong: never a crash, a hang, a partial output, an overwritten input or a wrong answer. No output and no
// temporary (".<name>.kvc-XXXXXX" beside the destination) is left behind, and the inputs keep their bytes.
// Every run is wrapped in `timeout 20`, so a hang fails the test instead of blocking ctest.
#include <kvc/core/element.hpp>

#include "io/npy.hpp"
#include "support/catch.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <tuple>
#include <unistd.h>
#include <vector>

#ifndef KVC_CLI
#  define KVC_CLI "kvc"
#endif
#ifndef KVC_HOSTILE_WORK
#  define KVC_HOSTILE_WORK "/tmp/kvc_hostile_work"
#endif

namespace fs = std::filesystem;
using kvc::Index;

namespace {

struct Result {
  std::string command;
  int code;
  std::string output;  ///< stdout and stderr together
  double seconds;
};

/// Runs `kvc args` under `timeout 20`; with `fsize_blocks` > 0 under `ulimit -f` (the tool ignores SIGXFSZ, so a
/// write past the limit fails with EFBIG, "File too large"). Paths must not hold spaces or quotes.
Result run(std::string const& args, int fsize_blocks = 0) {
  std::string cmd = "timeout 20 ";
  if (fsize_blocks > 0)
    cmd += "sh -c 'ulimit -f " + std::to_string(fsize_blocks) + " && exec " + KVC_CLI + " " + args + "'";
  else
    cmd += std::string(KVC_CLI) + " " + args;
  cmd += " 2>&1 </dev/null";
  auto const t0 = std::chrono::steady_clock::now();
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, p))
    out += buf;
  int const status = pclose(p);
  double const seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return {cmd, WIFEXITED(status) ? WEXITSTATUS(status) : -1, out, seconds};
}

bool contains(std::string const& text, std::string const& needle) {
  return text.find(needle) != std::string::npos;
}

/// An exit with `code` and exactly one line "kvc: error: ..." (exit 2 adds the synopsis after it) holding every
/// needle.
void check_error(Result const& r, int code, std::vector<std::string> const& needles) {
  INFO(r.command << "\n--- output:\n" << r.output);
  CHECK(r.code == code);
  CHECK(r.output.rfind("kvc: error: ", 0) == 0);
  if (code == 3)
    CHECK(std::count(r.output.begin(), r.output.end(), '\n') == 1);
  for (auto const& n : needles)
    CHECK(contains(r.output, n));
}

/// A fresh folder for one test case (ctest runs the test cases in parallel processes).
std::string fresh_dir(std::string const& name) {
  fs::path const p = fs::path(KVC_HOSTILE_WORK) / name;
  std::error_code ec;
  fs::remove_all(p, ec);
  fs::create_directories(p);
  return p.string();
}

/// The bytes of a regular file, or nothing when it cannot be read.
std::optional<std::string> slurp(std::string const& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f)
    return std::nullopt;
  return std::string(std::istreambuf_iterator<char>(f), {});
}

void write_bytes(std::string const& path, std::string const& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(slurp(path) == bytes);
}

void write_bytes(std::string const& path, std::vector<std::byte> const& bytes) {
  write_bytes(path, std::string(reinterpret_cast<char const*>(bytes.data()), bytes.size()));
}

Index product(std::vector<Index> const& shape) {
  Index n = 1;
  for (Index s : shape)
    n *= s;
  return n;
}

template <class T>
std::string npy(std::string const& path, kvc::NpyDtype dtype, std::vector<Index> const& shape,
                std::vector<T> const& data) {
  REQUIRE(static_cast<Index>(data.size()) == product(shape));
  write_bytes(path, kvc::serialize_npy(dtype, shape, data.data()));
  return path;
}

/// Deterministic values in [-1, 1] with no zero row.
std::vector<float> values(std::size_t n, std::uint32_t seed = 1) {
  std::vector<float> v(n);
  std::uint32_t x = seed * 2654435761u + 12345u;
  for (float& f : v) {
    x = x * 1664525u + 1013904223u;
    f = static_cast<float>(x >> 8) / static_cast<float>(1u << 24) * 2.0f - 1.0f;
    if (std::abs(f) < 0.05f)
      f = 0.5f;
  }
  return v;
}

std::string f32(std::string const& path, std::vector<Index> const& shape, std::uint32_t seed = 1) {
  return npy(path, kvc::NpyDtype::f32, shape, values(static_cast<std::size_t>(product(shape)), seed));
}

/// The inputs' bytes when taken; check() asserts they are unchanged.
struct Snapshot {
  std::map<std::string, std::string> bytes;
  explicit Snapshot(std::initializer_list<std::string> paths) {
    for (auto const& p : paths) {
      auto b = slurp(p);
      REQUIRE(b.has_value());
      bytes[p] = *b;
    }
  }
  void check() const {
    for (auto const& [path, b] : bytes) {
      INFO("input " << path);
      auto const now = slurp(path);
      REQUIRE(now.has_value());
      CHECK(*now == b);
    }
  }
};

/// The tool's temporaries (".<name>.kvc-XXXXXX") anywhere under `dir`.
std::vector<std::string> temporaries(std::string const& dir) {
  std::vector<std::string> found;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, fs::directory_options::skip_permission_denied, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    std::string const name = it->path().filename().string();
    if (name.rfind('.', 0) == 0 && contains(name, ".kvc-"))
      found.push_back(it->path().string());
  }
  return found;
}

bool exists(std::string const& path) {
  std::error_code ec;
  return fs::exists(fs::symlink_status(path, ec));
}

/// Nothing of the tool's under `dir`: none of `outputs` and no temporary.
void check_nothing_left(std::string const& dir, std::vector<std::string> const& outputs) {
  for (auto const& o : outputs) {
    INFO("output " << o);
    CHECK(!exists(o));
  }
  INFO("folder " << dir);
  CHECK(temporaries(dir).empty());
}

kvc::NpyArray read(std::string const& path) {
  kvc::NpyArray a;
  std::string error;
  bool const ok = kvc::read_npy(path, a, error);
  INFO(path << ": " << error);
  REQUIRE(ok);
  return a;
}

constexpr char const* compress_outputs[] = {"keys.npy", "values.npy", "indices.npy", "counts.npy"};

std::vector<std::string> compress_files(std::string const& dir) {
  std::vector<std::string> files;
  for (char const* name : compress_outputs)
    files.push_back(dir + "/" + name);
  return files;
}

/// A .npy file of `header` (the dict text) padded as numpy pads it, then `data`.
std::string raw_npy(std::string header, std::string const& data) {
  std::size_t const total = (10 + header.size() + 1 + 63) / 64 * 64;
  header.append(total - 10 - header.size() - 1, ' ');
  header += '\n';
  return std::string("\x93NUMPY\x01\x00", 8) + static_cast<char>(header.size() & 0xff) +
         static_cast<char>(header.size() >> 8) + header + data;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// 1. Output safety.

TEST_CASE("hostile: a write that fails midway leaves no output, no temporary and no new folder", "[tools][hostile]") {
  std::string const dir = fresh_dir("write_fails");
  // Outputs past 1024 bytes (ulimit -f 1 is 512 bytes in dash, 1024 in bash): scores 4 KiB, kept keys 8 KiB.
  auto const k = f32(dir + "/k.npy", {1, 2, 512, 4}, 1);
  auto const v = f32(dir + "/v.npy", {1, 2, 512, 4}, 2);
  Snapshot const inputs{k, v};

  std::string const out = dir + "/s.npy";
  auto r = run("score --policy knorm --keys " + k + " --out " + out, 1);
  check_error(r, 3, {"output file " + out + ": ", "File too large"});
  check_nothing_left(dir, {out});

  std::string const fresh = dir + "/new";
  r = run("compress --policy knorm --ratio 0.5 --keys " + k + " --values " + v + " --out-dir " + fresh, 1);
  check_error(r, 3, {"output file " + fresh + "/", "File too large"});
  CHECK(!exists(fresh));
  check_nothing_left(dir, {});

  // Every folder --out-dir created is removed, not only the last one.
  std::string const nested = dir + "/a/b/c";
  r = run("compress --policy knorm --ratio 0.5 --keys " + k + " --values " + v + " --out-dir " + nested, 1);
  check_error(r, 3, {"output file " + nested + "/", "File too large"});
  CHECK(!exists(dir + "/a/b/c"));
  CHECK(!exists(dir + "/a/b"));
  CHECK(!exists(dir + "/a"));

  // The first output fits under the limit and the second does not: the first is not committed either.
  std::vector<kvc::half> small, wide;
  for (float x : values(64 * 2, 3))
    small.emplace_back(x);
  for (float x : values(64 * 256, 4))
    wide.emplace_back(x);
  auto const k16 = npy(dir + "/k16.npy", kvc::NpyDtype::f16, {1, 1, 64, 2}, small);   // keys.npy: 256 bytes
  auto const v16 = npy(dir + "/v16.npy", kvc::NpyDtype::f16, {1, 1, 64, 256}, wide);  // values.npy: 16 KiB
  Snapshot const inputs16{k16, v16};
  std::string const existing = dir + "/existing";
  fs::create_directories(existing);
  r = run("compress --policy knorm --budget 32 --keys " + k16 + " --values " + v16 + " --out-dir " + existing, 1);
  check_error(r, 3, {"output file " + existing + "/values.npy: ", "File too large"});
  CHECK(fs::is_directory(existing));  // it existed before: kept, and empty
  CHECK(fs::is_empty(existing));
  check_nothing_left(dir, compress_files(existing));

  // Without the limit the same runs succeed (the failures above came from the limit alone).
  REQUIRE(
      run("compress --policy knorm --budget 32 --keys " + k16 + " --values " + v16 + " --out-dir " + existing).code ==
      0);
  CHECK(read(existing + "/values.npy").shape == std::vector<Index>{1, 1, 32, 256});
  inputs.check();
  inputs16.check();
}

TEST_CASE("hostile: an existing output keeps its bytes when the write fails", "[tools][hostile]") {
  std::string const dir = fresh_dir("keep_existing");
  auto const k = f32(dir + "/k.npy", {1, 2, 512, 4}, 5);
  auto const v = f32(dir + "/v.npy", {1, 2, 512, 4}, 6);
  Snapshot const inputs{k, v};

  std::string const out = dir + "/s.npy";
  std::string const old = "the previous scores, which a failed run must not touch\n";
  write_bytes(out, old);
  auto r = run("score --policy key_diff --keys " + k + " --out " + out, 1);
  check_error(r, 3, {"output file " + out + ": ", "File too large"});
  CHECK(slurp(out) == old);
  CHECK(temporaries(dir).empty());

  // Through a symbolic link: the link stays a link, its target keeps its bytes.
  std::string const target = dir + "/target.npy", link = dir + "/link.npy";
  write_bytes(target, old);
  fs::create_symlink(target, link);
  r = run("score --policy key_diff --keys " + k + " --out " + link, 1);
  check_error(r, 3, {"output file " + link + ": ", "File too large"});
  CHECK(fs::is_symlink(link));
  CHECK(slurp(target) == old);
  CHECK(temporaries(dir).empty());

  // compress: every previous output in --out-dir keeps its bytes.
  std::string const out_dir = dir + "/out";
  fs::create_directories(out_dir);
  std::map<std::string, std::string> before;
  for (auto const& f : compress_files(out_dir)) {
    before[f] = "previous " + f + "\n";
    write_bytes(f, before[f]);
  }
  r = run("compress --policy knorm --ratio 0.25 --keys " + k + " --values " + v + " --out-dir " + out_dir, 1);
  check_error(r, 3, {"output file " + out_dir + "/", "File too large"});
  for (auto const& [f, bytes] : before) {
    INFO(f);
    CHECK(slurp(f) == bytes);
  }
  CHECK(temporaries(dir).empty());
  inputs.check();
}

TEST_CASE("hostile: an output that is an input is refused, whatever the path", "[tools][hostile]") {
  std::string const dir = fresh_dir("output_is_input");
  auto const k = f32(dir + "/k.npy", {1, 2, 40, 4}, 7);
  auto const v = f32(dir + "/v.npy", {1, 2, 40, 4}, 8);
  auto const q = f32(dir + "/q.npy", {1, 4, 4, 4}, 9);
  std::vector<std::int64_t> pos = {36, 37, 38, 39};
  auto const p = npy(dir + "/p.npy", kvc::NpyDtype::i64, {1, 4}, pos);
  std::string const symlink = dir + "/symlink.npy", hardlink = dir + "/hardlink.npy";
  fs::create_symlink(k, symlink);
  fs::create_hard_link(k, hardlink);
  Snapshot const inputs{k, v, q, p};

  for (std::string const& out : {k, symlink, hardlink, dir + "/../output_is_input/./k.npy"}) {
    auto const r = run("score --policy knorm --keys " + k + " --out " + out);
    check_error(r, 3, {"--out " + out + " is the same file as --keys " + k, "refusing to overwrite an input"});
  }
  // The keys given through the link, the output the file itself.
  check_error(run("score --policy knorm --keys " + symlink + " --out " + k), 3, {"same file as --keys " + symlink});
  check_error(run("score --policy knorm --keys " + k + " --values " + v + " --out " + v), 3,
              {"--out " + v + " is the same file as --values " + v});
  std::string const tova = "score --policy tova --param queries=post_rope --keys " + k + " --queries " + q;
  check_error(run(tova + " --out " + q), 3, {"same file as --queries " + q});
  check_error(run(tova + " --positions " + p + " --out " + p), 3, {"same file as --positions " + p});
  CHECK(fs::is_symlink(symlink));
  CHECK(fs::hard_link_count(k) == 2);
  CHECK(temporaries(dir).empty());
  inputs.check();

  // compress --out-dir is the inputs' folder, and they are named like its outputs: refused before reading them
  // (so a keys.npy that is not even a .npy file is reported as the clash, not as bad data).
  for (auto const& [kname, vname] :
       std::vector<std::pair<std::string, std::string>>{{"keys.npy", "values.npy"}, {"counts.npy", "indices.npy"}}) {
    std::string const same = fresh_dir("output_is_input_" + kname.substr(0, kname.find('.')));
    auto const kk = f32(same + "/" + kname, {1, 2, 40, 4}, 10);
    auto const vv = f32(same + "/" + vname, {1, 2, 40, 4}, 11);
    Snapshot const named{kk, vv};
    auto const r = run("compress --policy knorm --ratio 0.5 --keys " + kk + " --values " + vv + " --out-dir " + same);
    check_error(r, 3, {"is the same file as --", "refusing to overwrite an input"});
    named.check();
    CHECK(temporaries(same).empty());
    CHECK(std::distance(fs::directory_iterator(same), fs::directory_iterator()) == 2);
  }
  std::string const garbage_dir = fresh_dir("output_is_input_garbage");
  write_bytes(garbage_dir + "/keys.npy", std::string("not a .npy file at all"));
  auto const gv = f32(garbage_dir + "/values.npy", {1, 2, 40, 4}, 12);
  Snapshot const garbage{garbage_dir + "/keys.npy", gv};
  check_error(run("compress --policy knorm --ratio 0.5 --keys " + garbage_dir + "/keys.npy --values " + gv +
                  " --out-dir " + garbage_dir),
              3, {"output file " + garbage_dir + "/keys.npy is the same file as --keys"});
  garbage.check();

  // Inputs named otherwise in the same folder: compress writes beside them.
  std::string const beside = fresh_dir("output_is_input_beside");
  auto const bk = f32(beside + "/k.npy", {1, 2, 40, 4}, 13);
  auto const bv = f32(beside + "/v.npy", {1, 2, 40, 4}, 14);
  Snapshot const kept{bk, bv};
  auto const r = run("compress --policy knorm --ratio 0.5 --keys " + bk + " --values " + bv + " --out-dir " + beside);
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(r.output.empty());
  CHECK(read(beside + "/keys.npy").shape == std::vector<Index>{1, 2, 20, 4});
  kept.check();
  CHECK(temporaries(beside).empty());
}

TEST_CASE("hostile: two outputs that are the same file are refused", "[tools][hostile]") {
  // compress's outputs keys.npy and values.npy are links to one file (or one links to the other): writing both would
  // leave the values under the name keys.npy.
  std::string const dir = fresh_dir("outputs_alias");
  auto const k = f32(dir + "/k.npy", {1, 1, 8, 4}, 39);
  auto const v = f32(dir + "/v.npy", {1, 1, 8, 6}, 40);
  Snapshot const inputs{k, v};
  std::string const target = dir + "/target.npy", old = "a file two outputs point to\n";
  write_bytes(target, old);
  for (bool chain : {false, true}) {
    std::string const out_dir = dir + (chain ? "/chain" : "/both");
    fs::create_directories(out_dir);
    if (chain) {  // keys.npy -> values.npy -> target
      fs::create_symlink(target, out_dir + "/values.npy");
      fs::create_symlink(out_dir + "/values.npy", out_dir + "/keys.npy");
    } else {
      fs::create_symlink(target, out_dir + "/keys.npy");
      fs::create_symlink(target, out_dir + "/values.npy");
    }
    auto const r = run("compress --policy knorm --ratio 0.5 --keys " + k + " --values " + v + " --out-dir " + out_dir);
    INFO(r.output);
    check_error(r, 3, {"keys.npy", "values.npy", "same file"});
    CHECK(slurp(target) == old);
    CHECK(fs::is_symlink(out_dir + "/keys.npy"));
    CHECK(fs::is_symlink(out_dir + "/values.npy"));
    check_nothing_left(dir, {out_dir + "/indices.npy", out_dir + "/counts.npy"});
  }
  inputs.check();
}

TEST_CASE("hostile: an output path that is not a regular file is refused", "[tools][hostile]") {
  std::string const dir = fresh_dir("output_not_regular");
  auto const k = f32(dir + "/k.npy", {1, 2, 40, 4}, 15);
  auto const v = f32(dir + "/v.npy", {1, 2, 40, 4}, 16);
  Snapshot const inputs{k, v};
  std::string const score = "score --policy knorm --keys " + k + " --out ";

  check_error(run(score + "/dev/null"), 3, {"--out /dev/null exists and is not a regular file"});
  struct stat st {};
  REQUIRE(::stat("/dev/null", &st) == 0);
  CHECK(S_ISCHR(st.st_mode));

  std::string const folder = dir + "/folder";
  fs::create_directories(folder);
  check_error(run(score + folder + "/"), 3, {"--out " + folder + "/ exists and is not a regular file"});
  CHECK(fs::is_directory(folder));
  CHECK(fs::is_empty(folder));

  std::string const to_null = dir + "/to_null.npy";
  fs::create_symlink("/dev/null", to_null);
  check_error(run(score + to_null), 3, {"--out " + to_null + " exists and is not a regular file"});
  CHECK(fs::is_symlink(to_null));

  // A FIFO: opening it to write would block; it is refused at once.
  std::string const fifo = dir + "/fifo.npy";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  auto r = run(score + fifo);
  check_error(r, 3, {"--out " + fifo + " exists and is not a regular file"});
  CHECK(r.seconds < 10);
  CHECK(fs::is_fifo(fifo));

  // No folder is created for --out, and an empty path names no file.
  check_error(run(score + dir + "/missing/s.npy"), 3, {"output file " + dir + "/missing/s.npy: "});
  CHECK(!exists(dir + "/missing"));
  check_error(run(score + "''"), 3, {"output file : "});

  std::string const compress = "compress --policy knorm --ratio 0.5 --keys " + k + " --values " + v + " --out-dir ";
  check_error(run(compress + k), 3, {"--out-dir " + k + " exists and is not a directory"});
  std::string const clash = dir + "/clash";
  fs::create_directories(clash + "/indices.npy");
  check_error(run(compress + clash), 3, {"output file " + clash + "/indices.npy exists and is not a regular file"});
  CHECK(fs::is_directory(clash + "/indices.npy"));
  check_nothing_left(dir, {clash + "/keys.npy", clash + "/values.npy", clash + "/counts.npy"});
  // --out-dir below a regular file cannot be created.
  check_error(run(compress + k + "/sub"), 3, {"--out-dir " + k + "/sub"});
  inputs.check();
  CHECK(temporaries(dir).empty());
}

TEST_CASE("hostile: a successful run writes whole files that parse and leaves no temporary", "[tools][hostile]") {
  std::string const dir = fresh_dir("success");
  std::vector<float> const kd = values(2 * 64 * 4, 17);
  auto const k = npy(dir + "/k.npy", kvc::NpyDtype::f32, {1, 2, 64, 4}, kd);
  auto const v = f32(dir + "/v.npy", {1, 2, 64, 6}, 18);  // d_v differs from d
  Snapshot const inputs{k, v};

  // An existing output is replaced whole; one behind a link is replaced where the link points.
  std::string const out = dir + "/s.npy", target = dir + "/target.npy", link = dir + "/link.npy";
  write_bytes(out, std::string("old"));
  write_bytes(target, std::string("old"));
  fs::create_symlink(target, link);
  for (std::string const& o : {out, link, dir + "/new.npy"}) {
    auto const r = run("score --policy knorm --keys " + k + " --out " + o);
    INFO(r.output);
    REQUIRE(r.code == 0);
    CHECK(r.output.empty());
    auto const a = read(o);
    CHECK(a.dtype == kvc::NpyDtype::f32);
    REQUIRE(a.shape == std::vector<Index>{1, 2, 64});
    for (std::size_t t = 0; t < 128; ++t) {
      double sq = 0;
      for (std::size_t i = 0; i < 4; ++i)
        sq += double{kd[t * 4 + i]} * kd[t * 4 + i];
      CHECK(a.as<float>()[t] == Approx(-std::sqrt(sq)).epsilon(1e-6));
    }
  }
  CHECK(fs::is_symlink(link));
  CHECK(slurp(link) == slurp(out));

  std::string const out_dir = dir + "/new/nested";
  auto const r =
      run("compress --policy key_diff --ratio 0.25 --keys " + k + " --values " + v + " --out-dir " + out_dir);
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(read(out_dir + "/keys.npy").shape == std::vector<Index>{1, 2, 48, 4});
  auto const vals = read(out_dir + "/values.npy");
  CHECK(vals.shape == std::vector<Index>{1, 2, 48, 6});
  CHECK(vals.dtype == kvc::NpyDtype::f32);
  auto const idx = read(out_dir + "/indices.npy");
  CHECK(idx.dtype == kvc::NpyDtype::i64);
  CHECK(idx.shape == std::vector<Index>{1, 2, 48});
  auto const counts = read(out_dir + "/counts.npy");
  REQUIRE(counts.shape == std::vector<Index>{1, 2});
  CHECK(counts.as<std::int64_t>()[0] == 48);
  CHECK(counts.as<std::int64_t>()[1] == 48);
  CHECK(std::distance(fs::directory_iterator(out_dir), fs::directory_iterator()) == 4);
  CHECK(temporaries(dir).empty());
  inputs.check();
}

// ---------------------------------------------------------------------------------------------------------------
// 2. Sizes from headers.

TEST_CASE("hostile: header shapes with a zero dimension, huge products or missing data are refused at once",
          "[tools][hostile]") {
  std::string const dir = fresh_dir("header_sizes");
  Index const p57 = Index{1} << 57, p40 = Index{1} << 40, p31 = Index{1} << 31, p30 = Index{1} << 30;
  auto header_only = [&](std::string const& name, kvc::NpyDtype dtype, std::vector<Index> const& shape) {
    std::string const path = dir + "/" + name;
    write_bytes(path, kvc::npy_header(dtype, shape));
    return path;
  };
  auto const good_k = f32(dir + "/good_k.npy", {1, 1, 8, 4}, 19);
  std::string const out = dir + "/s.npy", out_dir = dir + "/out";
  auto expect = [&](std::string const& args, std::vector<std::string> const& needles) {
    auto const r = run(args);
    check_error(r, 3, needles);
    CHECK(r.seconds < 10);  // no allocation, no scan of a pretended size
    check_nothing_left(dir, {out, out_dir});
  };
  struct Case {
    std::string name;
    kvc::NpyDtype dtype;
    std::vector<Index> shape;
    std::string why;
  };
  std::vector<Case> const cases = {
      {"zero_first.npy", kvc::NpyDtype::f32, {0, p57, p57, 1}, "the product of the dimensions overflows 64 bits"},
      {"zero_third.npy", kvc::NpyDtype::f32, {1, p57, 0, 4}, "every dimension must be >= 1"},
      {"zero_wide.npy", kvc::NpyDtype::f32, {p40, 1, 0, 8}, "every dimension must be >= 1"},
      {"zero_f16.npy", kvc::NpyDtype::f16, {p40, p40 >> 20, 0, 1}, "every dimension must be >= 1"},
      {"bytes_overflow.npy", kvc::NpyDtype::f32, {p31, p31, 1, 1}, "the data size overflows 64 bits"},
      {"bytes_overflow16.npy", kvc::NpyDtype::f16, {p31, p31, 1, 1}, "the data size overflows 64 bits"},
      {"no_data.npy", kvc::NpyDtype::f16, {p30, p30, 2, 1}, "truncated data: shape needs 4611686018427387904 bytes"},
  };
  for (std::size_t i = 0; i < cases.size(); ++i) {
    Case const& c = cases[i];
    auto const path = header_only(c.name, c.dtype, c.shape);
    INFO(c.name);
    expect("score --policy knorm --keys " + path + " --out " + out, {"keys file " + path + ": ", "shape", c.why});
    if (i % 3 == 1)
      expect("compress --policy knorm --ratio 0.5 --keys " + good_k + " --values " + path + " --out-dir " + out_dir,
             {"values file " + path + ": ", "shape", c.why});
    if (i % 3 == 2)
      expect("score --policy tova --keys " + good_k + " --queries " + path + " --out " + out,
             {"queries file " + path + ": ", "shape", c.why});
  }
  // A header declaring more data than the file holds.
  auto trunc = kvc::npy_header(kvc::NpyDtype::f32, std::vector<Index>{1, 1, 1000, 4});
  trunc.resize(trunc.size() + 64);
  write_bytes(dir + "/trunc.npy", trunc);
  expect("score --policy knorm --keys " + dir + "/trunc.npy --out " + out,
         {"keys file " + dir + "/trunc.npy: ", "truncated data: shape needs 16000 bytes, file has 64"});
  // A sparse file larger than this machine's memory (and than ASan's largest allocation, 1 TiB), its header
  // consistent with its size: refused from its size, before any allocation.
  long const pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  REQUIRE((pages > 0 && page > 0));
  auto const memory = static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page);
  std::uint64_t const tokens = std::max<std::uint64_t>(std::uint64_t{1} << 37, memory / 8);  // 16 bytes a token
  std::string const sparse = dir + "/sparse.npy";
  auto const head = kvc::npy_header(kvc::NpyDtype::f32, std::vector<Index>{1, 1, static_cast<Index>(tokens), 4});
  write_bytes(sparse, head);
  std::uint64_t const size = head.size() + tokens * 16;
  std::error_code ec;
  fs::resize_file(sparse, size, ec);
  if (ec) {
    WARN("this file system refuses a sparse file of " << size << " bytes: " << ec.message());
  } else {
    expect("score --policy knorm --keys " + sparse + " --out " + out,
           {"keys file " + sparse + ": ", "the file has " + std::to_string(size) + " bytes"});
  }
  fs::remove(sparse, ec);
  // Positions: a zero-size int64 array is not [B, w].
  auto const q = f32(dir + "/q.npy", {1, 1, 2, 4}, 20);
  auto const pz = header_only("pz.npy", kvc::NpyDtype::i64, {1, 0});
  expect("score --policy tova --keys " + good_k + " --queries " + q + " --positions " + pz + " --out " + out,
         {"positions file " + pz + ": ", "shape"});
}

TEST_CASE("hostile: a query head count whose workspace exceeds this machine's memory is refused", "[tools][hostile]") {
  // TOVA's workspace holds, per worker, g = Hq / Hkv column sums over N tokens: 4 * Hq * N bytes with Hkv = 1, from
  // a keys file of 8 N bytes and a queries file of 8 Hq bytes (d = 2, one query row).
  long const pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  REQUIRE((pages > 0 && page > 0));
  double const memory = static_cast<double>(pages) * static_cast<double>(page);
  auto const side = static_cast<Index>(std::ceil(std::sqrt(memory / 4.0 * 1.05)));
  if (side > (Index{1} << 20)) {  // files over 8 MiB
    WARN("SKIPPED: this machine's memory needs inputs over 8 MiB each");
    return;
  }
  std::string const dir = fresh_dir("workspace_memory");
  auto const k = f32(dir + "/k.npy", {1, 1, side, 2}, 21);
  auto const q = f32(dir + "/q.npy", {1, side, 1, 2}, 22);
  Snapshot const inputs{k, q};
  std::string const out = dir + "/s.npy";
  auto const r = run("score --policy tova --keys " + k + " --queries " + q + " --out " + out);
  check_error(
      r, 3,
      {"the workspace of policy tova over keys file " + k + " / queries file " + q, "more than the memory available"});
  CHECK(r.seconds < 10);
  check_nothing_left(dir, {out});
  inputs.check();
}

// ---------------------------------------------------------------------------------------------------------------
// 3. Files that are not files.

TEST_CASE("hostile: inputs that are not regular files are refused without blocking", "[tools][hostile]") {
  std::string const dir = fresh_dir("not_files");
  auto const k = f32(dir + "/k.npy", {1, 1, 8, 4}, 23);
  auto const v = f32(dir + "/v.npy", {1, 1, 8, 4}, 24);
  auto const q = f32(dir + "/q.npy", {1, 1, 2, 4}, 25);
  Snapshot const inputs{k, v, q};
  std::string const out = dir + "/s.npy", out_dir = dir + "/out";

  std::string const fifo = dir + "/fifo.npy";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  std::string const folder = dir + "/folder.npy";
  fs::create_directories(folder);
  std::string const folder_link = dir + "/folder_link.npy";
  fs::create_symlink(folder, folder_link);
  std::string const loop_a = dir + "/loop_a.npy", loop_b = dir + "/loop_b.npy";
  fs::create_symlink(loop_b, loop_a);
  fs::create_symlink(loop_a, loop_b);
  std::string const empty = dir + "/empty.npy";
  write_bytes(empty, std::string());

  /// The path, and what the message says about it (one of these).
  struct NotFile {
    std::string path;
    std::vector<std::string> one_of;
  };
  std::vector<NotFile> cases = {
      {fifo, {"is a FIFO (named pipe), expected a regular file"}},
      {folder, {"is a directory, expected a regular file"}},
      {"/dev/zero", {"is a character device, expected a regular file"}},
      {folder_link, {"is a directory, expected a regular file"}},
      {"/dev/null", {"is a character device, expected a regular file"}},
      {dir + "/missing.npy", {"cannot open the file for reading (No such file or directory)"}},
      {loop_a, {"cannot open the file for reading (Too many levels of symbolic links)"}},
      {empty, {"not a .npy file"}},
  };
  // A socket: open() fails with ENXIO before the type can be examined, or the type is named.
  std::string const sock = dir + "/sock.npy";
  sockaddr_un addr{};
  if (sock.size() < sizeof addr.sun_path) {
    int const fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    REQUIRE(fd >= 0);
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, sock.c_str(), sock.size() + 1);
    REQUIRE(::bind(fd, reinterpret_cast<sockaddr const*>(&addr), sizeof addr) == 0);
    ::close(fd);
    cases.push_back({sock, {"is a socket, expected a regular file", "cannot open the file for reading"}});
  }
  // An unreadable file (root reads it anyway).
  std::string const locked = dir + "/locked.npy";
  f32(locked, {1, 1, 8, 4}, 26);
  if (::geteuid() != 0) {
    REQUIRE(::chmod(locked.c_str(), 0) == 0);
    cases.push_back({locked, {"cannot open the file for reading (Permission denied)"}});
  }

  // Every case as --keys; the FIFO in every role, the others in one more role each.
  for (std::size_t i = 0; i < cases.size(); ++i) {
    std::string const& path = cases[i].path;
    INFO(path);
    auto check = [&](std::string const& role, std::string const& args) {
      auto const r = run(args);
      check_error(r, 3, {role + " file " + path + ": "});
      bool said = false;
      for (auto const& why : cases[i].one_of)
        said = said || contains(r.output, why);
      INFO(r.output);
      CHECK(said);
      CHECK(r.seconds < 10);
      check_nothing_left(dir, {out, out_dir});
    };
    check("keys", "score --policy knorm --keys " + path + " --out " + out);
    bool const all = i == 0;
    if (all || i % 4 == 1)
      check("values", "score --policy knorm --keys " + k + " --values " + path + " --out " + out);
    if (all || i % 4 == 2)
      check("values",
            "compress --policy knorm --ratio 0.5 --keys " + k + " --values " + path + " --out-dir " + out_dir);
    if (all || i % 4 == 3)
      check("queries", "score --policy tova --keys " + k + " --queries " + path + " --out " + out);
    if (all || i % 4 == 0)
      check("positions",
            "score --policy tova --keys " + k + " --queries " + q + " --positions " + path + " --out " + out);
  }
  CHECK(fs::is_fifo(fifo));
  ::chmod(locked.c_str(), 0600);
  inputs.check();
}

// ---------------------------------------------------------------------------------------------------------------
// 4. Numeric range (docs/numerics.md, "Range"). KeyDiff scores every finite key exactly; Knorm every key whose norm
// is at most FLT_MAX, and the CLI refuses a key past it for knorm, naming the key; SnapKV and TOVA refuse keys or
// queries with head_dim * x^2 >= 2^126 and score finitely below. Every outcome is fixed: no "or refused".

namespace {

/// Scores of one head of N rows of `d` values, in double: knorm (-||k||) or key_diff (-cos(k, anchor), the anchor
/// the mean unit key or, for key_diff_raw, the raw mean key), with key_diff's documented floors
/// (include/kvc/scorers/key_diff.hpp, as kvpress: F.normalize's 1e-12 on ||k|| for the unit keys,
/// cosine_similarity's 1e-8 on both norms).
std::vector<double> expected_scores(std::string const& policy, std::vector<double> const& k, std::size_t d) {
  std::size_t const n = k.size() / d;
  auto norm = [&](double const* r) {
    double sq = 0;
    for (std::size_t i = 0; i < d; ++i)
      sq += r[i] * r[i];
    return std::sqrt(sq);
  };
  std::vector<double> s(n);
  if (policy == "knorm") {
    for (std::size_t t = 0; t < n; ++t)
      s[t] = -norm(&k[t * d]);
    return s;
  }
  bool const unit = policy == "key_diff";
  std::vector<double> anchor(d, 0.0);
  for (std::size_t t = 0; t < n; ++t) {
    double const w = unit ? 1.0 / std::max(norm(&k[t * d]), 1e-12) : 1.0;
    for (std::size_t i = 0; i < d; ++i)
      anchor[i] += k[t * d + i] * w / static_cast<double>(n);
  }
  double const an = std::max(norm(anchor.data()), 1e-8);
  for (std::size_t t = 0; t < n; ++t) {
    double dot = 0;
    for (std::size_t i = 0; i < d; ++i)
      dot += k[t * d + i] * anchor[i];
    s[t] = -dot / (std::max(norm(&k[t * d]), 1e-8) * an);
  }
  return s;
}

/// The first row of `k` (rows of `d`) whose norm, in double, exceeds FLT_MAX; -1 when none does.
long first_norm_past_flt_max(std::vector<double> const& k, std::size_t d) {
  for (std::size_t t = 0; t < k.size() / d; ++t) {
    double sq = 0;
    for (std::size_t i = 0; i < d; ++i)
      sq += k[t * d + i] * k[t * d + i];
    if (std::sqrt(sq) > std::numeric_limits<float>::max())
      return static_cast<long>(t);
  }
  return -1;
}

std::string policy_args(std::string const& policy) {
  return policy == "key_diff_raw" ? "key_diff --param anchor=raw_mean" : policy;
}

/// Exit 0, no output, and the scores of expected_scores, all finite: knorm within 1e-5 relative, the cosines within
/// 1e-5 absolute.
void check_scores(std::string const& policy, std::string const& keys, std::vector<double> const& k, std::size_t d,
                  std::string const& out) {
  auto const r = run("score --policy " + policy_args(policy) + " --keys " + keys + " --out " + out);
  INFO(r.command << "\n--- output:\n" << r.output);
  REQUIRE(r.code == 0);
  CHECK(r.output.empty());
  auto const a = read(out);
  auto const expected = expected_scores(policy, k, d);
  REQUIRE(a.dtype == kvc::NpyDtype::f32);
  REQUIRE(a.shape == std::vector<Index>{1, 1, static_cast<Index>(expected.size())});
  for (std::size_t t = 0; t < expected.size(); ++t) {
    double const got = a.as<float>()[t], want = expected[t];
    INFO(policy << " token " << t << ": got " << got << ", expected " << want);
    REQUIRE(std::abs(want) <= std::numeric_limits<float>::max());  // the case itself is in range
    CHECK(std::isfinite(got));
    if (policy == "knorm")
      CHECK(std::abs(got - want) <= 1e-5 * std::abs(want));
    else
      CHECK(std::abs(got - want) <= 1e-5);
  }
}

/// knorm refuses the keys: exit 3 naming the keys file and the first key whose norm is past FLT_MAX ("has norm").
void check_norm_refused(std::string const& dir, std::string const& keys, long row, std::string const& out) {
  auto const r = run("score --policy knorm --keys " + keys + " --out " + out);
  check_error(r, 3, {"keys file " + keys + ": ", "the key at [0, 0, " + std::to_string(row) + "] has norm "});
  check_nothing_left(dir, {out});
}

}  // namespace

TEST_CASE(
    "hostile: finite keys of any magnitude score exactly with key_diff, and with knorm while the norm fits a float",
    "[tools][hostile]") {
  std::string const dir = fresh_dir("range");
  std::size_t const d = 4;
  auto const D = static_cast<Index>(d);
  // Mixed: rows at 1e20 (squares overflow fp32), near 3e38 (norm 3.3e38, just below FLT_MAX), at 1e-20 (squares
  // underflow fp32) and at 1e10 among ordinary rows. The raw anchor (~4e37) must be scaled for the 1e10 row.
  std::vector<float> mixed = values(8 * d, 27);
  auto set_row = [&](std::size_t t, std::initializer_list<float> row) {
    std::copy(row.begin(), row.end(), &mixed[t * d]);
  };
  set_row(1, {1e20f, 1.0f, -2.0f, 0.5f});
  set_row(3, {3e38f, 1e38f, -1e38f, 1.0f});  // ||k|| = 3.32e38 < FLT_MAX = 3.40e38
  set_row(4, {1e-20f, -2e-20f, 5e-21f, 1e-20f});
  set_row(5, {-1e20f, 1e20f, 3.0f, 1.0f});
  set_row(6, {0.0f, 0.25f, -3e38f, 2.0f});
  set_row(7, {1e10f, -3e9f, 2e10f, 1.0f});  // in fp32's range, but its dot with the raw anchor (~4e37) is not
  // Uniform scales: every row (and so every anchor component) at 1e20, 1e-20 or up to 3e38 (norms past FLT_MAX).
  auto scaled = [&](float s, std::uint32_t seed) {
    std::vector<float> v = values(8 * d, seed);
    for (float& x : v)
      x *= s;
    return v;
  };
  struct Set {
    std::string name;
    std::vector<float> data;
    bool knorm_refused;
  };
  std::vector<Set> const sets = {{"mixed", mixed, false},
                                 {"big", scaled(1e20f, 28), false},
                                 {"tiny", scaled(1e-20f, 28), false},
                                 {"max", scaled(3e38f, 29), true}};
  for (auto const& set : sets) {
    INFO(set.name << " keys");
    auto const path = npy(dir + "/" + set.name + ".npy", kvc::NpyDtype::f32, {1, 1, 8, D}, set.data);
    Snapshot const input{path};
    std::vector<double> const kd(set.data.begin(), set.data.end());
    for (char const* policy : {"key_diff", "key_diff_raw"})
      check_scores(policy, path, kd, d, dir + "/s_" + set.name + "_" + policy + ".npy");
    long const past = first_norm_past_flt_max(kd, d);
    REQUIRE((past >= 0) == set.knorm_refused);  // the case is what it claims
    if (set.knorm_refused)
      check_norm_refused(dir, path, past, dir + "/s_" + set.name + "_knorm.npy");
    else
      check_scores("knorm", path, kd, d, dir + "/s_" + set.name + "_knorm.npy");
    input.check();
  }

  // One row of 3e38 everywhere: its norm 3e38 * sqrt(d) is past FLT_MAX at every d >= 2. knorm refuses it (its
  // fp32 score would be -inf and tie), naming the key; key_diff scores it.
  for (std::size_t dd : {std::size_t{2}, std::size_t{4}}) {
    INFO("a norm past FLT_MAX at head_dim " << dd);
    std::vector<float> over = values(8 * dd, 29);
    std::fill_n(&over[2 * dd], dd, 3e38f);
    std::string const name = "over" + std::to_string(dd);
    auto const path = npy(dir + "/" + name + ".npy", kvc::NpyDtype::f32, {1, 1, 8, static_cast<Index>(dd)}, over);
    Snapshot const input{path};
    std::vector<double> const kd(over.begin(), over.end());
    REQUIRE(first_norm_past_flt_max(kd, dd) == 2);
    check_norm_refused(dir, path, 2, dir + "/s_" + name + "_knorm.npy");
    for (char const* policy : {"key_diff", "key_diff_raw"})
      check_scores(policy, path, kd, dd, dir + "/s_" + name + "_" + policy + ".npy");
    input.check();
  }

  // float16 at its largest finite value, 65504, is ordinary input.
  std::vector<kvc::half> k16;
  std::vector<double> k16d;
  for (float x : values(8 * d, 30))
    k16.emplace_back(x);
  for (std::size_t i = 0; i < d; ++i) {
    k16[2 * d + i] = kvc::half(65504.0f);
    k16[5 * d + i] = kvc::half(i % 2 ? -65504.0f : 65504.0f);
  }
  for (auto h : k16)
    k16d.push_back(static_cast<float>(h));
  REQUIRE(k16d[2 * d] == 65504.0);
  auto const keys16 = npy(dir + "/max16.npy", kvc::NpyDtype::f16, {1, 1, 8, D}, k16);
  Snapshot const inputs{keys16};
  for (char const* policy : {"knorm", "key_diff", "key_diff_raw"})
    check_scores(policy, keys16, k16d, d, dir + "/s16_" + policy + ".npy");
  auto const q16 =
      npy(dir + "/q16.npy", kvc::NpyDtype::f16, {1, 2, 4, D}, std::vector<kvc::half>(2 * 4 * d, kvc::half(65504.0f)));
  for (char const* policy : {"snap_kv --param window_size=4", "tova"}) {
    std::string const out = dir + "/s16_window.npy";
    auto const r = run("score --policy " + std::string(policy) + " --param queries=post_rope --keys " + keys16 +
                       " --queries " + q16 + " --out " + out);
    INFO(r.output);
    REQUIRE(r.code == 0);
    auto const a = read(out);
    for (Index t = 0; t < a.size(); ++t)
      CHECK(std::isfinite(a.as<float>()[t]));
  }
  CHECK(temporaries(dir).empty());
  inputs.check();
}

TEST_CASE("hostile: window keys or queries past the attention's exact range are refused, just inside it they score",
          "[tools][hostile]") {
  std::string const dir = fresh_dir("range_window");
  std::size_t const d = 4;
  auto const D = static_cast<Index>(d);
  // The bound: head_dim * x^2 < 2^126, |x| < 2^62 (4.6e18) at head_dim 4. 1e20 and 3e38 are past it; half the
  // bound is inside.
  double const bound = std::sqrt(0x1p126 / static_cast<double>(d));
  auto const inside = static_cast<float>(bound * 0.5);
  REQUIRE((1e20 > bound && 1e20 * 1e20 * static_cast<double>(d) >= 0x1p126));
  // Keys [1, 1, 16, 4] with two components at +-x; queries [1, 2, 4, 4] with +-x in the last row of each head (TOVA
  // reads only that row).
  auto keys_with = [&](std::string const& name, float x) {
    std::vector<float> kv = values(16 * d, 33);
    kv[2 * d] = x;
    kv[7 * d + 1] = -x;
    return npy(dir + "/" + name, kvc::NpyDtype::f32, {1, 1, 16, D}, kv);
  };
  auto queries_with = [&](std::string const& name, float x) {
    std::vector<float> qv = values(2 * 4 * d, 32);
    qv[3 * d] = x;
    qv[(4 + 3) * d + 1] = -x;
    return npy(dir + "/" + name, kvc::NpyDtype::f32, {1, 2, 4, D}, qv);
  };
  auto const k_ok = f32(dir + "/k_ok.npy", {1, 1, 16, 4}, 31), q_ok = f32(dir + "/q_ok.npy", {1, 2, 4, 4}, 34);
  auto const k20 = keys_with("k_1e20.npy", 1e20f), k38 = keys_with("k_3e38.npy", 3e38f);
  auto const q20 = queries_with("q_1e20.npy", 1e20f), q38 = queries_with("q_3e38.npy", 3e38f);
  auto const k_in = keys_with("k_inside.npy", inside), q_in = queries_with("q_inside.npy", inside);
  Snapshot const inputs{k_ok, q_ok, k20, k38, q20, q38, k_in, q_in};
  std::string const out = dir + "/s.npy";
  std::vector<std::string> const policies = {"snap_kv --param window_size=4 --param kernel_size=1", "tova"};
  auto score = [&](std::string const& policy, std::string const& queries, std::string const& k, std::string const& q) {
    return run("score --policy " + policy + " --param queries=" + queries + " --keys " + k + " --queries " + q +
               " --out " + out);
  };
  for (auto const& policy : policies)
    for (char const* queries : {"pre_rope", "post_rope"}) {
      INFO(policy << ", " << queries);
      // Past the bound: refused naming the file and the range.
      for (auto const& k : {k20, k38}) {
        check_error(score(policy, queries, k, q_ok), 3, {"keys file " + k + ": ", "exact range"});
        check_nothing_left(dir, {out});
      }
      for (auto const& q : {q20, q38}) {
        check_error(score(policy, queries, k_ok, q), 3, {"queries file " + q + ": ", "exact range"});
        check_nothing_left(dir, {out});
      }
      // Inside it (keys, queries or both at half the bound): finite scores in their range (SnapKV with
      // kernel_size=1: a prefix token's score is a sum of w = 4 probabilities; TOVA: a probability).
      for (auto const& [k, q] :
           std::vector<std::pair<std::string, std::string>>{{k_in, q_ok}, {k_ok, q_in}, {k_in, q_in}}) {
        auto const r = score(policy, queries, k, q);
        INFO(r.command << "\n--- output:\n" << r.output);
        REQUIRE(r.code == 0);
        auto const a = read(out);
        REQUIRE(a.shape == std::vector<Index>{1, 1, 16});
        bool const snap = policy.rfind("snap_kv", 0) == 0;
        for (Index t = 0; t < 16; ++t) {
          float const s = a.as<float>()[t];
          INFO("token " << t << ": " << s);
          CHECK(std::isfinite(s));
          if (!snap || t < 12)
            CHECK((s >= 0.0f && s <= (snap ? 4.0f : 1.0f) + 1e-5f));
        }
        fs::remove(out);
      }
    }
  CHECK(temporaries(dir).empty());
  inputs.check();
}

// ---------------------------------------------------------------------------------------------------------------
// 5. Small ones.

TEST_CASE("hostile: junk after the header dict, NaN and Inf are refused naming the file", "[tools][hostile]") {
  std::string const dir = fresh_dir("small");
  std::string const out = dir + "/s.npy", out_dir = dir + "/out";
  std::vector<float> const data = values(4, 35);
  std::string const bytes(reinterpret_cast<char const*>(data.data()), data.size() * sizeof(float));
  std::string const dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 1, 2, 2), }";
  auto const ok = dir + "/ok.npy";
  write_bytes(ok, raw_npy(dict, bytes));
  REQUIRE(run("score --policy knorm --keys " + ok + " --out " + out).code == 0);
  fs::remove(out);
  for (std::string const& junk :
       {std::string("junk"), std::string(" x"), std::string("}"), std::string(1, '\0') + "  "}) {
    std::string const path = dir + "/junk.npy";
    write_bytes(path, raw_npy(dict + junk, bytes));
    INFO("junk '" << junk << "'");
    check_error(run("score --policy knorm --keys " + path + " --out " + out), 3,
                {"keys file " + path + ": ", "after the header dict"});
    check_nothing_left(dir, {out});
  }

  // NaN in the keys, whatever the policy (streaming_llm and random read no key data, but the keys are validated);
  // +Inf in the keys; -Inf and NaN in the values.
  auto const k = f32(dir + "/k.npy", {1, 1, 4, 2}, 36);
  auto with = [&](std::string const& name, float bad) {
    std::vector<float> v = values(8, 37);
    v[5] = bad;
    return npy(dir + "/" + name, kvc::NpyDtype::f32, {1, 1, 4, 2}, v);
  };
  float const inf = std::numeric_limits<float>::infinity();
  auto const nan = with("nan.npy", std::numeric_limits<float>::quiet_NaN()), pinf = with("pinf.npy", inf),
             ninf = with("ninf.npy", -inf);
  Snapshot const inputs{k, nan, pinf, ninf};
  for (char const* policy : {"knorm", "key_diff", "streaming_llm", "random"}) {
    check_error(run("score --policy " + std::string(policy) + " --keys " + nan + " --out " + out), 3,
                {"keys file " + nan + ": ", "NaN"});
    check_nothing_left(dir, {out});
  }
  check_error(run("score --policy knorm --keys " + pinf + " --out " + out), 3, {"keys file " + pinf + ": ", "Inf"});
  for (auto const& bad : {nan, ninf}) {
    check_error(run("compress --policy knorm --ratio 0.5 --keys " + k + " --values " + bad + " --out-dir " + out_dir),
                3, {"values file " + bad, bad == nan ? "NaN" : "Inf"});
    check_nothing_left(dir, {out, out_dir});
  }
  inputs.check();
  std::vector<kvc::half> h(8, kvc::half(1.0f));
  h[2] = kvc::half::from_bits(0x7e00);  // float16 NaN
  auto const nan16 = npy(dir + "/nan16.npy", kvc::NpyDtype::f16, {1, 1, 4, 2}, h);
  check_error(run("score --policy knorm --keys " + nan16 + " --out " + out), 3, {"keys file " + nan16 + ": ", "NaN"});
  check_nothing_left(dir, {out});
}

TEST_CASE("hostile: the same file as keys and values, and odd but valid paths, are accepted", "[tools][hostile]") {
  std::string const dir = fresh_dir("odd_valid");
  auto const k = f32(dir + "/k.npy", {1, 2, 16, 4}, 38);
  Snapshot const inputs{k};
  std::string const link = dir + "/k_link.npy";
  fs::create_symlink(k, link);
  auto r = run("score --policy knorm --keys " + k + " --values " + link + " --out " + dir + "/s.npy");
  INFO(r.output);
  CHECK(r.code == 0);
  r = run("compress --policy key_diff --budget 8 --keys " + k + " --values " + k + " --out-dir " + dir + "/out");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(slurp(dir + "/out/keys.npy") == slurp(dir + "/out/values.npy"));
  // An output path through "..": it resolves only once sub/ exists (the kernel, not the text, decides).
  check_error(run("score --policy knorm --keys " + k + " --out " + dir + "/sub/../s2.npy"), 3,
              {"output file " + dir + "/sub/../s2.npy: "});
  CHECK(!exists(dir + "/s2.npy"));
  CHECK(!exists(dir + "/sub"));
  fs::create_directories(dir + "/sub");
  r = run("score --policy knorm --keys " + k + " --out " + dir + "/sub/../s2.npy");
  CHECK(r.code == 0);
  CHECK(exists(dir + "/s2.npy"));
  CHECK(temporaries(dir).empty());
  inputs.check();
}

TEST_CASE("hostile: rdkv and kivi refuse NaN and values past fp16, write nothing, and take a huge budget whole",
          "[tools][hostile][rdkv]") {
  std::string const dir = fresh_dir("rdkv");
  std::string const out_dir = dir + "/out";
  auto const k = f32(dir + "/k.npy", {1, 2, 12, 4}, 51);
  auto const q = f32(dir + "/q.npy", {1, 2, 4, 4}, 52);
  auto with = [&](std::string const& name, float bad) {
    std::vector<float> v = values(96, 53);
    v[17] = bad;
    return npy(dir + "/" + name, kvc::NpyDtype::f32, {1, 2, 12, 4}, v);
  };
  auto const nan = with("nan.npy", std::numeric_limits<float>::quiet_NaN()), big = with("big.npy", 1e6f),
             ok = with("ok.npy", 0.5f);
  Snapshot const inputs{k, q, nan, big, ok};
  std::string const rdkv = "compress --policy rdkv --budget 4 --param window_size=4 --queries " + q + " --keys " + k;
  check_error(run(rdkv + " --values " + nan + " --out-dir " + out_dir), 3, {"values file " + nan, "NaN"});
  check_nothing_left(dir, {out_dir});
  check_error(
      run("compress --policy kivi --param residual=4 --keys " + k + " --values " + nan + " --out-dir " + out_dir), 3,
      {"values file " + nan, "NaN"});
  check_nothing_left(dir, {out_dir});
  // 1e6 is finite in fp32 but past fp16's range: the packed store (fp16 raw values and params) cannot hold it.
  check_error(run(rdkv + " --values " + big + " --out-dir " + out_dir), 3, {"values file " + big, "FP16"});
  check_nothing_left(dir, {out_dir});
  // A budget far past the context (2^62 tokens) is every token and channel at 16 bits, without overflow.
  Result const r = run(rdkv.substr(0, rdkv.find("--budget")) + "--budget 4611686018427387904" +
                       rdkv.substr(rdkv.find(" --param")) + " --values " + ok + " --out-dir " + out_dir + " --time");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(contains(r.output, "\"retention\":1.0,"));
  auto const plan = slurp(out_dir + "/v_bits.npy");
  REQUIRE(plan);
  CHECK(plan->substr(plan->size() - 24) == std::string(24, '\x10'));  // 2 heads x 12 tokens at 16 bits
  inputs.check();
}
