// SPDX-License-Identifier: Apache-2.0
// tools/kvc/outputs.cpp: the memory available, and the outputs of `kvc`: the checks of the output paths before any
// input is read, the staging of .npy files beside their destination, renamed into place all together, and the
// folders --out-dir creates.

#include "internal.hpp"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <span>
#include <stdexcept>
#include <sys/stat.h>
#include <unistd.h>

namespace kvc::cli {

std::size_t memory_bytes() {
  if (std::FILE* f = std::fopen("/proc/meminfo", "r")) {
    char line[256];
    unsigned long long kib = 0;
    bool found = false;
    while (!found && std::fgets(line, sizeof line, f))
      found = std::sscanf(line, "MemAvailable: %llu kB", &kib) == 1;
    std::fclose(f);
    if (found && kib > 0)
      return static_cast<std::size_t>(kib) * 1024;
  }
  long const pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<std::size_t>(pages) * static_cast<std::size_t>(page) : SIZE_MAX;
}

std::string bytes_text(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g GiB", bytes / (1024.0 * 1024.0 * 1024.0));
  return text;
}

std::vector<NamedInput> option_inputs(Options const& o) {
  std::vector<NamedInput> inputs;
  for (char const* opt : input_options)
    if (o.has(opt))
      inputs.emplace_back(opt, o.get(opt));
  return inputs;
}

void check_outputs(std::vector<NamedInput> const& inputs, std::vector<std::string> const& paths,
                   std::string const& what) {
  std::vector<std::optional<kvc::FileId>> ids;
  for (std::string const& path : paths) {
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
      fail(exit_invalid,
           what + " " + path + " exists and is not a regular file; expected a new path or a file to replace");
    std::optional<kvc::FileId> const id = kvc::file_id(path);
    for (auto const& [label, arg] : inputs)
      if (id && kvc::file_id(input_spec(arg).file) == id)
        fail(exit_invalid, what + " " + path + " is the same file as " + label + " " + arg +
                               ": refusing to overwrite an input (choose another output path)");
    for (std::size_t i = 0; i < ids.size(); ++i)
      if (id && ids[i] == id)
        fail(exit_invalid,
             what + " " + path + " is the same file as " + paths[i] + " (links): each output needs its own file");
    ids.push_back(id);
  }
}

namespace {

/// Stages an int8 array as .npy: the header of an int32 array of that shape with its descr '<i4' replaced by '|i1'
/// (the same length, so the padding holds), then one byte per element. (kvc::NpyDtype has no int8.)
bool stage_int8_npy(kvc::StagedFile& file, std::string const& path, std::vector<kvc::Index> const& shape,
                    void const* data, std::string& error) {
  std::vector<std::byte> header = kvc::npy_header(kvc::NpyDtype::i32, shape);
  std::string_view const text(reinterpret_cast<char const*>(header.data()), header.size());
  std::size_t const at = text.find("'<i4'");
  if (at == std::string_view::npos)
    throw std::logic_error("kvc: the .npy header of an int32 array has no '<i4'");
  std::memcpy(header.data() + at, "'|i1'", 5);
  std::size_t bytes = 1;
  for (kvc::Index d : shape)
    bytes *= static_cast<std::size_t>(d);
  return file.open(path, error) && file.write(header, error) &&
         file.write(std::span(static_cast<std::byte const*>(data), bytes), error) && file.finish(error);
}

}  // namespace

void stage_outputs(std::vector<Output> const& outputs, Staged& staged) {
  std::string error;
  for (Output const& out : outputs) {
    std::error_code ec;
    std::filesystem::path const real = std::filesystem::exists(out.path, ec) && !ec
                                           ? std::filesystem::canonical(out.path, ec)
                                           : std::filesystem::path(out.path);
    staged.files.emplace_back();
    staged.paths.push_back(out.path);
    std::string const dest = ec ? out.path : real.string();
    if (out.int8 ? !stage_int8_npy(staged.files.back(), dest, out.shape, out.data, error)
                 : !kvc::stage_npy(staged.files.back(), dest, out.dtype, out.shape, out.data, error))
      fail(exit_invalid, "output file " + out.path + ": " + error);
  }
}

void commit_outputs(Staged& staged) {
  std::string error;
  std::size_t failed = 0;
  if (!kvc::commit_together(staged.files, error, failed))
    fail(exit_invalid, "output file " + staged.paths[failed] + ": " + error);
}

void write_outputs(std::vector<Output> const& outputs) {
  Staged staged;
  stage_outputs(outputs, staged);
  commit_outputs(staged);
}

void make_folders(std::string const& dir, std::vector<std::string>& made) {
  std::string prefix;
  std::size_t start = 0;
  while (start <= dir.size()) {
    std::size_t const slash = std::min(dir.find('/', start), dir.size());
    prefix = dir.substr(0, slash);
    start = slash + 1;
    if (prefix.empty() || prefix.back() == '/')
      continue;  // the root, or a doubled slash
    if (::mkdir(prefix.c_str(), 0777) == 0) {
      made.push_back(prefix);
    } else if (errno != EEXIST) {
      int const err = errno;
      fail(exit_invalid, "--out-dir " + dir + ": cannot create the folder " + prefix + " (" + std::strerror(err) + ")");
    }
  }
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    fail(exit_invalid, "--out-dir " + dir + " is not a directory");
}

}  // namespace kvc::cli
