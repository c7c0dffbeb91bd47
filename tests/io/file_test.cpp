// SPDX-License-Identifier: Apache-2.0
// tests/io/file_test.cpp: kvc/io/file.hpp: staged outputs (whole or not at all, alone and as a group) and the
// regular-file reader.
#include <kvc/io/file.hpp>

#include "support/catch.hpp"

#include <cstddef>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <sys/stat.h>
#include <unistd.h>
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
