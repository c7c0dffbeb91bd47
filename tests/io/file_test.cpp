// SPDX-License-Identifier: Apache-2.0
// tests/io/file_test.cpp: tools/io/file.hpp: staged outputs (whole or not at all, alone and as a group), the
// regular-file reader and the read-only mapping.

#include "io/file.hpp"

#include "support/catch.hpp"

#include <cstddef>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <sys/stat.h>
#include <type_traits>
#include <unistd.h>
#include <utility>
#include <vector>

namespace fs = std::filesystem;

namespace {

fs::path fresh_dir(std::string const& name) {
  fs::path const dir = fs::temp_directory_path() / (name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string text_of(fs::path const& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

std::vector<std::byte> bytes_of(std::string const& s) {
  std::vector<std::byte> b(s.size());
  for (std::size_t i = 0; i < s.size(); ++i)
    b[i] = static_cast<std::byte>(s[i]);
  return b;
}

/// Names in `dir` that are kvc temporaries or backups.
int leftovers(fs::path const& dir) {
  int n = 0;
  for (auto const& e : fs::directory_iterator(dir))
    n += e.path().filename().string().find(".kvc-") != std::string::npos;
  return n;
}

bool stage(kvc::StagedFile& f, fs::path const& path, std::string const& text) {
  std::string error;
  return f.open(path.string(), error) && f.write(bytes_of(text), error) && f.finish(error);
}

}  // namespace

TEST_CASE("file: a group commit that fails midway puts every replaced file back", "[io][file]") {
  fs::path const dir = fresh_dir("kvc_file_group");
  { std::ofstream(dir / "a.npy") << "old a"; }
  fs::create_directories(dir / "c.npy" / "inside");  // a non-empty folder: renaming a file over it fails
  std::vector<kvc::StagedFile> files(3);
  REQUIRE(stage(files[0], dir / "a.npy", "new a"));
  REQUIRE(stage(files[1], dir / "b.npy", "new b"));
  REQUIRE(stage(files[2], dir / "c.npy", "new c"));
  std::string error;
  std::size_t failed = 99;
  CHECK_FALSE(kvc::commit_together(files, error, failed));
  CHECK(failed == 2);
  CHECK(error.find("cannot move the finished output into place") != std::string::npos);
  CHECK(text_of(dir / "a.npy") == "old a");  // replaced, then restored from its hard-link backup
  CHECK_FALSE(fs::exists(dir / "b.npy"));    // new: removed again
  CHECK(fs::is_directory(dir / "c.npy" / "inside"));
  CHECK(leftovers(dir) == 0);  // no temporary, no backup
  fs::remove_all(dir);
}

TEST_CASE("file: a group commit replaces every file and leaves no backup", "[io][file]") {
  fs::path const dir = fresh_dir("kvc_file_group_ok");
  { std::ofstream(dir / "a.npy") << "old a"; }
  ::chmod((dir / "a.npy").c_str(), 0600);
  std::vector<kvc::StagedFile> files(2);
  REQUIRE(stage(files[0], dir / "a.npy", "new a"));
  REQUIRE(stage(files[1], dir / "b.npy", "new b"));
  std::string error;
  std::size_t failed = 99;
  REQUIRE(kvc::commit_together(files, error, failed));
  CHECK(text_of(dir / "a.npy") == "new a");
  CHECK(text_of(dir / "b.npy") == "new b");
  CHECK((fs::status(dir / "a.npy").permissions() & fs::perms::all) == (fs::perms::owner_read | fs::perms::owner_write));
  CHECK(leftovers(dir) == 0);
  fs::remove_all(dir);
}

TEST_CASE("file: an uncommitted staged file leaves the destination untouched", "[io][file]") {
  fs::path const dir = fresh_dir("kvc_file_discard");
  { std::ofstream(dir / "a.npy") << "old a"; }
  {
    kvc::StagedFile f;
    REQUIRE(stage(f, dir / "a.npy", "new a"));
    CHECK(leftovers(dir) == 1);
  }  // destroyed before commit
  CHECK(text_of(dir / "a.npy") == "old a");
  CHECK(leftovers(dir) == 0);
  fs::remove_all(dir);
}

TEST_CASE("file: the reader refuses what is not a regular file and reads a regular one whole", "[io][file]") {
  fs::path const dir = fresh_dir("kvc_file_read");
  { std::ofstream(dir / "x") << "hello"; }
  std::vector<std::byte> out;
  std::string error;
  REQUIRE(kvc::read_regular_file((dir / "x").string(), out, error));
  CHECK(out == bytes_of("hello"));
  CHECK_FALSE(kvc::read_regular_file((dir / "x").string(), out, error, 4));
  CHECK(error.find("more than the reader's limit of 4 bytes") != std::string::npos);
  CHECK_FALSE(kvc::read_regular_file(dir.string(), out, error));
  CHECK(error == "is a directory, expected a regular file");
  CHECK_FALSE(kvc::read_regular_file((dir / "missing").string(), out, error));
  CHECK(error.find("cannot open the file for reading") != std::string::npos);
  fs::remove_all(dir);
}

namespace {

/// Whether /proc/self/maps lists a mapping of `path` (Linux; false where /proc is absent).
bool mapped_in_proc(fs::path const& path) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line))
    if (line.size() >= path.string().size() &&
        line.compare(line.size() - path.string().size(), std::string::npos, path.string()) == 0)
      return true;
  return false;
}

}  // namespace

TEST_CASE("file: map_regular_file maps a regular file whole, and an empty one as an empty span", "[io][file]") {
  fs::path const dir = fresh_dir("kvc_file_map");
  { std::ofstream(dir / "x", std::ios::binary) << std::string("he\0llo", 6); }
  { std::ofstream(dir / "empty"); }
  kvc::MappedFile m;
  std::string error;
  REQUIRE(kvc::map_regular_file((dir / "x").string(), m, error));
  REQUIRE(m.bytes().size() == 6);
  CHECK(m.size() == 6);
  CHECK(std::vector<std::byte>(m.bytes().begin(), m.bytes().end()) == bytes_of(std::string("he\0llo", 6)));
  REQUIRE(kvc::map_regular_file((dir / "empty").string(), m, error));  // replaces (unmaps) the previous mapping
  CHECK(m.bytes().empty());
  CHECK(m.size() == 0);
  REQUIRE(kvc::map_regular_file((dir / "x").string(), m, error, 6));  // the limit is inclusive
  CHECK(m.size() == 6);
  fs::remove_all(dir);
}

TEST_CASE("file: map_regular_file refuses what read_regular_file refuses, leaving the output empty", "[io][file]") {
  fs::path const dir = fresh_dir("kvc_file_map_refuse");
  { std::ofstream(dir / "x") << "hello"; }
  REQUIRE(::mkfifo((dir / "fifo").c_str(), 0600) == 0);  // no writer: opening it for reading would block
  kvc::MappedFile m;
  std::string error;
  REQUIRE(kvc::map_regular_file((dir / "x").string(), m, error));
  CHECK_FALSE(kvc::map_regular_file((dir / "x").string(), m, error, 4));
  CHECK(error == "the file has 5 bytes, more than the reader's limit of 4 bytes");
  CHECK(m.bytes().empty());  // a failed call leaves `out` empty
  CHECK_FALSE(kvc::map_regular_file(dir.string(), m, error));
  CHECK(error == "is a directory, expected a regular file");
  CHECK_FALSE(kvc::map_regular_file((dir / "fifo").string(), m, error));
  CHECK(error == "is a FIFO (named pipe), expected a regular file");
  CHECK_FALSE(kvc::map_regular_file((dir / "missing").string(), m, error));
  CHECK(error.find("cannot open the file for reading") != std::string::npos);
  CHECK(m.bytes().empty());
  fs::remove_all(dir);
}

TEST_CASE("file: a MappedFile is move-only and unmaps when destroyed", "[io][file]") {
  static_assert(!std::is_copy_constructible_v<kvc::MappedFile> && !std::is_copy_assignable_v<kvc::MappedFile>);
  static_assert(std::is_nothrow_move_constructible_v<kvc::MappedFile>);
  fs::path const dir = fresh_dir("kvc_file_map_move");
  fs::path const path = dir / "weights.bin";
  { std::ofstream(path) << "0123456789"; }
  bool const have_proc = fs::exists("/proc/self/maps");
  {
    kvc::MappedFile a;
    std::string error;
    REQUIRE(kvc::map_regular_file(path.string(), a, error));
    std::byte const* const data = a.bytes().data();
    kvc::MappedFile b(std::move(a));
    CHECK(a.bytes().empty());  // NOLINT(bugprone-use-after-move): moved-from is specified empty
    CHECK(b.bytes().data() == data);
    CHECK(b.size() == 10);
    kvc::MappedFile c;
    c = std::move(b);
    CHECK(b.bytes().empty());  // NOLINT(bugprone-use-after-move)
    REQUIRE(c.size() == 10);
    CHECK(static_cast<char>(c.bytes()[9]) == '9');
    if (have_proc)
      CHECK(mapped_in_proc(path));
    c = kvc::MappedFile();  // move-assigning an empty one unmaps
    CHECK(c.bytes().empty());
    if (have_proc)
      CHECK_FALSE(mapped_in_proc(path));
    REQUIRE(kvc::map_regular_file(path.string(), c, error));
    if (have_proc)
      CHECK(mapped_in_proc(path));
  }  // destroyed: unmapped
  if (have_proc)
    CHECK_FALSE(mapped_in_proc(path));
  else
    WARN("/proc/self/maps is absent: the unmapping was not observed");
  fs::remove_all(dir);
}
