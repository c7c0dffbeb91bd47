// SPDX-License-Identifier: Apache-2.0
// tools/kvc/cli.cpp: the `kvc` command-line tool: score and compress .npy or .safetensors KV dumps with any kvc
// policy.
// Contract (docs/cli.md, DESIGN.md §6): exit 0 success, 2 usage error, 3 invalid input (the message names the file,
// the field and what was expected). Every policy is one row of policies() and one branch of with_policy().
// Files are untrusted (docs/cli.md "Untrusted input"): inputs must be regular files whose sizes bound every
// allocation; outputs are staged beside their destination and renamed into place only when all of them are whole.
#include "cli.hpp"

#include <kvc/backend/cpu/attention/attend.hpp>
#include <kvc/backend/cpu/attention/corrected.hpp>
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/pipeline/query_statistics.hpp>
#include <kvc/backend/cpu/pipeline/state.hpp>
#include <kvc/backend/cpu/scorers/key_diff.hpp>
#include <kvc/backend/cpu/scorers/knorm.hpp>
#include <kvc/backend/cpu/scorers/moment_kv.hpp>
#include <kvc/backend/cpu/scorers/random.hpp>
#include <kvc/backend/cpu/scorers/snap_kv.hpp>
#include <kvc/backend/cpu/scorers/streaming_llm.hpp>
#include <kvc/backend/cpu/scorers/tova.hpp>
#include <kvc/backend/cpu/scorers/uncomp.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/backend/cpu/selectors/uncomp.hpp>
#include <kvc/backend/cpu/thread_pool.hpp>
#include <kvc/core/rope.hpp>
#include <kvc/core/validate.hpp>
#include <kvc/engine/layer_compressor.hpp>
#include <kvc/pipeline/moment_kv.hpp>
#include <kvc/pipeline/press.hpp>
#include <kvc/store/ragged.hpp>

#include "common/isa.hpp"
#include "common/moment_kv.hpp"
#include "common/observations.hpp"
#include "common/policies.hpp"
#include "common/rdkv.hpp"
#include "common/uncomp.hpp"
#include "io/file.hpp"
#include "io/json.hpp"
#include "io/npy.hpp"
#include "io/safetensors.hpp"
#include "options.hpp"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <limits>
#include <map>
#include <memory>
#include <new>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <sys/stat.h>
#include <tuple>
#include <type_traits>
#include <unistd.h>
#include <utility>
#include <vector>

namespace {

using namespace kvc::tools;  // the policy table, Failure and the exit codes (tools/common/policies.hpp)
using kvc::cli::CommandInfo;
using kvc::cli::Options;

/// Where the tool prints: the standard streams for the program, others for the fuzzer.
struct Streams {
  std::FILE* out = stdout;
  std::FILE* err = stderr;
} io;

/// --rope theta=T,style=neox|interleaved (either key may be left out). Malformed text is a usage error.
kvc::RopeSpec parse_rope(std::string const& text) {
  kvc::RopeSpec spec;
  auto bad = [&](std::string const& why) {
    fail(exit_usage, "--rope '" + text + "': " + why + "; the form is theta=NUMBER,style=neox|interleaved");
  };
  bool seen_theta = false, seen_style = false;
  std::size_t start = 0;
  while (true) {
    std::size_t const comma = text.find(',', start);
    std::string const item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    std::size_t const eq = item.find('=');
    if (eq == std::string::npos || eq == 0)
      bad("'" + item + "' is not KEY=VALUE");
    std::string const key = item.substr(0, eq), value = item.substr(eq + 1);
    if (key == "theta") {
      if (std::exchange(seen_theta, true))
        bad("theta given twice");
      char* end = nullptr;
      spec.theta = std::strtod(value.c_str(), &end);
      if (value.empty() || *end != '\0' || !std::isfinite(spec.theta) || !(spec.theta > 1.0))
        bad("theta = '" + value + "': expected a number > 1");
    } else if (key == "style") {
      if (std::exchange(seen_style, true))
        bad("style given twice");
      if (value == "neox")
        spec.style = kvc::RopeStyle::neox;
      else if (value == "interleaved")
        spec.style = kvc::RopeStyle::interleaved;
      else
        bad("style = '" + value + "': expected neox or interleaved");
    } else {
      bad("unknown key '" + key + "'");
    }
    if (comma == std::string::npos)
      break;
    start = comma + 1;
  }
  return spec;
}

/// Usage checks of --queries, --positions and --rope against the policy (before any file is read). With --dump the
/// queries come from the dump folder (those options are refused there before this runs).
void check_query_options(PolicyInfo const& policy, Options const& o, Params const& p) {
  if (!policy.reads_queries) {
    for (char const* opt : {"--queries", "--positions", "--rope"})
      if (o.has(opt))
        fail(exit_usage, std::string(opt) + " given, but policy " + policy.name +
                             " does not read queries (the policies that do: " + policy_names(true) + ")");
    return;
  }
  if (!o.has("--queries") && !o.has("--dump"))
    fail(exit_usage, std::string("policy ") + policy.name +
                         " reads queries: pass --queries Q.npy (the context's last w queries, [B, Hq, w, d])");
  if (o.has("--rope") && p.at("queries") == "post_rope")
    fail(exit_usage, "--rope given, but --param queries=post_rope: post-RoPE queries are used as given");
}

// ---------------------------------------------------------------------------------------------------------------
// Memory and outputs.

/// The memory this program may take, in bytes: the kernel's estimate of memory available without swapping
/// (MemAvailable), or the physical memory where that is unknown. No buffer may be larger.
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

/// `count` elements of T for `what` (named in the error): refused when larger than this machine's memory, and an
/// allocation failure is reported as out of memory, naming what needed it.
template <class T>
std::vector<T> buffer(std::size_t count, std::string const& what, T fill = T{}) {
  double const bytes = static_cast<double>(count) * sizeof(T);
  std::size_t const available = memory_bytes();
  if (count > available / sizeof(T))
    fail(exit_invalid, what + " needs " + bytes_text(bytes) + ", more than the memory available (" +
                           bytes_text(static_cast<double>(available)) + ")");
  try {
    return std::vector<T>(count, fill);
  } catch (std::bad_alloc const&) {
    fail(exit_invalid, "out of memory: " + what + " needs " + bytes_text(bytes));
  }
}

/// An input argument: FILE (a .npy file), FILE.safetensors (its only tensor) or FILE.safetensors:TENSOR. The split
/// is at the last ':' and only when the text before it ends in ".safetensors", so a tensor whose name holds ':'
/// cannot be named (a file holding only that tensor can still be read without a name).
struct InputSpec {
  std::string file;    ///< the file part: what is opened, and compared with the outputs
  std::string tensor;  ///< the tensor's name; empty: the file's only tensor (or a .npy file)
  bool safetensors = false;
  bool named = false;  ///< a ':TENSOR' suffix was given (possibly empty)
};

InputSpec input_spec(std::string const& arg) {
  constexpr std::string_view ext = ".safetensors";
  auto ends_with_ext = [&](std::string_view s) {
    return s.size() >= ext.size() && s.substr(s.size() - ext.size()) == ext;
  };
  if (ends_with_ext(arg))
    return {arg, {}, true, false};
  std::size_t const colon = arg.rfind(':');
  if (colon != std::string::npos && ends_with_ext(std::string_view(arg).substr(0, colon)))
    return {arg.substr(0, colon), arg.substr(colon + 1), true, true};
  return {arg, {}, false, false};
}

/// The options naming input files, in the order they are read.
constexpr char const* input_options[] = {"--keys", "--values", "--queries", "--positions", "--indices"};

/// An input file for check_outputs: how messages name it ("--keys", "--dump input") and the argument.
using NamedInput = std::pair<std::string, std::string>;

/// The input files the options name.
std::vector<NamedInput> option_inputs(Options const& o) {
  std::vector<NamedInput> inputs;
  for (char const* opt : input_options)
    if (o.has(opt))
      inputs.emplace_back(opt, o.get(opt));
  return inputs;
}

/// Checks, before any input is read, that the output paths can be replaced: each is new or a regular file (never a
/// directory or a device such as /dev/null, which renaming would replace), none is one of the inputs, and no two are
/// the same file (same device and inode, whatever the paths: symbolic and hard links included). `what` names the
/// outputs in messages ("--out", "output file").
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

/// An array to write as a .npy file.
struct Output {
  std::string path;
  kvc::NpyDtype dtype;
  std::vector<kvc::Index> shape;
  void const* data;
  bool int8 = false;  ///< int8 data ('|i1', RDKV's bit plans): `dtype` is ignored
};

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

/// Writes every output whole or none: each is staged in a temporary file beside its destination (written, synced
/// and closed, every error checked), and they are renamed into place only once all are whole. A failure removes
/// the temporaries and names the file; the destinations keep what they held. (Links are followed: an existing
/// destination is replaced where its link points.)
struct Staged {
  std::vector<kvc::StagedFile> files;
  std::vector<std::string> paths;  ///< the outputs as named (for messages)
};

/// Stages `outputs` (written, synced and closed) into `staged`, to be committed with the rest by commit_outputs.
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

/// Renames every staged output into place, or none.
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

/// Creates `dir` and any missing parents, one component at a time, and records the folders it made (parents
/// first) so that a failure can remove exactly those.
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

// ---------------------------------------------------------------------------------------------------------------
// Inputs.

/// The element types the tool reads; `other` is any dtype it does not (named in messages by Array::dtype_text).
/// The fp8 types come from .safetensors only (F8_E4M3, F8_E5M2), for keys and values.
enum class Elem : std::uint8_t { f32, f16, bf16, f8_e4m3, f8_e5m2, i64, other };

/// An array read from a .npy file or from one tensor of a .safetensors file: C order, little-endian.
struct Array {
  Elem elem = Elem::other;
  bool safetensors = false;  ///< where it came from: messages name the .npy field 'descr' or the tensor's 'dtype'
  std::string dtype_text;    ///< the dtype as the file writes it: "<f8" (.npy) or "F64" (.safetensors)
  std::vector<kvc::Index> shape;
  std::vector<std::byte> data;

  kvc::Index size() const noexcept {
    kvc::Index n = 1;
    for (kvc::Index d : shape)
      n *= d;
    return n;
  }
  kvc::Index itemsize() const noexcept {
    return elem == Elem::f8_e4m3 || elem == Elem::f8_e5m2 ? 1
           : elem == Elem::f16 || elem == Elem::bf16      ? 2
           : elem == Elem::f32                            ? 4
                                                          : 8;
  }
  template <class T>
  T const* as() const noexcept {
    return reinterpret_cast<T const*>(data.data());
  }
  /// "field 'descr' is <f8, expected '<f4' (float32) or '<f2' (float16)", or the .safetensors wording.
  std::string dtype_error(char const* npy_expected, char const* safetensors_expected) const {
    return safetensors ? "field 'dtype' is " + dtype_text + ", expected " + safetensors_expected
                       : "field 'descr' is " + dtype_text + ", expected " + npy_expected;
  }
};

/// "'a', 'b', 'c'" for the first 16 tensors of `h`, then "and N more".
std::string tensor_names(kvc::SafetensorsHeader const& h) {
  std::string names;
  for (std::size_t i = 0; i < h.tensors.size() && i < 16; ++i)
    names += (i ? ", '" : "'") + kvc::json::printable(h.tensors[i].name) + "'";
  if (h.tensors.size() > 16)
    names += " and " + std::to_string(h.tensors.size() - 16) + " more";
  return names;
}

/// Reads the array `arg` names (see InputSpec) into `out`, or fails (exit 3) with `where` (e.g. "keys file K.npy: ")
/// before the reader's message. The file's size bounds every allocation, and no file larger than the memory
/// available is read (a sparse file may claim more than memory).
void read_array(std::string const& arg, std::string const& where, Array& out) {
  InputSpec const spec = input_spec(arg);
  std::string error;
  if (!spec.safetensors) {
    kvc::NpyArray a;
    if (!kvc::read_npy(spec.file, a, error, memory_bytes()))
      fail(exit_invalid, where + error);
    out.elem = a.dtype == kvc::NpyDtype::f32   ? Elem::f32
               : a.dtype == kvc::NpyDtype::f16 ? Elem::f16
               : a.dtype == kvc::NpyDtype::i64 ? Elem::i64
                                               : Elem::other;
    out.safetensors = false;
    out.dtype_text = std::string(kvc::npy_descr(a.dtype));
    out.shape = std::move(a.shape);
    out.data = std::move(a.data);
    return;
  }
  kvc::SafetensorsFile f;
  if (!kvc::read_safetensors(spec.file, f, error, memory_bytes()))
    fail(exit_invalid, where + error);
  kvc::SafetensorsTensor const* t = nullptr;
  if (spec.named) {
    t = f.header.find(spec.tensor);
    if (t == nullptr)
      fail(exit_invalid, where + "no tensor named '" + kvc::json::printable(spec.tensor) + "'; the file holds " +
                             (f.header.tensors.empty() ? std::string("no tensor") : tensor_names(f.header)));
  } else if (f.header.tensors.size() != 1) {
    fail(exit_invalid, where + "the file holds " + std::to_string(f.header.tensors.size()) + " tensors" +
                           (f.header.tensors.empty() ? std::string() : " (" + tensor_names(f.header) + ")") +
                           "; name one as " + spec.file + ":TENSOR");
  } else {
    t = &f.header.tensors[0];
  }
  using kvc::SafetensorsDtype;
  out.elem = t->dtype == SafetensorsDtype::f32       ? Elem::f32
             : t->dtype == SafetensorsDtype::f16     ? Elem::f16
             : t->dtype == SafetensorsDtype::bf16    ? Elem::bf16
             : t->dtype == SafetensorsDtype::f8_e4m3 ? Elem::f8_e4m3
             : t->dtype == SafetensorsDtype::f8_e5m2 ? Elem::f8_e5m2
             : t->dtype == SafetensorsDtype::i64     ? Elem::i64
                                                     : Elem::other;
  out.safetensors = true;
  out.dtype_text = std::string(kvc::safetensors_dtype_name(t->dtype));
  out.shape = t->shape;
  // The tensor's bytes, moved to the front of the file's buffer (no second copy of the file).
  auto const begin = static_cast<std::ptrdiff_t>(t->begin), bytes = static_cast<std::ptrdiff_t>(t->bytes);
  out.data = std::move(f.bytes);
  out.data.erase(out.data.begin(), out.data.begin() + begin);
  out.data.resize(static_cast<std::size_t>(bytes));
}

struct Input {
  std::string path;  ///< the argument as given (FILE, or FILE.safetensors:TENSOR), for messages
  Array array;
  float scale = 1.0f;  ///< fp8 tensors: the value of an element is decode(byte) * scale (--k-scale, --v-scale)

  bool fp8() const noexcept { return array.elem == Elem::f8_e4m3 || array.elem == Elem::f8_e5m2; }
};

/// Reads a rank-4 float32/float16 (or, from .safetensors, bfloat16 and with `fp8` F8_E4M3 / F8_E5M2) tensor; `role`
/// names it in messages ("keys file K.npy: ..."). The file's size bounds the array, and every dimension must be >= 1,
/// so that no size derived from the shape (scores, plans, workspaces) exceeds what the file holds.
Input load_tensor(std::string const& path, char const* role, char const* dims, bool fp8 = false) {
  Input in{path, {}};
  std::string const where = std::string(role) + " file " + path + ": ";
  read_array(path, where, in.array);
  auto const& s = in.array.shape;
  if (s.size() != 4)
    fail(exit_invalid,
         where + "field 'shape' has " + std::to_string(s.size()) + " dimensions, expected 4 (" + dims + ")");
  bool const accepted =
      in.array.elem == Elem::f32 || in.array.elem == Elem::f16 || in.array.elem == Elem::bf16 || (fp8 && in.fp8());
  if (!accepted)
    fail(exit_invalid, where + in.array.dtype_error("'<f4' (float32) or '<f2' (float16)",
                                                    fp8 ? "F32, F16, BF16, F8_E4M3 or F8_E5M2" : "F32, F16 or BF16"));
  if (std::find(s.begin(), s.end(), 0) != s.end())
    fail(exit_invalid, where + "field 'shape' is (" + std::to_string(s[0]) + ", " + std::to_string(s[1]) + ", " +
                           std::to_string(s[2]) + ", " + std::to_string(s[3]) +
                           "): every dimension must be >= 1 (an empty array holds nothing to score)");
  return in;
}

char const* const kv_dims = "[batch, kv_heads, tokens, head_dim]";

kvc::KVExtents extents_of(Input const& in) {
  auto const& s = in.array.shape;
  return {s[0], s[1], s[2], s[3]};
}

/// `x` in %.3g.
std::string short_number(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g", x);
  return text;
}

/// "beyond the exact range ..." for head dim `dim` (docs/numerics.md, "Range").
std::string range_text(kvc::Index dim) {
  return "beyond the exact range of attention logits in fp32 (head_dim * x^2 < 2^126: |x| < " +
         short_number(std::sqrt(0x1p126 / static_cast<double>(dim))) + " at head_dim " + std::to_string(dim) +
         "; see docs/numerics.md)";
}

/// What the keys must satisfy beyond finiteness for a policy's scores to be exact (docs/numerics.md, "Range").
enum class KeyRange : std::uint8_t {
  finite,  ///< KeyDiff (exact for every finite key) and the policies that read no data
  norms,   ///< Knorm: every key's norm below FLT_MAX (past it the fp32 score is -inf and such keys would tie)
  logits,  ///< window scorers: head_dim * x^2 < 2^126, so q.k logits stay finite
};

KeyRange key_range(PolicyInfo const& policy) {
  return policy.reads_queries ? KeyRange::logits
                              : (std::string_view(policy.name) == "knorm" ? KeyRange::norms : KeyRange::finite);
}

/// Fails naming the keys file when a row's norm (in double) exceeds FLT_MAX.
template <class Rows>
void check_key_norms(Rows const& rows, std::string const& path) {
  kvc::KVExtents const e = rows.extents();
  for (kvc::Index r = 0; r < e.rows(); ++r) {
    kvc::Index const b = r / (e.heads * e.tokens), h = r / e.tokens % e.heads, t = r % e.tokens;
    double const sum = kvc::detail::sum_squares_fp64(rows.row(b, h, t), e.dim);
    if (!(std::sqrt(sum) <= std::numeric_limits<float>::max()))
      fail(exit_invalid, "keys file " + path + ": field 'data': the key at [" + std::to_string(b) + ", " +
                             std::to_string(h) + ", " + std::to_string(t) + "] has norm " +
                             short_number(std::sqrt(sum)) +
                             ", past the largest float (3.4e38): its Knorm score would be -inf and tie with others "
                             "(see docs/numerics.md, Range)");
  }
}

/// Calls fn(T{}) with the element type of `in` (float, kvc::half, kvc::bfloat16 or an fp8 type).
template <class Fn>
void with_element(Input const& in, Fn&& fn) {
  if (in.array.elem == Elem::f16)
    fn(kvc::half{});
  else if (in.array.elem == Elem::bf16)
    fn(kvc::bfloat16{});
  else if (in.array.elem == Elem::f8_e4m3)
    fn(kvc::float8_e4m3{});
  else if (in.array.elem == Elem::f8_e5m2)
    fn(kvc::float8_e5m2{});
  else
    fn(float{});
}

/// The accessor of a view over `in`'s elements of type T: its scale for fp8 (core/access.hpp), plain otherwise.
template <class T>
kvc::default_access<T> access_of(Input const& in) {
  if constexpr (kvc::is_fp8<T>)
    return kvc::tensor_scale(in.scale);
  else
    return {};
}

/// Runs fn(cache) with a typed host view over keys (and values, or keys again when absent), once the data passed
/// the checks `range` asks for.
template <class Fn>
void with_cache(Input const& keys, Input const* values, KeyRange range, Fn&& fn) {
  kvc::KVExtents const ek = extents_of(keys);
  kvc::KVExtents ev = ek;
  if (values) {
    ev = extents_of(*values);
    if (ev.batch != ek.batch || ev.heads != ek.heads || ev.tokens != ek.tokens)
      fail(exit_invalid, "values file " + values->path + ": field 'shape' [B, Hkv, N] must equal the keys' (" +
                             std::to_string(ek.batch) + ", " + std::to_string(ek.heads) + ", " +
                             std::to_string(ek.tokens) + ")");
    if (values->array.elem != keys.array.elem)
      fail(exit_invalid, "values file " + values->path + ": field '" + (values->array.safetensors ? "dtype" : "descr") +
                             "' must equal the keys' dtype");
  }
  Input const& v = values ? *values : keys;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    auto* kp = const_cast<T*>(keys.array.as<T>());  // compaction writes to a copy owned by this program
    auto* vp = const_cast<T*>(v.array.as<T>());
    auto const cache =
        kvc::make_cache(kvc::bhtd_rows(kp, ek, access_of<T>(keys)), kvc::bhtd_rows(vp, ev, access_of<T>(v)));
    // Without --values the cache views K twice (scoring reads keys only), so only the keys are validated.
    kvc::Status const st =
        values ? kvc::validate(cache, {.check_finite = true}) : kvc::validate_rows(cache.keys, {.check_finite = true});
    if (!st.ok())
      fail(exit_invalid, "keys file " + keys.path + (values ? " / values file " + values->path : std::string()) + ": " +
                             st.message());
    if (range == KeyRange::logits && !kvc::validate_rows(cache.keys, {.check_range = true}).ok())
      fail(exit_invalid, "keys file " + keys.path + ": field 'data' holds a value " + range_text(ek.dim));
    if (range == KeyRange::norms)
      check_key_norms(cache.keys, keys.path);
    fn(cache);
  };
  with_element(keys, run);
}

/// Window queries widened to fp32 (exact for float16), their positions and the RoPE table that rotates them.
/// Not copyable: the table points into `rope_storage`.
struct Queries {
  std::string path, positions_path;
  kvc::KVExtents ext{};  ///< [B, Hq, w, d]
  std::vector<float> rows;
  std::vector<kvc::Index> positions;  ///< [B, w]; empty: the context's last w positions
  std::vector<float> rope_storage;
  kvc::RopeTable<> rope{};  ///< empty: post-RoPE queries
  std::size_t file_bytes = 0;

  Queries() = default;
  Queries(Queries const&) = delete;
  Queries& operator=(Queries const&) = delete;

  kvc::WindowQueries<float> view() const {
    return {kvc::TokenRows<float const, kvc::StridedLayout>(rows.data(), kvc::bhtd_layout(ext)), rope,
            positions.empty() ? nullptr : positions.data()};
  }
};

/// The largest RoPE table --positions may ask for (positions x head_dim fp32 cos/sin).
constexpr std::size_t max_rope_table_bytes = std::size_t{1} << 30;

void fill_query_rope(kvc::RopeSpec const& spec, kvc::Index max_position, Queries& q);

/// Loads the queries file `path` (and the positions file `positions_path`, when not empty) for keys of extents `*k`,
/// and fills the RoPE table when they are pre-RoPE. Without keys (`k` null: uncomp_entropy) the queries are checked
/// on their own (finite; no logit range) and the default positions are 0 .. w - 1.
void load_queries(std::string const& path, std::string const& positions_path, kvc::KVExtents const* keys,
                  std::string const& keys_path, bool rotate, kvc::RopeSpec const& spec, Queries& q) {
  q.path = path;
  Input const in = load_tensor(q.path, "queries", "[batch, query_heads, window, head_dim]");
  q.ext = extents_of(in);
  q.file_bytes = in.array.data.size();
  std::string const where = "queries file " + q.path + ": field 'shape': ";
  // Without keys the queries' own extents stand in for them (every check below then holds).
  kvc::KVExtents const k = keys ? *keys : kvc::KVExtents{q.ext.batch, q.ext.heads, q.ext.tokens, q.ext.dim};
  if (q.ext.batch != k.batch)
    fail(exit_invalid, where + "batch (shape[0]) is " + std::to_string(q.ext.batch) + ", expected the keys' " +
                           std::to_string(k.batch));
  if (k.heads <= 0 || q.ext.heads <= 0 || q.ext.heads % k.heads != 0)
    fail(exit_invalid, where + "query heads (shape[1]) is " + std::to_string(q.ext.heads) +
                           ", expected a positive multiple of the keys' KV heads (" + std::to_string(k.heads) + ")");
  if (q.ext.dim != k.dim)
    fail(exit_invalid, where + "head_dim (shape[3]) is " + std::to_string(q.ext.dim) + ", expected the keys' " +
                           std::to_string(k.dim) + " (" + keys_path + ")");
  q.rows = buffer<float>(static_cast<std::size_t>(q.ext.rows() * q.ext.dim), "the fp32 copy of queries file " + q.path);
  for (std::size_t i = 0; i < q.rows.size(); ++i) {
    q.rows[i] = in.array.elem == Elem::f16    ? kvc::to_float(in.array.as<kvc::half>()[i])
                : in.array.elem == Elem::bf16 ? kvc::to_float(in.array.as<kvc::bfloat16>()[i])
                                              : in.array.as<float>()[i];
    if (!std::isfinite(q.rows[i]))
      fail(exit_invalid, "queries file " + q.path + ": field 'data' holds NaN or Inf (element " + std::to_string(i) +
                             "), expected finite values");
    if (keys && !kvc::in_exact_range(q.rows[i], q.ext.dim))
      fail(exit_invalid, "queries file " + q.path + ": field 'data': element " + std::to_string(i) + " is " +
                             short_number(q.rows[i]) + ", " + range_text(q.ext.dim));
  }

  kvc::Index max_position = k.tokens - 1;  // the default positions end at N - 1
  if (!positions_path.empty()) {
    q.positions_path = positions_path;
    std::string const pw = "positions file " + q.positions_path + ": ";
    Array p;
    read_array(q.positions_path, pw, p);
    if (p.elem != Elem::i64)
      fail(exit_invalid, pw + p.dtype_error("'<i8' (int64)", "I64"));
    if (p.shape != std::vector<kvc::Index>{q.ext.batch, q.ext.tokens})
      fail(exit_invalid, pw + "field 'shape' has " + std::to_string(p.shape.size()) +
                             " dimensions or other sizes, expected [batch, window] = [" + std::to_string(q.ext.batch) +
                             ", " + std::to_string(q.ext.tokens) + "] (the queries' shape[0] and shape[2])");
    q.positions = buffer<kvc::Index>(static_cast<std::size_t>(p.size()), "the positions of " + q.positions_path);
    std::copy_n(p.as<std::int64_t>(), p.size(), q.positions.data());
    max_position = 0;
    std::size_t const per_position = static_cast<std::size_t>(q.ext.dim) * sizeof(float);
    for (std::size_t i = 0; i < q.positions.size(); ++i) {
      kvc::Index const pos = q.positions[i];
      if (pos < 0)
        fail(exit_invalid, pw + "field 'data': position " + std::to_string(pos) + " (element " + std::to_string(i) +
                               ") is negative, expected >= 0");
      if (rotate && static_cast<std::size_t>(pos) >= max_rope_table_bytes / per_position)
        fail(exit_invalid, pw + "field 'data': position " + std::to_string(pos) +
                               " needs a RoPE table over 1 GiB; expected positions < " +
                               std::to_string(max_rope_table_bytes / per_position));
      max_position = std::max(max_position, pos);
    }
  }
  if (rotate)
    fill_query_rope(spec, max_position, q);
}

/// Fills the RoPE table of `q` (pre-RoPE queries) over positions [0, max_position].
void fill_query_rope(kvc::RopeSpec const& spec, kvc::Index max_position, Queries& q) {
  std::string const where = "queries file " + q.path + ": field 'shape': ";
  if (auto const st = spec.check(q.ext.dim); !st.ok())
    fail(exit_invalid, where + "head_dim (shape[3]) is " + std::to_string(q.ext.dim) +
                           ": RoPE rotates pairs of channels, expected an even head_dim (or pass "
                           "--param queries=post_rope for queries already rotated)");
  kvc::Index const table_positions = std::max<kvc::Index>(1, max_position + 1);
  q.rope_storage = buffer<float>(static_cast<std::size_t>(kvc::rope_table_floats(table_positions, q.ext.dim)),
                                 "the RoPE table of queries file " + q.path);
  if (auto const st = kvc::fill_rope_table(spec, q.ext.dim, table_positions, q.rope_storage.data(), q.rope); !st.ok())
    fail(exit_invalid, "--rope: " + std::string(st.message()));
}

/// Query rows a scorer reads: the last `rows_used` of the `rows` given (SnapKV its window, TOVA the newest row;
/// the statistics of ExpectedAttention and the attention H2O accumulates use every row).
kvc::Index rows_used(kvc::SnapKVScorer const& s, kvc::Index) {
  return s.window_size;
}
kvc::Index rows_used(kvc::TOVAScorer const&, kvc::Index) {
  return 1;
}
kvc::Index rows_used(kvc::UNCompScorer<> const& s, kvc::Index) {
  return s.window_size;
}
template <class MT>
kvc::Index rows_used(kvc::MomentKVScorer<kvc::HostSpace, MT> const& s, kvc::Index) {
  return s.base.window_size;
}
template <class S>
kvc::Index rows_used(S const&, kvc::Index rows) {
  return rows;
}

/// Fails (exit 3) unless the queries hold the last `used` rows policy `policy` reads and, without --positions, those
/// rows fit a context of `tokens` (they sit at positions tokens - used .. tokens - 1).
void check_rows_used(kvc::Index used, std::string_view policy, kvc::Index tokens, Queries const& q,
                     std::string const& keys_path) {
  if (used > q.ext.tokens)
    fail(exit_invalid, "queries file " + q.path + ": field 'shape': window (shape[2]) is " +
                           std::to_string(q.ext.tokens) + ", but policy " + std::string(policy) + " reads the last " +
                           std::to_string(used) +
                           " query rows (--param window_size); pass more queries or a smaller window_size");
  if (q.positions.empty() && used > tokens)
    fail(exit_invalid, "keys file " + keys_path + ": field 'shape': tokens (shape[2]) is " + std::to_string(tokens) +
                           ", but the last " + std::to_string(used) + " query rows sit at positions N - " +
                           std::to_string(used) + " .. N - 1 (pass --positions P.npy)");
}

/// Calls fn(scorer, obs) with the observations the scorer needs (tools/common/observations.hpp) after checking
/// that the queries hold the rows it reads and that those rows fit the context.
template <class S, class C, class Fn>
void with_observations(S const& scorer, C const& cache, Queries const& q, std::string const& keys_path,
                       kvc::RopeSpec const& spec, Fn&& fn) {
  check_rows_used(rows_used(scorer, q.ext.tokens), S::name, cache.keys.extents().tokens, q, keys_path);
  kvc::tools::ObservationStorage store;
  kvc::tools::ObservedQueries const observed{
      kvc::TokenRows<float const, kvc::StridedLayout>(q.rows.data(), kvc::bhtd_layout(q.ext)),
      q.positions.empty() ? nullptr : q.positions.data(), q.rope, spec, !q.rope.empty()};
  kvc::tools::with_observations(scorer, cache, observed, "queries file " + q.path, store, fn);
}

// ---------------------------------------------------------------------------------------------------------------
// Running.

template <class Fn>
double median_seconds(int repeats, Fn&& fn) {
  std::vector<double> s;
  for (int r = 0; r < repeats; ++r) {
    auto const t0 = std::chrono::steady_clock::now();
    fn();
    s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(s.begin(), s.end());
  return s[s.size() / 2];
}

constexpr int timing_repeats = 7;

/// What compress measured (kvc::store_report, in the input dtype): K + V bytes of the input, of a uniform cache
/// padded to the longest head (what keys.npy and values.npy hold) and of the ragged store holding exactly each
/// head's kept tokens.
struct Memory {
  kvc::Index input_bytes = 0;
  kvc::Index padded_bytes = 0;
  kvc::Index ragged_bytes = 0;
  kvc::Index row_bytes = 0;  ///< one token of one head: its K row + V row
  kvc::Index input_tokens = 0;
  kvc::Index kept_tokens = 0;
  bool moments = false;              ///< moment_kv: the moments of the evicted sets are reported too
  kvc::Index moment_bytes = 0;       ///< all heads' moments (moment_state_bytes), in the storage dtype
  kvc::Index moment_head_bytes = 0;  ///< one head's (moment_head_bytes)
  // rdkv and kivi (a packed store, kvc::PackedKV, plus the fp16 tail of the newest `residual` tokens):
  bool packed = false;
  std::int64_t payload_bits = 0;   ///< codes and raw fp16 of the packed store (PackedKV::payload_bits) + the tail's
  std::int64_t overhead_bits = 0;  ///< scales, offsets, pads, channel permutation (PackedKV::overhead_bits)
  kvc::Index tail_tokens = 0;      ///< tokens kept in fp16 outside the packed store (residual)
  std::int64_t full_bits = 0;      ///< 2 N d 16 per head: the fp16 cache the retention is a fraction of

  Memory& operator+=(Memory const& m) {
    packed = m.packed;
    payload_bits += m.payload_bits;
    overhead_bits += m.overhead_bits;
    tail_tokens += m.tail_tokens;
    full_bits += m.full_bits;
    moments = m.moments;
    moment_bytes += m.moment_bytes;
    moment_head_bytes = m.moment_head_bytes;
    input_bytes += m.input_bytes;
    padded_bytes += m.padded_bytes;
    ragged_bytes += m.ragged_bytes;
    row_bytes = m.row_bytes;  // every layer of a dump has the same shape
    input_tokens += m.input_tokens;
    kept_tokens += m.kept_tokens;
    return *this;
  }
};

/// One --time line on stderr: compact JSON (nlohmann-json), keys in the order set.
void print_json_line(nlohmann::ordered_json const& j) {
  std::fprintf(io.err, "%s\n", j.dump().c_str());
}

/// What --time prints (one JSON line on stderr).
struct Timing {
  double seconds = 0;               ///< scoring, median
  double select_seconds = -1;       ///< compress: the selection, median (left out when negative)
  std::size_t workspace_bytes = 0;  ///< kvc's workspaces for the calls timed (score; compress: the compressor's)
  kvc::Index threads = 1;
  std::size_t bytes_read = 0;
  std::optional<Memory> memory;  ///< compress
  std::size_t state_bytes = 0;   ///< compress: the compressor's state (LayerCompressor::state_bytes)
};

/// The --time line. `allocator` (empty: none) and `layer` (a --dump layer; "layers" for a dump's total line) are
/// printed when given.
void print_time(char const* command, PolicyInfo const& policy, std::string const& allocator,
                std::optional<std::pair<char const*, kvc::Index>> layer, Timing const& t) {
  nlohmann::ordered_json j;
  j["command"] = command;
  j["policy"] = policy.name;
  if (!allocator.empty())
    j["allocator"] = allocator;
  if (layer)
    j[layer->first] = layer->second;  // "layer": L (one layer of a dump) or "layers": count (the total)
  j["seconds"] = t.seconds;
  if (t.select_seconds >= 0)
    j["select_seconds"] = t.select_seconds;
  j["repeats"] = timing_repeats;
  j["bytes_read"] = t.bytes_read;
  j["workspace_bytes"] = t.workspace_bytes;
  if (t.memory && t.memory->packed) {
    Memory const& m = *t.memory;
    std::int64_t const payload_bytes = (m.payload_bits + 7) / 8, overhead_bytes = (m.overhead_bits + 7) / 8;
    j["input_bytes"] = m.input_bytes;
    j["input_tokens"] = m.input_tokens;
    j["kept_tokens"] = m.kept_tokens;
    j["tail_tokens"] = m.tail_tokens;
    j["payload_bits"] = m.payload_bits;
    j["overhead_bits"] = m.overhead_bits;
    j["payload_bytes"] = payload_bytes;
    j["overhead_bytes"] = overhead_bytes;
    j["packed_bytes"] = payload_bytes + overhead_bytes;
    j["state_bytes"] = t.state_bytes;
    j["retention"] = m.full_bits > 0 ? static_cast<double>(m.payload_bits) / static_cast<double>(m.full_bits) : 0.0;
  } else if (t.memory) {
    Memory const& m = *t.memory;
    j["state_bytes"] = t.state_bytes;
    j["input_bytes"] = m.input_bytes;
    j["padded_bytes"] = m.padded_bytes;
    j["ragged_bytes"] = m.ragged_bytes;
    j["row_bytes"] = m.row_bytes;
    j["input_tokens"] = m.input_tokens;
    j["kept_tokens"] = m.kept_tokens;
    if (m.moments) {
      j["moment_bytes"] = m.moment_bytes;
      j["moment_head_bytes"] = m.moment_head_bytes;
      j["moment_ratio"] =
          m.ragged_bytes > 0 ? static_cast<double>(m.moment_bytes) / static_cast<double>(m.ragged_bytes) : 0.0;
    }
  }
  j["threads"] = t.threads;
  j["isa"] = compiled_isa();
  print_json_line(j);
}

/// --threads N (default 1): the worker threads of kvc::ThreadPool the kernels spread (sequence, head) items over.
kvc::Index thread_count(Options const& o) {
  kvc::Index const n = o.has("--threads") ? parse_count(o.get("--threads"), "--threads", 1) : 1;
  if (n > 1024)
    fail(exit_invalid, "--threads " + o.get("--threads") + ": expected at most 1024");
  return n;
}

/// --k-scale / --v-scale S: the fp32 scale of fp8 keys / values (vLLM's k_scale, v_scale: an element's value is
/// decode(byte) * S); finite and > 0. Absent: 1 for fp8 tensors.
std::optional<float> scale_option(Options const& o, char const* name) {
  if (!o.has(name))
    return std::nullopt;
  std::string const& text = o.get(name);
  char* end = nullptr;
  float const s = std::strtof(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !std::isfinite(s) || !(s > 0.0f))
    fail(exit_invalid, std::string(name) + " '" + text + "': expected a finite number > 0 (the fp8 tensor's scale)");
  return s;
}

/// Gives `in` the scale of option `name`, which only an fp8 tensor takes.
void set_scale(Input& in, std::optional<float> scale, char const* name, char const* role) {
  if (!scale)
    return;
  if (!in.fp8())
    fail(exit_invalid, std::string(name) + " given, but " + role + " file " + in.path + " holds " +
                           in.array.dtype_text + ": a scale applies to F8_E4M3 and F8_E5M2 tensors only");
  in.scale = *scale;
}

void check_status(kvc::Status st, std::string const& context) {
  if (!st.ok())
    fail(exit_invalid, context + ": " + st.message());
}

/// The input files of one job: the options' files, or one layer of a --dump folder (empty: not given).
struct JobFiles {
  std::string keys, values, queries, positions;
};

JobFiles option_files(Options const& o) {
  return {o.get("--keys"), o.get("--values"), o.get("--queries"), o.get("--positions")};
}

/// What score and compress share: the policy (with the allocators' parameters for compress --allocator), its
/// parameters, the keys (and values) and the queries.
struct Job {
  PolicyInfo policy;
  Params params;
  bool rotate = false;  ///< pre-RoPE queries, rotated with `rope`
  kvc::RopeSpec rope{};
  Input keys;
  std::optional<Input> values;
  Queries queries;
  std::optional<float> k_scale, v_scale;  ///< --k-scale, --v-scale (fp8 keys and values)

  explicit Job(PolicyInfo p) : policy(std::move(p)) {}

  std::size_t bytes_read() const {
    return (policy.reads_keys ? keys.array.data.size() : 0) + (policy.reads_queries ? queries.file_bytes : 0);
  }
  std::string context() const {
    return "keys file " + keys.path + (policy.reads_queries ? " / queries file " + queries.path : std::string());
  }

  /// Calls fn(scorer, selection, cache, obs) with everything typed.
  template <class Fn>
  void run(Fn&& fn) const {
    with_policy(policy, params, [&](auto const& scorer, Selection sel) {
      with_cache(keys, values ? &*values : nullptr, key_range(policy), [&](auto const& cache) {
        if constexpr (kvc::has_need(std::remove_cvref_t<decltype(scorer)>::needs, kvc::Needs::window_queries) ||
                      kvc::has_need(std::remove_cvref_t<decltype(scorer)>::needs, kvc::Needs::query_statistics) ||
                      kvc::StatefulScorer<std::remove_cvref_t<decltype(scorer)>>)
          with_observations(scorer, cache, queries, keys.path, rope,
                            [&](auto const& live, auto const& obs) { fn(live, sel, cache, obs); });
        else
          fn(scorer, sel, cache, kvc::NoObservations{});
      });
    });
  }
};

/// The option checks: usage errors (exit 2) first, then the `queries` parameter's value.
void check_job(Options const& o, bool compress, Job& job) {
  job.params = resolve_params(job.policy, o.params, compress);
  check_query_options(job.policy, o, job.params);
  job.k_scale = scale_option(o, "--k-scale");
  job.v_scale = scale_option(o, "--v-scale");
  if (o.has("--rope"))
    job.rope = parse_rope(o.get("--rope"));
  job.rotate = job.policy.reads_queries && pre_rope(job.params);
}

/// Reads the keys, the values and the queries.
void load_job(JobFiles const& files, Job& job) {
  job.keys = load_tensor(files.keys, "keys", kv_dims, /*fp8=*/true);
  set_scale(job.keys, job.k_scale, "--k-scale", "keys");
  if (!files.values.empty()) {
    job.values = load_tensor(files.values, "values", kv_dims, /*fp8=*/true);
    set_scale(*job.values, job.v_scale, "--v-scale", "values");
  } else if (job.v_scale) {
    fail(exit_invalid, "--v-scale given without --values");
  }
  kvc::KVExtents const keys_ext = extents_of(job.keys);
  if (job.policy.reads_queries)
    load_queries(files.queries, files.positions, &keys_ext, job.keys.path, job.rotate, job.rope, job.queries);
}

/// A kernel's workspace: uninitialised (kernels write before they read, so untouched pages cost nothing), within
/// the memory available, and refused with a message when its size saturated (a product of two inputs' sizes).
struct Scratch {
  std::unique_ptr<std::byte[]> data;
  std::size_t size = 0;
  kvc::Workspace span() const { return {data.get(), size}; }
};

Scratch workspace(std::size_t bytes, std::string const& what) {
  std::size_t const available = memory_bytes();
  if (bytes > available)
    fail(exit_invalid,
         what + " needs " +
             (bytes == SIZE_MAX ? std::string("more than 2^64 bytes") : bytes_text(static_cast<double>(bytes))) +
             ", more than the memory available (" + bytes_text(static_cast<double>(available)) + ")");
  Scratch s{std::unique_ptr<std::byte[]>(new (std::nothrow) std::byte[bytes == 0 ? 1 : bytes]), bytes};
  if (!s.data)
    fail(exit_invalid, "out of memory: " + what + " needs " + bytes_text(static_cast<double>(bytes)));
  return s;
}

Scratch workspace(std::size_t bytes, Job const& job) {
  return workspace(bytes, "the workspace of policy " + std::string(job.policy.name) + " over " + job.context());
}

/// The RoPE table a compressor of scorer `s` rotates the job's queries with: the queries' own (empty for post-RoPE
/// rows), or for ExpectedAttention one over [0, max(N, R) + n_future_positions) in `storage` (it averages RoPE over
/// the positions after t0: N, or kvpress's R).
template <class S>
kvc::RopeTable<> compressor_rope(S const& s, Job const& job, std::vector<float>& storage) {
  if constexpr (requires { s.n_future_positions; }) {
    if (!job.rotate)
      fail(exit_invalid, "queries file " + job.queries.path + ": policy " + std::string(S::name) +
                             " estimates future queries from PRE-RoPE samples: pass pre-RoPE queries (not "
                             "--param queries=post_rope)");
    kvc::Index const d = job.queries.ext.dim;
    kvc::Index const positions = std::max(extents_of(job.keys).tokens, job.queries.ext.tokens) + s.n_future_positions;
    storage = buffer<float>(static_cast<std::size_t>(kvc::rope_table_floats(positions, job.rope.rotated(d))),
                            "the RoPE table of queries file " + job.queries.path);
    kvc::RopeTable<> table;
    if (auto const st = kvc::fill_rope_table(job.rope, d, positions, storage.data(), table); !st.ok())
      fail(exit_invalid, "queries file " + job.queries.path + ": --rope: " + std::string(st.message()));
    return table;
  } else {
    return job.queries.rope;
  }
}

/// The last `used` query rows of a job, in place ([B, Hq, used, d] inside the file's [B, Hq, R, d]), and their
/// positions [B, used]: --positions', or N - used .. N - 1. What a compressor's prefill is handed.
struct LastRows {
  std::vector<kvc::Index> positions;
  kvc::LayerQueries<float> queries{};
};

LastRows last_rows(Job const& job, kvc::Index used) {
  Queries const& q = job.queries;
  kvc::Index const batch = extents_of(job.keys).batch, tokens = extents_of(job.keys).tokens, r = q.ext.tokens;
  LastRows l;
  l.positions = buffer<kvc::Index>(static_cast<std::size_t>(batch * used), "the positions of " + job.context());
  for (kvc::Index b = 0; b < batch; ++b)
    for (kvc::Index i = 0; i < used; ++i)
      l.positions[static_cast<std::size_t>(b * used + i)] =
          q.positions.empty() ? tokens - used + i : q.positions[static_cast<std::size_t>(b * r + r - used + i)];
  kvc::StridedLayout window = kvc::bhtd_layout(q.ext);
  window.ext.tokens = used;
  l.queries = {{used > 0 ? q.rows.data() + (r - used) * q.ext.dim : nullptr, window}, l.positions.data()};
  return l;
}

/// A compressor's caller-owned memory: its state (bound) and its workspace.
struct CompressorMemory {
  Scratch state, ws;
};

/// What an engine does once per layer: plans `c` for the job's cache and `rows` query rows per sequence, allocates
/// its state and workspace and binds the state. `what` names the policy and the files in errors.
template <class P, class C>
CompressorMemory start_compressor(kvc::LayerCompressor<P, kvc::Cpu>& c, C const& cache, Job const& job, kvc::Index rows,
                                  std::string const& what) {
  kvc::Index const heads = rows > 0 ? job.queries.ext.heads : cache.keys.extents().heads;
  check_status(c.plan(cache, kvc::QueryShape{heads, rows, 1, 1}), what);
  CompressorMemory m{workspace(c.state_bytes(), "the state of " + what), workspace(c.workspace_bytes(), job)};
  check_status(c.bind(m.state.data.get(), m.state.size), what);
  return m;
}

/// A job's original keys and values, kept for --time when its compression works in place: every timed repeat
/// starts from them again.
struct SavedInput {
  std::vector<std::byte> keys, values;

  explicit SavedInput(Job const& job)
      : keys(buffer<std::byte>(job.keys.array.data.size(), "a copy of " + job.keys.path)),
        values(buffer<std::byte>(job.values->array.data.size(), "a copy of " + job.values->path)) {
    std::copy(job.keys.array.data.begin(), job.keys.array.data.end(), keys.begin());
    std::copy(job.values->array.data.begin(), job.values->array.data.end(), values.begin());
  }
};

/// The median of timing_repeats calls of `once` (a compressor's reset + prefill), each over the original input:
/// before each, untimed, the input is restored from `saved` and `restart` resets what goes with it (the lengths and
/// positions tables).
template <class Restart, class Once>
double median_from_original(Job& job, SavedInput const& saved, Restart&& restart, Once&& once) {
  std::vector<double> seconds;
  for (int r = 0; r < timing_repeats; ++r) {
    std::copy(saved.keys.begin(), saved.keys.end(), job.keys.array.data.begin());
    std::copy(saved.values.begin(), saved.values.end(), job.values->array.data.begin());
    restart();
    seconds.push_back(median_seconds(1, once));
  }
  std::sort(seconds.begin(), seconds.end());
  return seconds[seconds.size() / 2];
}

/// compress --time's line for a compressor run with `threads` workers: the median of `once` over the original input
/// (with --time: `saved` is set) and the compressor's workspace and state.
template <class Restart, class Once>
Timing compressor_timing(Job& job, std::optional<SavedInput> const& saved, CompressorMemory const& memory,
                         kvc::Index threads, Restart&& restart, Once&& once) {
  Timing t;
  if (saved)
    t = {median_from_original(job, *saved, restart, once), -1, memory.ws.size, threads, job.bytes_read(), std::nullopt};
  t.state_bytes = memory.state.size;
  return t;
}

/// What every job of one compress call shares.
struct CompressSettings {
  AllocatorChoice alloc;
  bool ragged = false;  ///< per-head counts: the ragged store is written too (an allocator, or uncomp)
  std::optional<kvc::tools::Calibration> calibration;  ///< uncomp
  std::string calibration_path;
  kvc::Index layer = 0;  ///< uncomp: the calibration's layer of the job
  std::optional<double> ratio;
  kvc::Index budget = 0;
  kvc::Index threads = 1;
  bool time = false;
};

// ---------------------------------------------------------------------------------------------------------------
// MomentKV (tools/common/moment_kv.hpp): its score before any eviction, its prefill compression with the moments of
// the evicted sets, and the moments' files (written by compress, read by attend).

bool is_moment_kv(PolicyInfo const& policy) {
  return std::string_view(policy.name) == "moment_kv";
}

bool is_uncomp(PolicyInfo const& policy) {
  return std::string_view(policy.name) == "uncomp";
}

/// gqa=expand: the keys or values [B, Hkv, N, d] repeated to [B, Hq, N, d] (query head q reads KV head q / (Hq / Hkv)),
/// the authors' per-query-head caches.
void expand_heads(Input& in, kvc::Index hq) {
  auto const& s = in.array.shape;
  kvc::Index const b = s[0], hkv = s[1], per_head = s[2] * s[3] * in.array.itemsize(), g = hq / hkv;
  std::vector<std::byte> out =
      buffer<std::byte>(static_cast<std::size_t>(b * hq * per_head), "the per-query-head copy of " + in.path);
  for (kvc::Index i = 0; i < b; ++i)
    for (kvc::Index q = 0; q < hq; ++q)
      std::copy_n(in.array.data.data() + (i * hkv + q / g) * per_head, per_head, out.data() + (i * hq + q) * per_head);
  in.array.data = std::move(out);
  in.array.shape[1] = hq;
}

/// The files of the moments, in --out-dir (compress) or --moments (attend).
constexpr char const* moment_outputs[] = {"moment_count.npy", "moment_key_mean.npy", "moment_value_mean.npy",
                                          "moment_comoment.npy"};

/// Refuses moments of [batch, heads] heads of (d_v d_k + d_k + d_v) elements of MT when larger than the memory
/// available: their size is the product of the keys' and the values' head dims, bounded by neither file.
template <class MT>
void check_moment_memory(kvc::KVExtents const& e, kvc::Index dim_v, std::string const& context) {
  std::size_t const bytes = kvc::moment_state_bytes<MT>(e.batch, e.heads, e.dim, dim_v);
  std::size_t const available = memory_bytes();
  if (bytes > available)
    fail(exit_invalid,
         "the moments of " + context + " ([B, Hkv, d_v, d_k] = [" + std::to_string(e.batch) + ", " +
             std::to_string(e.heads) + ", " + std::to_string(dim_v) + ", " + std::to_string(e.dim) + "]) need " +
             (bytes == SIZE_MAX ? std::string("more than 2^64 bytes") : bytes_text(static_cast<double>(bytes))) +
             ", more than the memory available (" + bytes_text(static_cast<double>(available)) + ")");
}

/// Calls fn(obs) with MomentKV's window queries (its base score reads the last window_size rows), after the checks
/// kvc's other window policies get (with_observations).
template <class C, class Fn>
void with_moment_observations(kvc::SnapKVScorer const& base, C const& cache, Queries const& q,
                              std::string const& keys_path, Fn&& fn, char const* policy = "moment_kv") {
  check_rows_used(base.window_size, policy, cache.keys.extents().tokens, q, keys_path);
  kvc::WindowQueries<float> const wq{
      kvc::TokenRows<float const, kvc::StridedLayout>(q.rows.data(), kvc::bhtd_layout(q.ext)), q.rope,
      q.positions.empty() ? nullptr : q.positions.data()};
  fn(kvc::observe(wq));
}

/// The .npy dtype and bytes of moments stored as MT: float32 and float16 as they are, bfloat16 widened to float32
/// (exactly: .npy has no bfloat16).
template <class MT>
constexpr kvc::NpyDtype moment_npy_dtype() {
  return std::is_same_v<MT, kvc::half> ? kvc::NpyDtype::f16 : kvc::NpyDtype::f32;
}
template <class MT>
std::vector<std::byte> moment_npy_bytes(MT const* v, kvc::Index count, std::string const& what) {
  auto const n = static_cast<std::size_t>(count);
  if constexpr (std::is_same_v<MT, kvc::bfloat16>) {
    std::vector<std::byte> out = buffer<std::byte>(n * sizeof(float), what);
    for (std::size_t i = 0; i < n; ++i) {
      float const f = kvc::to_float(v[i]);
      std::memcpy(out.data() + i * sizeof(float), &f, sizeof(float));
    }
    return out;
  } else {
    std::vector<std::byte> out = buffer<std::byte>(n * sizeof(MT), what);
    if (n > 0)
      std::memcpy(out.data(), v, out.size());
    return out;
  }
}

/// The moments a compress job writes, and their memory.
struct MomentFiles {
  kvc::NpyDtype dtype = kvc::NpyDtype::f32;
  std::vector<kvc::Index> count;
  std::vector<std::byte> key_mean, value_mean, comoment;
  kvc::Index bytes = 0, head_bytes = 0;  ///< in the storage dtype (moment_state_bytes, moment_head_bytes)
};

/// The files of MomentKV's moments of the evicted sets (a compressor's, after prefill). Moments that overflowed their
/// storage (values or keys too large for the co-moment) are refused, so that every file written reads back in
/// `kvc attend`.
template <class MT>
MomentFiles moment_files(kvc::MomentState<kvc::HostSpace, MT> const& m, Job const& job) {
  kvc::Index const dk = m.key_dim, dv = m.value_dim;
  for (kvc::Index b = 0; b < m.batch; ++b)
    for (kvc::Index h = 0; h < m.heads; ++h) {
      auto finite = [](MT const* x, kvc::Index n) {
        return std::all_of(x, x + n, [](MT v) { return std::isfinite(kvc::to_float(v)); });
      };
      if (!finite(m.key_mean_of(b, h), dk) || !finite(m.value_mean_of(b, h), dv) ||
          !finite(m.comoment_of(b, h), dk * dv))
        fail(exit_invalid,
             "values file " + job.values->path + " / keys file " + job.keys.path +
                 ": the moments of the evicted set of head (" + std::to_string(b) + ", " + std::to_string(h) +
                 ") are not finite in " + job.params.at("storage") +
                 " (values or keys too large for the co-moment sum (v - v_mean)(k - k_mean)^T" +
                 (std::is_same_v<MT, float> ? std::string(")") : std::string("); try --param storage=fp32")));
    }
  std::string const what = "the moments of " + job.context();
  kvc::Index const heads = m.batch * m.heads;
  MomentFiles files;
  files.dtype = moment_npy_dtype<MT>();
  files.count = buffer<kvc::Index>(static_cast<std::size_t>(heads), what);
  std::copy_n(m.count, heads, files.count.begin());
  files.key_mean = moment_npy_bytes(m.key_mean, heads * dk, what);
  files.value_mean = moment_npy_bytes(m.value_mean, heads * dv, what);
  files.comoment = moment_npy_bytes(m.comoment, heads * dk * dv, what);
  files.bytes = static_cast<kvc::Index>(kvc::moment_state_bytes<MT>(m.batch, m.heads, dk, dv));
  files.head_bytes = static_cast<kvc::Index>(kvc::moment_head_bytes(dk, dv, sizeof(MT)));
  return files;
}

/// The largest head dim uncomp_entropy accepts: its solver holds d x d fp64 matrices and solves them in O(d^3).
constexpr kvc::Index max_entropy_head_dim = 1024;

/// `kvc score --policy uncomp_entropy`: UNComp's truncated matrix entropy (kvc::MatrixEntropySolver) of each
/// (sequence, query head)'s rows of --queries, rotated to their positions first when pre-RoPE (default positions
/// 0 .. w - 1: a shift of every position is a rotation of the features, which leaves the entropy unchanged), written
/// as [B, Hq] float64 or float32 in the unit asked. It reads no keys.
int cmd_score_entropy(Options const& o) {
  Job job(find_policy(o.get("--policy")));
  for (char const* opt : {"--keys", "--values"})
    if (o.has(opt))
      fail(exit_usage, std::string(opt) + " given, but policy " + job.policy.name +
                           " reads only --queries (it writes each query head's entropy, [B, Hq])");
  if (!o.has("--queries") || !o.has("--out"))
    fail(exit_usage, std::string("score --policy ") + job.policy.name + " needs --queries and --out");
  check_job(o, false, job);
  kvc::tools::EntropyConfig const cfg = kvc::tools::entropy_config(job.params);  // exit 3 before any file is read
  check_outputs(option_inputs(o), {o.get("--out")}, "--out");
  kvc::Index const threads = thread_count(o);
  Queries& q = job.queries;
  load_queries(o.get("--queries"), o.get("--positions"), nullptr, std::string(), job.rotate, job.rope, q);
  if (q.ext.dim > max_entropy_head_dim)
    fail(exit_invalid, "queries file " + q.path + ": field 'shape': head_dim (shape[3]) is " +
                           std::to_string(q.ext.dim) + ", expected at most " + std::to_string(max_entropy_head_dim) +
                           " (the entropy solves a head_dim x head_dim eigenproblem)");
  kvc::Index const heads = q.ext.batch * q.ext.heads, w = q.ext.tokens, d = q.ext.dim;
  std::vector<double> values = buffer<double>(static_cast<std::size_t>(heads), "the entropies of " + q.path);
  kvc::MatrixEntropySolver solver(d, cfg.options);
  auto once = [&] {
    for (kvc::Index bh = 0; bh < heads; ++bh) {
      kvc::Index const b = bh / q.ext.heads;
      kvc::MatrixEntropy e;
      check_status(solver.compute(q.rows.data() + bh * w * d, w, d, e, q.rope,
                                  q.positions.empty() ? nullptr : q.positions.data() + b * w),
                   "queries file " + q.path + ": sequence " + std::to_string(b) + ", query head " +
                       std::to_string(bh % q.ext.heads));
      values[static_cast<std::size_t>(bh)] = cfg.value(e);
    }
  };
  once();
  if (o.time)
    print_time("score", job.policy, "", std::nullopt,
               {median_seconds(timing_repeats, once), -1, 0, threads, q.file_bytes, std::nullopt});
  std::vector<float> narrow;
  if (!cfg.float64) {
    narrow = buffer<float>(values.size(), "the entropies of " + q.path);
    std::transform(values.begin(), values.end(), narrow.begin(), [](double x) { return static_cast<float>(x); });
  }
  write_outputs({{o.get("--out"),
                  cfg.float64 ? kvc::NpyDtype::f64 : kvc::NpyDtype::f32,
                  {q.ext.batch, q.ext.heads},
                  cfg.float64 ? static_cast<void const*>(values.data()) : static_cast<void const*>(narrow.data())}});
  return 0;
}

// ---------------------------------------------------------------------------------------------------------------
// RDKV and KIVI (tools/common/rdkv.hpp): token and channel weights, the bit plan (kvc::allocate_bits, or KIVI's
// uniform plan), and the packed store (kvc::pack) whose memory compress reports.

/// The files compress --policy rdkv|kivi writes into --out-dir (or its layer<L>/).
constexpr char const* packed_outputs[] = {"v_bits.npy", "k_bits.npy"};

/// Whether RDKV's token weights of `cfg` read the values: weight=derived (var(v_t)), or a weight policy that does.
bool rdkv_reads_values(kvc::tools::RDKVConfig const& cfg) {
  if (!cfg.weight_policy.empty())
    return find_policy(cfg.weight_policy).reads_values;
  return cfg.token.weight == kvc::RDKVTokenWeight::derived;
}

/// RDKV's token weights of a loaded job into `tokens` [B, Hkv, N] and, when `channels` is not null, ThinK's channel
/// weights into `channels` [B, Hkv, d], over `cache` (the job's typed view). The window queries are checked as for
/// the window policies. weight=NAME: that policy's scores (its default parameters), each head's shifted to >= 0
/// (kvc::scores_as_weights). Returns the largest workspace used.
template <class C>
std::size_t rdkv_weights(Job const& job, kvc::tools::RDKVConfig const& cfg, kvc::Cpu const& cpu, C const& cache,
                         float* tokens, float* channels) {
  kvc::KVExtents const e = cache.keys.extents();
  std::size_t used = 0;
  kvc::SnapKVScorer window;  // only its window_size: the checks of the rows the weights read
  window.window_size = cfg.token.window_size;
  with_moment_observations(
      window, cache, job.queries, job.keys.path,
      [&](auto const& obs) {
        if (cfg.weight_policy.empty()) {
          Scratch const ws = workspace(kvc::score_workspace_bytes(cpu, cfg.token, e, obs), job);
          kvc::ScoreSpan<> span{tokens, e.batch, e.heads, e.tokens, cache.lengths};
          check_status(kvc::score(cpu, cfg.token, cache, obs, span, ws.span()), job.context());
          used = std::max(used, ws.size);
        }
        if (channels) {
          Scratch const ws = workspace(kvc::channel_score_workspace_bytes(cpu, cfg.channel, cache, obs), job);
          check_status(kvc::score_channels(cpu, cfg.channel, cache, obs, channels, ws.span()), job.context());
          used = std::max(used, ws.size);
        }
      },
      "rdkv");
  if (cfg.weight_policy.empty())
    return used;
  PolicyInfo const& inner = find_policy(cfg.weight_policy);
  with_policy(inner, resolve_params(inner, {}, false), [&](auto const& scorer, Selection) {
    auto score_with = [&](auto const& live, auto const& obs) {
      Scratch const ws = workspace(kvc::score_workspace_bytes(cpu, live, e, obs), job);
      kvc::ScoreSpan<> span{tokens, e.batch, e.heads, e.tokens, cache.lengths};
      check_status(kvc::score(cpu, live, cache, obs, span, ws.span()),
                   job.context() + " (rdkv weight=" + cfg.weight_policy + ")");
      used = std::max(used, ws.size);
    };
    using S = std::remove_cvref_t<decltype(scorer)>;
    if constexpr (kvc::has_need(S::needs, kvc::Needs::window_queries) ||
                  kvc::has_need(S::needs, kvc::Needs::query_statistics) || kvc::StatefulScorer<S>)
      with_observations(scorer, cache, job.queries, job.keys.path, job.rope, score_with);
    else
      score_with(scorer, kvc::NoObservations{});
  });
  for (kvc::Index bh = 0; bh < e.batch * e.heads; ++bh)
    kvc::scores_as_weights(tokens + bh * e.tokens, cache.lengths.at(bh / e.heads, bh % e.heads, e.tokens));
  return used;
}

/// `kvc score --policy rdkv`: the token weights (--out) and, with --channel-out, the channel weights.
int cmd_score_rdkv(Options const& o, Job& job) {
  kvc::tools::RDKVConfig const cfg = kvc::tools::rdkv_config(job.policy, job.params);  // exit 3 before reading
  if (rdkv_reads_values(cfg) && !o.has("--values"))
    fail(exit_usage, "policy rdkv with --param weight=" + job.params.at("weight") +
                         " reads the values (derived: var(v_t); a policy that weights by ||v||): pass --values V.npy");
  std::vector<std::string> outs = {o.get("--out")};
  if (o.has("--channel-out"))
    outs.push_back(o.get("--channel-out"));
  check_outputs(option_inputs(o), outs, o.has("--channel-out") ? "output file" : "--out");
  load_job(option_files(o), job);
  kvc::KVExtents const e = extents_of(job.keys);
  kvc::Index const threads = thread_count(o);
  kvc::ThreadPool pool(threads);
  kvc::Cpu const cpu = threads > 1 ? pool.cpu() : kvc::Cpu{};
  std::vector<float> tokens = buffer<float>(static_cast<std::size_t>(e.rows()), "the weights of " + job.context());
  std::vector<float> channels;
  if (o.has("--channel-out"))
    channels = buffer<float>(static_cast<std::size_t>(e.batch * e.heads * e.dim), "the weights of " + job.context());
  with_cache(job.keys, job.values ? &*job.values : nullptr, KeyRange::logits, [&](auto const& cache) {
    std::size_t ws = 0;
    auto once = [&] {
      ws = rdkv_weights(job, cfg, cpu, cache, tokens.data(), channels.empty() ? nullptr : channels.data());
    };
    once();
    if (o.time)
      print_time("score", job.policy, "", std::nullopt,
                 {median_seconds(timing_repeats, once), -1, ws, threads, job.bytes_read(), std::nullopt});
  });
  std::vector<Output> files = {{o.get("--out"), kvc::NpyDtype::f32, {e.batch, e.heads, e.tokens}, tokens.data()}};
  if (o.has("--channel-out"))
    files.push_back({o.get("--channel-out"), kvc::NpyDtype::f32, {e.batch, e.heads, e.dim}, channels.data()});
  write_outputs(files);
  return 0;
}

/// One rdkv/kivi job's results: the bit plans and what --time prints.
struct PackedCompressed {
  kvc::KVExtents ext{};
  std::vector<std::int8_t> v_bits, k_bits;
  Timing timing;

  std::vector<Output> outputs(std::string const& dir) const {
    std::string const d = dir + "/";
    return {{d + packed_outputs[0], kvc::NpyDtype::i32, {ext.batch, ext.heads, ext.tokens}, v_bits.data(), true},
            {d + packed_outputs[1], kvc::NpyDtype::i32, {ext.batch, ext.heads, ext.dim}, k_bits.data(), true}};
  }
};

/// RDKV's or KIVI's compression of one loaded job by its kvc::LayerCompressor (engine/packed_compressor.hpp), the
/// way an engine compresses a layer: plan, bind, reset, then prefill(cache, queries): the bit plan (RDKV: the token
/// weights, ThinK's channel weights, kvc::allocate_bits; KIVI: kvc::kivi_bit_plan), the newest `residual` tokens of
/// each head left in the cache as the fp16 tail, every other kept token packed into the compressor's state. RDKV
/// reads every query row given, at their --positions or at N - R .. N - 1. The plan is read back (bit_plan) with the
/// tail's slots at their 16 bits, and the memory is the packed store's own accounting. With --time, each of the 7
/// repeats compresses the original input again (restored untimed): "seconds" is reset + prefill.
PackedCompressed compress_packed(Job& job, CompressSettings const& s, kvc::tools::RDKVConfig const& cfg) {
  Input const& keys = job.keys;
  Input const& values = *job.values;
  Queries const& q = job.queries;
  kvc::KVExtents const e = extents_of(keys);
  if (values.array.shape[3] != e.dim)
    fail(exit_invalid, "values file " + values.path + ": field 'shape': head_dim (shape[3]) is " +
                           std::to_string(values.array.shape[3]) + ", expected the keys' " + std::to_string(e.dim) +
                           " (policy " + job.policy.name + " packs K and V of one head dim)");
  PackedCompressed c;
  c.ext = e;
  auto const heads = static_cast<std::size_t>(e.batch * e.heads);
  c.v_bits = buffer<std::int8_t>(static_cast<std::size_t>(e.rows()), "the bit plan of " + job.context());
  c.k_bits = buffer<std::int8_t>(heads * static_cast<std::size_t>(e.dim), "the bit plan of " + job.context());
  std::vector<kvc::Index> lengths = buffer<kvc::Index>(heads, "the lengths of " + job.context());
  auto const restart = [&] { std::fill(lengths.begin(), lengths.end(), e.tokens); };  // every token valid
  std::optional<SavedInput> const saved = s.time ? std::optional<SavedInput>(std::in_place, job) : std::nullopt;
  kvc::ThreadPool pool(s.threads);
  kvc::Cpu const cpu = s.threads > 1 ? pool.cpu() : kvc::Cpu{};
  kvc::Index const tail = kvc::tail_tokens(e.tokens, cfg.residual);
  Memory m;
  m.packed = true;
  with_cache(keys, &values, KeyRange::logits, [&](auto const& plain) {
    m.input_bytes = kvc::store_report(plain).held_bytes;
    auto const cache = kvc::make_cache(plain.keys, plain.values, kvc::head_lengths(lengths.data(), e.heads));
    kvc::tools::with_packed_press(cfg, s.ratio, s.budget, [&](auto const& press) {
      using P = std::remove_cvref_t<decltype(press)>;
      std::string const what = "policy " + std::string(job.policy.name) + " over " + job.context();
      // RDKV's rows: every query row given (its weights' and ThinK's window), and their positions [B, R].
      kvc::Index const rows = cfg.kivi ? 0 : q.ext.tokens;
      std::vector<float> rope_storage;
      kvc::RopeTable<> rope = q.rope;
      if constexpr (!std::is_same_v<P, kvc::KIVIPress>) {
        check_rows_used(cfg.token.window_size, "rdkv", e.tokens, q, keys.path);
        using S = typename P::scorer_type;
        if constexpr (!std::is_same_v<S, kvc::RDKVTokenScorer>)  // weight=NAME: the rows that policy reads too
          check_rows_used(rows_used(press.scorer, rows), S::name, e.tokens, q, keys.path);
        rope = compressor_rope(press.scorer, job, rope_storage);
      }
      LastRows const window = last_rows(job, rows);
      kvc::LayerCompressor<P, kvc::Cpu> compressor{cpu, press};
      compressor.options.rope = rope;
      CompressorMemory const memory = start_compressor(compressor, cache, job, rows, what);
      auto once = [&] {
        check_status(compressor.reset(), what);
        check_status(compressor.prefill(cache, window.queries, memory.ws.span()),
                     "keys file " + keys.path + " / values file " + values.path);
      };
      restart();
      once();
      c.timing = compressor_timing(job, saved, memory, s.threads, restart, once);
      // The plan packed by, the tail's slots back at 16 bits (kvc::split_tail took them out of it).
      kvc::BitPlan<> const plan = compressor.bit_plan(memory.ws.span());
      std::copy_n(plan.v_bits, c.v_bits.size(), c.v_bits.begin());
      std::copy_n(plan.k_bits, c.k_bits.size(), c.k_bits.begin());
      for (std::size_t bh = 0; bh < heads; ++bh)
        std::fill_n(c.v_bits.data() + bh * static_cast<std::size_t>(e.tokens) + (e.tokens - tail), tail,
                    std::int8_t{16});
      kvc::PackedKVView<> const view = compressor.packed();
      for (std::size_t bh = 0; bh < heads; ++bh) {
        m.kept_tokens += view.heads[bh].tokens + tail;
        m.payload_bits += view.heads[bh].payload_bits;
        m.overhead_bits += view.heads[bh].overhead_bits;
      }
    });
  });
  m.tail_tokens = tail * static_cast<kvc::Index>(heads);
  m.payload_bits += m.tail_tokens * 2 * e.dim * 16;
  m.input_tokens = e.rows();
  m.full_bits = e.rows() * 2 * e.dim * 16;
  c.timing.memory = m;
  return c;
}

int cmd_score(Options const& o) {
  if (o.has("--policy") && !find_policy(o.get("--policy")).token_scores)
    return cmd_score_entropy(o);
  if (!o.has("--policy") || !o.has("--keys") || !o.has("--out"))
    fail(exit_usage, "score needs --policy, --keys and --out");
  Job job(find_policy(o.get("--policy")));
  if (std::string_view(job.policy.name) == "kivi")
    fail(exit_usage,
         "policy kivi quantizes every token alike: it has no scores (`kvc compress --policy kivi` "
         "writes its bit plan)");
  if (o.has("--channel-out") && std::string_view(job.policy.name) != "rdkv")
    fail(exit_usage, "--channel-out goes with --policy rdkv (ThinK's channel weights)");
  check_job(o, false, job);
  if (std::string_view(job.policy.name) == "rdkv")
    return cmd_score_rdkv(o, job);
  bool const moment_kv = is_moment_kv(job.policy);
  if (moment_kv && job.params.at("mi") != "false" && !o.has("--values"))
    fail(exit_usage,
         "policy moment_kv weights scores by the norms of the values' residuals: pass --values V.npy "
         "(or --param mi=false for the base score alone)");
  if (!moment_kv && job.policy.reads_values && !o.has("--values") && job.params.at("use_vnorm") != "false")
    fail(exit_usage, std::string("policy ") + job.policy.name +
                         " weights scores by the value norms: pass --values V.npy (or --param use_vnorm=false)");
  std::optional<MomentKVConfig> const moment_config =
      moment_kv ? std::optional(moment_kv_config(job.params)) : std::nullopt;  // bad values exit 3 before reading
  std::optional<kvc::tools::UNCompConfig> const uncomp =
      is_uncomp(job.policy) ? std::optional(kvc::tools::uncomp_config(job.params)) : std::nullopt;
  check_outputs(option_inputs(o), {o.get("--out")}, "--out");
  load_job(option_files(o), job);
  kvc::KVExtents e = extents_of(job.keys);  // (uncomp with gqa=expand scores Hq heads)
  kvc::Index const threads = thread_count(o);
  kvc::ThreadPool pool(threads);
  kvc::Cpu const cpu = threads > 1 ? pool.cpu() : kvc::Cpu{};
  std::vector<float> scores = buffer<float>(static_cast<std::size_t>(e.rows()), "the scores of " + job.context());
  auto score_with = [&](auto const& scorer, auto const& cache, auto const& obs) {
    Scratch const ws = workspace(kvc::score_workspace_bytes(cpu, scorer, e, obs), job);
    kvc::ScoreSpan<> out{scores.data(), e.batch, e.heads, e.tokens};
    auto once = [&] { check_status(kvc::score(cpu, scorer, cache, obs, out, ws.span()), job.context()); };
    once();
    if (o.time)
      print_time("score", job.policy, "", std::nullopt,
                 {median_seconds(timing_repeats, once), -1, ws.size, threads, job.bytes_read(), std::nullopt});
  };
  if (moment_kv) {
    // MomentKV's score before any eviction (spec §4): empty moments, so r_j = v_j and the score is the base
    // score times ||v_j|| (mi=false: the base score alone). The moments' storage does not change it.
    MomentKVConfig const& cfg = *moment_config;
    with_cache(job.keys, job.values ? &*job.values : nullptr, KeyRange::logits, [&](auto const& cache) {
      with_moment_observations(cfg.scorer.base, cache, job.queries, job.keys.path, [&](auto const& obs) {
        if (!cfg.mi) {
          score_with(cfg.scorer.base, cache, obs);
          return;
        }
        kvc::Index const dv = job.values->array.shape[3];
        check_moment_memory<float>(e, dv, job.context());
        HostMoments<float> const m(e.batch, e.heads, e.dim, dv);
        kvc::MomentKVScorer<> scorer = cfg.scorer;
        scorer.state = m.view;
        score_with(scorer, cache, obs);
      });
    });
    write_outputs({{o.get("--out"), kvc::NpyDtype::f32, {e.batch, e.heads, e.tokens}, scores.data()}});
    return 0;
  }
  if (uncomp) {
    // UNComp's score before any eviction: kvc::update with the queries' last window_size rows, then kvc::score (the
    // pooled window attention of each prefix slot, summed over its query group; window slots above every prefix
    // score). gqa=expand scores each query head's copy of its KV head: [B, Hq, N].
    if (uncomp->gqa == kvc::tools::UNCompGqa::expand && job.queries.ext.heads != e.heads) {
      expand_heads(job.keys, job.queries.ext.heads);
      scores = buffer<float>(static_cast<std::size_t>(extents_of(job.keys).rows()), "the scores of " + job.context());
    }
    kvc::KVExtents const x = extents_of(job.keys);
    std::vector<float> rows = buffer<float>(kvc::bytes_product(x.rows(), uncomp->window_size), "UNComp's state");
    std::vector<kvc::Index> tracked = buffer<kvc::Index>(static_cast<std::size_t>(x.batch * x.heads), "UNComp's state");
    kvc::UNCompScorer<> scorer;
    scorer.state = {{rows.data(), kvc::uncomp_window_layout(x, uncomp->window_size)}, tracked.data()};
    scorer.window_size = uncomp->window_size;
    scorer.kernel_size = uncomp->kernel_size;
    scorer.pooling = uncomp->pooling;
    kvc::SnapKVScorer window;
    window.window_size = uncomp->window_size;
    with_cache(job.keys, nullptr, KeyRange::logits, [&](auto const& cache) {
      with_moment_observations(
          window, cache, job.queries, job.keys.path,
          [&](auto const& obs) {
            Scratch const ws = workspace(kvc::update_workspace_bytes(cpu, scorer, x, obs), job);
            check_status(kvc::update(cpu, scorer, cache, obs, ws.span()), job.context());
            kvc::Index const heads_e = e.heads;
            e.heads = x.heads;  // the scores' shape (gqa=expand: per query head)
            score_with(scorer, cache, kvc::NoObservations{});
            e.heads = heads_e;
          },
          "uncomp");
    });
    write_outputs({{o.get("--out"), kvc::NpyDtype::f32, {x.batch, x.heads, x.tokens}, scores.data()}});
    return 0;
  }
  job.run([&](auto const& scorer, Selection, auto const& cache, auto const& obs) { score_with(scorer, cache, obs); });
  write_outputs({{o.get("--out"), kvc::NpyDtype::f32, {e.batch, e.heads, e.tokens}, scores.data()}});
  return 0;
}

// ---------------------------------------------------------------------------------------------------------------
// compress: one job per input (the options' files, or each layer of a --dump folder).

/// The files compress writes into --out-dir (or --out-dir/layer<L> with --dump); the ragged store's with
/// --allocator.
constexpr char const* compress_outputs[] = {"keys.npy", "values.npy", "indices.npy", "counts.npy"};
constexpr char const* ragged_outputs[] = {"ragged_keys.npy", "ragged_values.npy", "offsets.npy"};

/// One job's results: the arrays to write (kept until staged) and what --time prints.
struct Compressed {
  kvc::KVExtents ext{};
  kvc::Index dim_v = 0, kept_max = 0;
  kvc::NpyDtype k_dtype = kvc::NpyDtype::f32, v_dtype = kvc::NpyDtype::f32;
  std::vector<std::byte> keys, values, ragged_keys, ragged_values;
  std::vector<kvc::Index> indices, counts, offsets;
  kvc::RaggedShape ragged{};
  Timing timing;
  std::optional<MomentFiles> moments;  ///< moment_kv

  std::vector<Output> outputs(std::string const& dir, bool ragged_store) const {
    kvc::KVExtents const e = ext;
    std::string const d = dir + "/";
    std::vector<Output> out = {
        {d + compress_outputs[0], k_dtype, {e.batch, e.heads, kept_max, e.dim}, keys.data()},
        {d + compress_outputs[1], v_dtype, {e.batch, e.heads, kept_max, dim_v}, values.data()},
        {d + compress_outputs[2], kvc::NpyDtype::i64, {e.batch, e.heads, kept_max}, indices.data()},
        {d + compress_outputs[3], kvc::NpyDtype::i64, {e.batch, e.heads}, counts.data()}};
    if (ragged_store) {
      out.push_back({d + ragged_outputs[0], k_dtype, {ragged.rows, e.dim}, ragged_keys.data()});
      out.push_back({d + ragged_outputs[1], v_dtype, {ragged.rows, dim_v}, ragged_values.data()});
      out.push_back({d + ragged_outputs[2], kvc::NpyDtype::i64, {e.batch * e.heads + 1}, offsets.data()});
    }
    if (moments) {
      MomentFiles const& m = *moments;
      out.push_back({d + moment_outputs[0], kvc::NpyDtype::i64, {e.batch, e.heads}, m.count.data()});
      out.push_back({d + moment_outputs[1], m.dtype, {e.batch, e.heads, e.dim}, m.key_mean.data()});
      out.push_back({d + moment_outputs[2], m.dtype, {e.batch, e.heads, dim_v}, m.value_mean.data()});
      out.push_back({d + moment_outputs[3], m.dtype, {e.batch, e.heads, dim_v, e.dim}, m.comoment.data()});
    }
    return out;
  }
};

/// bfloat16 rows (from .safetensors) widened to float32, exactly, since .npy has no bfloat16, and fp8 rows as the
/// float32 values they hold (decode(byte) * scale, exactly: kvc::load); other dtypes as they are.
std::vector<std::byte> npy_bytes(std::vector<std::byte> raw, Elem elem, float scale, std::string const& what) {
  if (elem != Elem::bf16 && elem != Elem::f8_e4m3 && elem != Elem::f8_e5m2)
    return raw;
  std::size_t const item = elem == Elem::bf16 ? 2 : 1, n = raw.size() / item;
  std::vector<std::byte> out = buffer<std::byte>(n * 4, what);
  auto widen = [&](auto tag) {
    using T = decltype(tag);
    for (std::size_t i = 0; i < n; ++i) {
      T x;
      std::memcpy(&x, raw.data() + item * i, item);
      float const f = kvc::is_fp8<T> ? kvc::load(x, scale) : kvc::to_float(x);
      std::memcpy(out.data() + 4 * i, &f, 4);
    }
  };
  if (elem == Elem::bf16)
    widen(kvc::bfloat16{});
  else if (elem == Elem::f8_e4m3)
    widen(kvc::float8_e4m3{});
  else
    widen(kvc::float8_e5m2{});
  return out;
}

/// Calls fn(press) with a compress job's policy as a kvc::Press{scorer, selection}: the policy table's scorer and
/// selection (with_policy, with_selection: top-k over the ratio or budget, or the allocators'), MomentKV's scorer in
/// its storage type with its sink and window protected, or UNComp's with the layer's per-head budgets from the
/// calibration's groups (average: --budget, or the ratio's kept count of N), held in `budgets` while fn runs.
template <class Fn>
void with_press(Job const& job, CompressSettings const& s, std::vector<kvc::Index>& budgets, Fn&& fn) {
  kvc::KVExtents const e = extents_of(job.keys);
  if (is_moment_kv(job.policy)) {
    MomentKVConfig const cfg = moment_kv_config(job.params);
    with_selection(s.alloc, job.params, Selection{cfg.n_sink, cfg.n_recent}, s.ratio, s.budget, e.tokens,
                   [&](auto const& selector) {
                     with_moment_storage(cfg.storage, [&](auto tag) {
                       using MT = decltype(tag);
                       check_moment_memory<MT>(e, job.values->array.shape[3], job.context());
                       fn(kvc::Press{kvc::tools::moment_scorer<MT>(cfg), selector});
                     });
                   });
  } else if (is_uncomp(job.policy)) {
    kvc::tools::UNCompConfig const cfg = kvc::tools::uncomp_config(job.params);
    double const average = cfg.absolute() ? 0.0
                           : s.ratio      ? static_cast<double>(kvc::RatioBudget{*s.ratio}.keep(0, 0, e.tokens))
                                          : static_cast<double>(s.budget);
    budgets = kvc::tools::uncomp_budgets(cfg, *s.calibration, s.calibration_path, s.layer, average);
    kvc::UNCompScorer<> scorer;
    scorer.window_size = cfg.window_size;
    scorer.kernel_size = cfg.kernel_size;
    scorer.pooling = cfg.pooling;
    fn(kvc::Press{scorer, kvc::UNCompSelector{kvc::HeadBudgets{budgets.data(), e.heads}, 0, cfg.window_size}});
  } else {
    with_policy(job.policy, job.params, [&](auto const& scorer, Selection sel) {
      with_selection(s.alloc, job.params, sel, s.ratio, s.budget, e.tokens, [&](auto const& selector) {
        fn(kvc::Press{scorer, selector});
      });
    });
  }
}

/// One loaded job compressed the way an engine compresses a layer: the policy's kvc::LayerCompressor planned for the
/// job's cache and query rows, bound to a state, reset, then prefill(cache, queries) (score, select, fold the evicted
/// tokens into the scorer's state, compact in place). The cache has a per-head length table (`counts`: each head's
/// kept count after) and a positions table of slot numbers, which compaction carries: each head's first `count`
/// positions are then the indices of its kept tokens. The queries are the last rows the policy reads (rows_used), at
/// their --positions or at N - rows .. N - 1. The ragged store gets each head's kept rows (kvc::append). With --time,
/// each of the 7 repeats compresses the original input again (restored untimed): "seconds" is reset + prefill.
Compressed compress_job(Job& job, CompressSettings const& s) {
  Input const& keys = job.keys;
  Input const& values = *job.values;
  Queries const& q = job.queries;
  kvc::KVExtents const e = extents_of(keys);
  Compressed c;
  c.ext = e;
  c.dim_v = values.array.shape[3];
  auto const rows = static_cast<std::size_t>(e.rows()), heads = static_cast<std::size_t>(e.batch * e.heads);
  c.counts = buffer<kvc::Index>(heads, "the lengths of " + job.context());
  std::vector<kvc::Index> slots = buffer<kvc::Index>(rows, "the positions of " + job.context());
  auto const restart = [&] {  // every token valid, at its slot's position
    std::fill(c.counts.begin(), c.counts.end(), e.tokens);
    for (std::size_t i = 0; i < rows; ++i)
      slots[i] = static_cast<kvc::Index>(i) % e.tokens;
  };
  std::optional<SavedInput> const saved = s.time ? std::optional<SavedInput>(std::in_place, job) : std::nullopt;
  kvc::ThreadPool pool(s.threads);
  kvc::Cpu const cpu = s.threads > 1 ? pool.cpu() : kvc::Cpu{};
  std::vector<kvc::Index> budgets;  // uncomp
  kvc::Index input_bytes = 0;
  with_cache(keys, &values, key_range(job.policy), [&](auto const& plain) {
    auto const cache =
        kvc::make_cache(plain.keys, plain.values, kvc::head_lengths(c.counts.data(), e.heads), slots.data());
    restart();
    input_bytes = kvc::store_report(plain).held_bytes;  // K and V (not the tables compress adds)
    with_press(job, s, budgets, [&](auto const& press) {
      using P = std::remove_cvref_t<decltype(press)>;
      std::string const what = "policy " + std::string(job.policy.name) + " over " + job.context();
      // The query rows the policy reads, in place: the last `used` of [B, Hq, R, d], and their positions [B, used].
      kvc::Index const used = job.policy.reads_queries ? rows_used(press.scorer, q.ext.tokens) : 0;
      if (job.policy.reads_queries)
        check_rows_used(used, job.policy.name, e.tokens, q, keys.path);
      LastRows const window = last_rows(job, used);
      kvc::LayerCompressor<P, kvc::Cpu> compressor{cpu, press};
      std::vector<float> rope_storage;
      compressor.options.rope = compressor_rope(press.scorer, job, rope_storage);
      CompressorMemory const memory = start_compressor(compressor, cache, job, used, what);
      auto once = [&] {
        check_status(compressor.reset(), what);
        check_status(compressor.prefill(cache, window.queries, memory.ws.span()), job.context());
      };
      once();
      c.timing = compressor_timing(job, saved, memory, s.threads, restart, once);
      if constexpr (requires { press.scorer.prefill_rounds; })  // MomentKV: the moments of the evicted sets
        c.moments = moment_files(compressor.moments(), job);
    });
  });
  for (kvc::Index n : c.counts)
    c.kept_max = std::max(c.kept_max, n);

  // The ragged store (each head exactly its kept rows, appended from the compacted cache), measured with the
  // compacted cache cut to the longest head (what keys.npy and values.npy hold) by kvc::store_report.
  c.offsets = buffer<kvc::Index>(heads + 1, "the ragged offsets of " + job.context());
  check_status(kvc::ragged_offsets(c.counts.data(), e.batch * e.heads, 0, c.offsets.data(), c.ragged),
               "the ragged store of " + job.context());
  auto const item = static_cast<std::size_t>(keys.array.itemsize());
  auto const ragged_rows = static_cast<std::size_t>(c.ragged.rows);
  std::vector<std::byte> ragged_k =
      buffer<std::byte>(ragged_rows * static_cast<std::size_t>(e.dim) * item, "the ragged store of " + keys.path);
  std::vector<std::byte> ragged_v =
      buffer<std::byte>(ragged_rows * static_cast<std::size_t>(c.dim_v) * item, "the ragged store of " + values.path);
  std::vector<kvc::Index> ragged_lengths = buffer<kvc::Index>(heads, "the lengths of " + job.context());
  Memory m;
  m.input_bytes = input_bytes;
  with_element(keys, [&](auto tag) {
    using T = decltype(tag);
    kvc::KVExtents const ev{e.batch, e.heads, e.tokens, c.dim_v};
    auto* kp = const_cast<T*>(keys.array.as<T>());
    auto* vp = const_cast<T*>(values.array.as<T>());
    auto const cache =
        kvc::make_cache(kvc::bhtd_rows(kp, e, access_of<T>(keys)), kvc::bhtd_rows(vp, ev, access_of<T>(values)),
                        kvc::head_lengths(c.counts.data(), e.heads));
    auto const store = kvc::ragged_cache(reinterpret_cast<T*>(ragged_k.data()), reinterpret_cast<T*>(ragged_v.data()),
                                         e.batch, e.heads, e.dim, c.dim_v, c.ragged, c.offsets.data(),
                                         kvc::head_lengths(ragged_lengths.data(), e.heads), nullptr, access_of<T>(keys),
                                         access_of<T>(values));
    check_status(kvc::append(cpu, store, cache), "the ragged store of " + job.context());
    kvc::StridedLayout pk = kvc::bhtd_layout(e), pv = kvc::bhtd_layout(ev);
    pk.ext.tokens = pv.ext.tokens = c.kept_max;
    m.padded_bytes = kvc::store_report(kvc::make_cache(kvc::TokenRows<T, kvc::StridedLayout>{kp, pk},
                                                       kvc::TokenRows<T, kvc::StridedLayout>{vp, pv}))
                         .held_bytes;
    kvc::StoreReport const r = kvc::store_report(store);
    m.ragged_bytes = r.held_bytes;
    m.row_bytes = r.row_bytes;
  });
  m.input_tokens = e.rows();
  m.kept_tokens = c.ragged.rows;
  if (c.moments) {
    m.moments = true;
    m.moment_bytes = c.moments->bytes;
    m.moment_head_bytes = c.moments->head_bytes;
  }
  c.timing.memory = m;

  // Repack [B, H, kept_max, d]: compaction left each head's kept rows in its first slots. Every size is at most the
  // input's (kept_max <= tokens). bfloat16 (from .safetensors) is written as float32, exactly.
  auto repack = [&](Input const& in) {
    kvc::Index const d = in.array.shape[3], in_item = in.array.itemsize();
    std::vector<std::byte> out = buffer<std::byte>(heads * static_cast<std::size_t>(c.kept_max * d * in_item),
                                                   "the compressed copy of " + in.path);
    for (kvc::Index bh = 0; bh < e.batch * e.heads; ++bh)
      std::copy_n(in.array.data.data() + bh * e.tokens * d * in_item,
                  c.counts[static_cast<std::size_t>(bh)] * d * in_item, out.data() + bh * c.kept_max * d * in_item);
    return npy_bytes(std::move(out), in.array.elem, in.scale, "the compressed copy of " + in.path);
  };
  auto npy_dtype = [](Input const& in) { return in.array.elem == Elem::f16 ? kvc::NpyDtype::f16 : kvc::NpyDtype::f32; };
  c.k_dtype = npy_dtype(keys);
  c.v_dtype = npy_dtype(values);
  c.indices =
      buffer<kvc::Index>(heads * static_cast<std::size_t>(c.kept_max), "the kept indices of " + job.context(), -1);
  for (kvc::Index bh = 0; bh < e.batch * e.heads; ++bh)
    std::copy_n(slots.data() + bh * e.tokens, c.counts[static_cast<std::size_t>(bh)],
                c.indices.data() + bh * c.kept_max);
  c.keys = repack(keys);
  c.values = repack(values);
  if (s.ragged) {
    c.ragged_keys = npy_bytes(std::move(ragged_k), keys.array.elem, keys.scale, "the ragged store of " + keys.path);
    c.ragged_values =
        npy_bytes(std::move(ragged_v), values.array.elem, values.scale, "the ragged store of " + values.path);
  }
  return c;
}

/// A `kvc-eval dump` folder: meta.json and layer<L>/{keys,values,queries,queries_prerope}.npy.
struct Dump {
  std::string dir;
  kvc::Index layers = 0;
  std::optional<kvc::RopeSpec> rope;  ///< meta.json's "rope" (theta, style), when it has one
  bool scaled = false;                ///< "rope": {"scaled": true}: inv_freq kvc cannot rebuild from theta
  std::optional<kvc::Index> tokens, kv_heads, head_dim;  ///< meta.json's sizes, checked against each layer's keys

  std::string meta_path() const { return dir + "/meta.json"; }
  std::string layer_dir(kvc::Index l) const { return dir + "/layer" + std::to_string(l); }
};

/// Reads DIR/meta.json (exit 3 naming the file and the field). `pre_rope_queries`: the policy rotates the
/// queries_prerope.npy rows with meta.json's RoPE, which must then be there (and not scaled).
Dump read_dump(std::string const& dir, bool pre_rope_queries) {
  Dump d;
  d.dir = dir;
  std::string const path = d.meta_path(), where = "--dump " + dir + ": " + path + ": ";
  std::vector<std::byte> bytes;
  std::string error;
  if (!kvc::read_regular_file(path, bytes, error, std::uint64_t{1} << 20))
    fail(exit_invalid, where + error + " (expected a folder as `kvc-eval dump` writes it: meta.json and " +
                           "layer<L>/keys.npy, values.npy, queries.npy, queries_prerope.npy)");
  kvc::json::Value meta;
  if (!kvc::json::parse(std::string_view(reinterpret_cast<char const*>(bytes.data()), bytes.size()), meta, error))
    fail(exit_invalid, where + "not JSON: " + error);
  if (!meta.is_object())
    fail(exit_invalid, where + "expected a JSON object");
  auto count = [&](char const* field, bool required) -> std::optional<kvc::Index> {
    kvc::json::Value const* v = meta.find(field);
    if (v == nullptr) {
      if (required)
        fail(exit_invalid, where + "field '" + field + "' is missing, expected the model's layer count");
      return std::nullopt;
    }
    std::int64_t x = 0;
    if (!kvc::json::to_int64(*v, x) || x < 1 || x > (std::int64_t{1} << 20))
      fail(exit_invalid, where + "field '" + field + "' is not an integer in [1, 2^20]");
    return x;
  };
  d.layers = *count("layers", true);
  d.tokens = count("tokens", false);
  d.kv_heads = count("kv_heads", false);
  d.head_dim = count("head_dim", false);
  if (kvc::json::Value const* rope = meta.find("rope")) {
    kvc::json::Value const* theta = rope->find("theta");
    kvc::json::Value const* style = rope->find("style");
    kvc::json::Value const* scaled = rope->find("scaled");
    if (!rope->is_object() || theta == nullptr || !theta->is_number() || !std::isfinite(theta->as_double()) ||
        !(theta->as_double() > 1.0))
      fail(exit_invalid, where + "field 'rope.theta' is missing or not a number > 1");
    kvc::RopeSpec spec;
    spec.theta = theta->as_double();
    if (style == nullptr || (style->as_string() != "neox" && style->as_string() != "interleaved"))
      fail(exit_invalid, where + "field 'rope.style' is missing or not \"neox\" or \"interleaved\"");
    spec.style = style->as_string() == "neox" ? kvc::RopeStyle::neox : kvc::RopeStyle::interleaved;
    if (scaled != nullptr && !scaled->is_bool())
      fail(exit_invalid, where + "field 'rope.scaled' is not true or false");
    d.scaled = scaled != nullptr && scaled->as_bool();
    d.rope = spec;
  }
  if (pre_rope_queries && !d.rope)
    fail(exit_invalid, where + "field 'rope' is missing: pre-RoPE queries (queries_prerope.npy) need the model's " +
                           "RoPE ({\"theta\": T, \"style\": \"neox\"}); or pass --param queries=post_rope");
  if (pre_rope_queries && d.scaled)
    fail(exit_invalid, where + "field 'rope.scaled' is true: the model's RoPE frequencies are scaled, which kvc " +
                           "cannot rebuild from theta; pass --param queries=post_rope to read each layer's " +
                           "queries.npy (the model's own post-RoPE queries)");
  return d;
}

/// A dump layer's shape: its keys' extents and the values' head dim.
struct LayerShape {
  kvc::KVExtents ext;
  kvc::Index dim_v;
};

/// Checks, after a dump layer is read, that its keys have the shape meta.json gives and the first layer's.
void check_dump_layer(Dump const& d, Job const& job, std::optional<LayerShape> const& first) {
  auto const& s = job.keys.array.shape;
  std::string const where = "keys file " + job.keys.path + ": field 'shape'";
  for (auto const& [axis, field, value] : {std::tuple{1, "kv_heads", d.kv_heads}, std::tuple{2, "tokens", d.tokens},
                                           std::tuple{3, "head_dim", d.head_dim}})
    if (value && s[static_cast<std::size_t>(axis)] != *value)
      fail(exit_invalid, where + ": " + field + " (shape[" + std::to_string(axis) + "]) is " +
                             std::to_string(s[static_cast<std::size_t>(axis)]) + ", expected " + d.meta_path() + "'s " +
                             field + " " + std::to_string(*value));
  if (!first)
    return;
  kvc::KVExtents const e = extents_of(job.keys), f = first->ext;
  auto text = [](kvc::KVExtents x, kvc::Index dv) {
    return "(" + std::to_string(x.batch) + ", " + std::to_string(x.heads) + ", " + std::to_string(x.tokens) + ", " +
           std::to_string(dv) + ")";
  };
  if (e.batch != f.batch || e.heads != f.heads || e.tokens != f.tokens || e.dim != f.dim)
    fail(exit_invalid, where + " is " + text(e, e.dim) + ", expected layer 0's " + text(f, f.dim) +
                           ": every layer of a dump has the same shape");
  kvc::Index const dv = job.values->array.shape[3];
  if (dv != first->dim_v)
    fail(exit_invalid, "values file " + job.values->path + ": field 'shape': head_dim (shape[3]) is " +
                           std::to_string(dv) + ", expected layer 0's " + std::to_string(first->dim_v) +
                           ": every layer of a dump has the same shape");
}

/// Whether --param NAME=... was given.
bool param_given(Options const& o, std::string_view name) {
  return std::any_of(o.params.begin(), o.params.end(),
                     [&](std::string const& kv) { return std::string_view(kv).substr(0, kv.find('=')) == name; });
}

int cmd_compress(Options const& o) {
  bool const dump = o.has("--dump");
  if (!o.has("--policy") || !o.has("--out-dir") || (!dump && (!o.has("--keys") || !o.has("--values"))))
    fail(exit_usage, "compress needs --policy, --out-dir, and --keys and --values or --dump");
  bool const uncomp = o.has("--policy") && o.get("--policy") == "uncomp";
  bool const kivi = o.has("--policy") && o.get("--policy") == "kivi";
  bool const packed = kvc::tools::is_packed_policy(o.get("--policy"));
  if (kivi && (o.has("--ratio") || o.has("--budget")))
    fail(exit_usage,
         "policy kivi's memory is what its bits give (--param bits, group, residual): drop --ratio and "
         "--budget");
  if (!uncomp && !kivi && o.has("--ratio") == o.has("--budget"))
    fail(exit_usage, "compress needs exactly one of --ratio and --budget");
  for (char const* opt : {"--calibration", "--layer"})
    if (!uncomp && o.has(opt))
      fail(exit_usage, std::string(opt) + " goes with --policy uncomp (its calibration file and the layer)");
  if (dump)
    for (char const* opt : {"--keys", "--values", "--queries", "--positions", "--rope"})
      if (o.has(opt))
        fail(exit_usage, std::string(opt) + " given with --dump: the dump folder gives each layer's keys, values " +
                             "and queries (at positions 0 .. N - 1), and its meta.json the RoPE");
  if (!find_policy(o.get("--policy")).token_scores)
    fail(exit_usage, "policy " + o.get("--policy") +
                         " writes per-head values (kvc score), not token scores: it does not compress (UNComp's "
                         "compression is --policy uncomp)");
  CompressSettings s;
  if (packed && o.has("--allocator"))
    fail(exit_usage, "--allocator given with --policy " + o.get("--policy") +
                         ": it allocates bits per token and channel itself (no token budgets to share)");
  if (o.has("--allocator"))
    s.alloc = parse_allocators(o.get("--allocator"));
  Job setup(with_allocators(find_policy(o.get("--policy")), s.alloc));
  check_job(o, true, setup);
  std::optional<kvc::tools::UNCompConfig> uncomp_cfg;
  if (uncomp) {
    if (s.alloc.any())
      fail(exit_usage,
           "--allocator given with --policy uncomp: UNComp allocates its own per-head budgets from the "
           "calibration's head groups");
    if (!o.has("--calibration"))
      fail(exit_usage, "--policy uncomp needs --calibration FILE (`kvc-eval calibrate` writes one)");
    if (dump && o.has("--layer"))
      fail(exit_usage, "--layer given with --dump: each layer of the dump is the calibration's layer of that index");
    if (!dump && !o.has("--layer"))
      fail(exit_usage, "--policy uncomp without --dump needs --layer L (the calibration's layer of these keys)");
    uncomp_cfg = kvc::tools::uncomp_config(setup.params);
    if (uncomp_cfg->absolute() && (o.has("--ratio") || o.has("--budget")))
      fail(exit_usage, "--param schedule=" + setup.params.at("schedule") +
                           (setup.params.at("preset").empty() ? std::string() : " (a preset)") +
                           ": the budgets are absolute; drop --ratio and --budget");
    if (!uncomp_cfg->absolute() && o.has("--ratio") == o.has("--budget"))
      fail(exit_usage, "compress --policy uncomp needs exactly one of --ratio and --budget (the average budget B)");
    if (uncomp_cfg->stages)
      fail(exit_usage, "--param stages=true prunes hidden states inside the model's prefill: kvc-eval only");
    if (uncomp_cfg->rule)
      fail(exit_usage, "--param rule: the calibration file's rule holds (`kvc-eval calibrate --rule`)");
    s.ragged = true;
    if (o.has("--layer"))
      s.layer = parse_count(o.get("--layer"), "--layer");
  }
  s.ragged = s.ragged || s.alloc.any();
  if (dump && s.alloc.pyramid_kv)
    for (char const* name : {"layer", "num_layers"})
      if (param_given(o, name))
        fail(exit_usage, std::string("--param ") + name + " given with --dump: each layer's index and the layer " +
                             "count come from the dump (meta.json's layers)");
  s.ratio = o.has("--ratio") ? std::optional(parse_ratio(o.get("--ratio"))) : std::nullopt;
  s.budget = o.has("--budget") ? parse_count(o.get("--budget"), "--budget") : 0;
  s.threads = thread_count(o);
  s.time = o.time;
  // The selection's parameters (allocators' included) are checked before any file is read.
  if (setup.params.count("reference") && !packed)  // rdkv's reference (default | authors): rdkv_config below
    reference_of(setup.params);
  if (!uncomp && !packed)
    with_selection(s.alloc, setup.params, Selection{}, s.ratio, s.budget, 0, [](auto const&) {});
  std::optional<kvc::tools::RDKVConfig> rdkv_cfg;
  if (packed) {
    rdkv_cfg = kvc::tools::rdkv_config(setup.policy, setup.params);
    kvc::tools::check_rdkv_budget(*rdkv_cfg, s.ratio, s.budget);
  }
  if (is_moment_kv(setup.policy))
    moment_kv_config(setup.params);
  if (uncomp) {  // the calibration, before any tensor is read
    s.calibration_path = o.get("--calibration");
    s.calibration = kvc::tools::read_calibration(s.calibration_path);
    if (!dump && s.layer >= s.calibration->layers)
      fail(exit_invalid, "--layer " + o.get("--layer") + ": calibration file " + s.calibration_path + " has " +
                             std::to_string(s.calibration->layers) + " layers");
    if (uncomp_cfg->absolute() || o.has("--budget"))  // every layer's budgets (with --ratio: per layer, from N)
      for (kvc::Index l = 0; l < s.calibration->layers; ++l)
        kvc::tools::uncomp_budgets(*uncomp_cfg, *s.calibration, s.calibration_path, l, static_cast<double>(s.budget));
  }
  std::string const out_dir = o.get("--out-dir");
  struct stat st {};
  if (::stat(out_dir.c_str(), &st) == 0 && !S_ISDIR(st.st_mode))
    fail(exit_invalid, "--out-dir " + out_dir + " exists and is not a directory");

  // The jobs: the options' files, or every layer of the dump (each file checked to exist before any is read).
  std::optional<Dump> d;
  std::vector<JobFiles> jobs;
  std::vector<std::string> dirs;
  std::vector<NamedInput> inputs = option_inputs(o);
  if (dump) {
    d = read_dump(o.get("--dump"), setup.policy.reads_queries && setup.rotate);
    inputs.clear();
    for (kvc::Index l = 0; l < d->layers; ++l) {
      std::string const ld = d->layer_dir(l) + "/";
      JobFiles f{ld + "keys.npy", ld + "values.npy", std::string(), std::string()};
      if (setup.policy.reads_queries)
        f.queries = ld + (setup.rotate ? "queries_prerope.npy" : "queries.npy");
      for (std::string const* file : {&f.keys, &f.values, &f.queries}) {
        if (file->empty())
          continue;
        struct stat fs {};
        if (::stat(file->c_str(), &fs) != 0) {
          int const err = errno;
          fail(exit_invalid, "--dump " + d->dir + ": " + *file + ": " + std::strerror(err) + " (" + d->meta_path() +
                                 " lists " + std::to_string(d->layers) + " layers; layer " + std::to_string(l) +
                                 " has no " + file->substr(ld.size()) + ")");
        }
        inputs.emplace_back("--dump input", *file);
      }
      jobs.push_back(f);
      dirs.push_back(out_dir + "/layer" + std::to_string(l));
    }
  } else {
    jobs.push_back(option_files(o));
    dirs.push_back(out_dir);
  }
  std::vector<std::string> outputs;
  for (std::string const& dir : dirs) {
    if (packed) {
      for (char const* name : packed_outputs)
        outputs.push_back(dir + "/" + name);
      continue;
    }
    for (char const* name : compress_outputs)
      outputs.push_back(dir + "/" + name);
    if (s.ragged)
      for (char const* name : ragged_outputs)
        outputs.push_back(dir + "/" + name);
    if (is_moment_kv(setup.policy))
      for (char const* name : moment_outputs)
        outputs.push_back(dir + "/" + name);
  }
  check_outputs(inputs, outputs, "output file");

  std::vector<std::string> made;  // the folders this call creates, removed again if the outputs cannot be written
  Staged staged;
  std::vector<Timing> timings;
  std::optional<LayerShape> first;  // layer 0's shape
  try {
    for (std::size_t i = 0; i < jobs.size(); ++i) {
      Job job(setup.policy);
      job.params = setup.params;
      job.rope = d && d->rope ? *d->rope : setup.rope;
      job.rotate = setup.rotate;
      job.k_scale = setup.k_scale;
      job.v_scale = setup.v_scale;
      if (d && s.alloc.pyramid_kv) {  // PyramidKV's schedule: this layer of the dump's
        job.params["layer"] = std::to_string(i);
        job.params["num_layers"] = std::to_string(d->layers);
      }
      load_job(jobs[i], job);
      if (d)
        check_dump_layer(*d, job, first);
      kvc::KVExtents const loaded = extents_of(job.keys);
      if (uncomp) {
        kvc::KVExtents const ke = loaded;
        kvc::tools::check_calibration_fits(
            *s.calibration, s.calibration_path, d ? d->layers : 0, job.queries.ext.heads, ke.heads, ke.dim,
            d ? "--dump " + d->dir : "keys file " + job.keys.path + " / queries file " + job.queries.path);
        if (d)
          s.layer = static_cast<kvc::Index>(i);
        if (uncomp_cfg->gqa == kvc::tools::UNCompGqa::expand && job.queries.ext.heads != ke.heads) {
          expand_heads(job.keys, job.queries.ext.heads);
          expand_heads(*job.values, job.queries.ext.heads);
        }
      }
      if (packed) {
        PackedCompressed const pc = compress_packed(job, s, *rdkv_cfg);
        make_folders(dirs[i], made);
        stage_outputs(pc.outputs(dirs[i]), staged);
        timings.push_back(pc.timing);
        if (!first)
          first = LayerShape{loaded, job.values->array.shape[3]};
        continue;
      }
      Compressed c = compress_job(job, s);
      make_folders(dirs[i], made);
      stage_outputs(c.outputs(dirs[i], s.ragged), staged);
      timings.push_back(c.timing);
      if (!first)
        first = LayerShape{loaded, c.dim_v};  // as read (gqa=expand's outputs are per query head)
    }
    commit_outputs(staged);
  } catch (Failure const&) {
    staged.files.clear();  // the temporaries go first, then the folders that held them
    for (auto folder = made.rbegin(); folder != made.rend(); ++folder)  // deepest first; each is empty
      ::rmdir(folder->c_str());
    throw;
  }
  if (s.time) {
    std::string const alloc = s.alloc.any() ? s.alloc.name() : std::string();
    Timing total = timings.front();
    total.memory = Memory{};
    total.seconds = total.select_seconds = 0;
    total.bytes_read = total.workspace_bytes = total.state_bytes = 0;
    for (std::size_t i = 0; i < timings.size(); ++i) {
      Timing const& t = timings[i];
      print_time("compress", setup.policy, alloc,
                 d ? std::optional(std::pair{"layer", static_cast<kvc::Index>(i)}) : std::nullopt, t);
      total.seconds += t.seconds;
      total.select_seconds += t.select_seconds;
      total.bytes_read += t.bytes_read;
      total.workspace_bytes = std::max(total.workspace_bytes, t.workspace_bytes);
      total.state_bytes += t.state_bytes;
      *total.memory += *t.memory;
    }
    if (d)
      print_time("compress", setup.policy, alloc, std::pair{"layers", d->layers}, total);
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------------------------
// attend: attention of queries over a (compressed) cache, plain (kvc::attend) and corrected by MomentKV's moments
// (kvc::attend_corrected).

constexpr char const* attend_outputs[] = {"out.npy", "lse.npy", "plain_out.npy", "plain_lse.npy"};

/// "(1, 2, 3)".
std::string shape_text(std::vector<kvc::Index> const& shape) {
  std::string t = "(";
  for (std::size_t i = 0; i < shape.size(); ++i)
    t += (i ? ", " : "") + std::to_string(shape[i]);
  return t + ")";
}

/// attend's parameters: the correction's order and clamp (moment_kv's, with its defaults), the logit scale and how
/// the queries are read.
struct AttendSettings {
  kvc::CorrectedAttention op{};
  bool pre_rope = false;
  kvc::RopeSpec rope{};
};

AttendSettings attend_settings(Options const& o) {
  PolicyInfo const& mk = find_policy("moment_kv");
  std::vector<ParamInfo> const infos = {
      *find_param(mk, "order"),
      *find_param(mk, "clamp_tau"),
      {"scale", "0", "the logit scale c in [0, 1]; 0: 1 / sqrt(d)"},
      {"queries", "post_rope", "post_rope (as given) or pre_rope (rotated with --rope)", Stage::queries}};
  bool const moments = o.has("--moments");
  Params p;
  for (std::string const& kv : o.params) {
    std::size_t const eq = kv.find('=');
    if (eq == std::string::npos || eq == 0)
      fail(exit_usage, "--param '" + kv + "': expected NAME=VALUE");
    std::string const key = kv.substr(0, eq);
    if (std::none_of(infos.begin(), infos.end(), [&](ParamInfo const& i) { return key == i.name; }))
      fail(exit_usage, "--param '" + key + "' is not a parameter of `kvc attend` (its parameters: order, clamp_tau, " +
                           "scale, queries)");
    if ((key == "order" || key == "clamp_tau") && !moments)
      fail(exit_usage, "--param " + key + " sets the correction by the moments: pass --moments DIR");
    if (!p.emplace(key, kv.substr(eq + 1)).second)
      fail(exit_usage, "--param '" + key + "' given twice");
  }
  bool const post_rope_given = p.count("queries") && p.at("queries") == "post_rope";
  if (o.has("--rope") && post_rope_given)
    fail(exit_usage, "--rope given, but --param queries=post_rope: post-RoPE queries are used as given");
  for (ParamInfo const& i : infos)
    p.emplace(i.name, i.default_value);
  AttendSettings s;
  s.op.order =
      choice<kvc::MomentOrder>(p, "order", {{"first", kvc::MomentOrder::first}, {"zeroth", kvc::MomentOrder::zeroth}});
  s.op.clamp_tau = static_cast<float>(parse_real(p, "clamp_tau", 0.0, 1e30));
  s.op.attention.scale = static_cast<float>(parse_real(p, "scale", 0.0, 1.0));
  s.pre_rope = pre_rope(p) || o.has("--rope");
  if (o.has("--rope"))
    s.rope = parse_rope(o.get("--rope"));
  return s;
}

/// The largest position --indices may hold (so that one past it, the context's end, cannot overflow).
constexpr kvc::Index max_indexed_position = kvc::Index{1} << 62;

/// --indices I.npy: int64 [B, Hkv, N], each head's original positions ascending, then -1 padding (compress's
/// indices.npy). Fills each head's length and the positions table.
void load_indices(std::string const& path, kvc::KVExtents const& k, std::vector<kvc::Index>& lengths,
                  std::vector<kvc::Index>& positions) {
  std::string const where = "indices file " + path + ": ";
  Array a;
  read_array(path, where, a);
  if (a.elem != Elem::i64)
    fail(exit_invalid, where + a.dtype_error("'<i8' (int64)", "I64"));
  if (a.shape != std::vector<kvc::Index>{k.batch, k.heads, k.tokens})
    fail(exit_invalid, where + "field 'shape' is " + shape_text(a.shape) + ", expected [B, Hkv, N] = [" +
                           std::to_string(k.batch) + ", " + std::to_string(k.heads) + ", " + std::to_string(k.tokens) +
                           "] (the keys' shape[0], shape[1] and shape[2])");
  auto const heads = static_cast<std::size_t>(k.batch * k.heads);
  lengths = buffer<kvc::Index>(heads, "the lengths of " + path);
  positions = buffer<kvc::Index>(static_cast<std::size_t>(a.size()), "the positions of " + path);
  std::copy_n(a.as<std::int64_t>(), a.size(), positions.data());
  for (std::size_t bh = 0; bh < heads; ++bh) {
    kvc::Index const* row = positions.data() + bh * static_cast<std::size_t>(k.tokens);
    kvc::Index n = 0;
    while (n < k.tokens && row[n] >= 0)
      ++n;
    lengths[bh] = n;
    for (kvc::Index t = 0; t < k.tokens; ++t) {
      std::string const at = "field 'data': head (" + std::to_string(bh / static_cast<std::size_t>(k.heads)) + ", " +
                             std::to_string(bh % static_cast<std::size_t>(k.heads)) + ") slot " + std::to_string(t) +
                             " holds " + std::to_string(row[t]);
      if (t < n && (row[t] >= max_indexed_position || (t > 0 && row[t] <= row[t - 1])))
        fail(exit_invalid, where + at + ", expected positions ascending strictly, in [0, 2^62), then -1 padding");
      if (t >= n && row[t] != -1)
        fail(exit_invalid, where + at + ", expected -1 (padding: the head's count is " + std::to_string(n) + ")");
    }
  }
}

/// The moments --moments DIR holds (moment_count.npy, moment_key_mean.npy, moment_value_mean.npy,
/// moment_comoment.npy, as compress writes them), checked against the cache: keys [B, Hkv, N, d_k], values' d_v.
struct MomentInputs {
  std::string dir;
  Array key_mean, value_mean, comoment;
  std::vector<kvc::Index> count;
  std::size_t file_bytes = 0;

  std::string path(std::size_t i) const { return dir + "/" + moment_outputs[i]; }
  /// Calls fn(MomentState<HostSpace, MT>) over the arrays (MT float or kvc::half: their dtype).
  template <class Fn>
  void with_state(kvc::KVExtents const& k, kvc::Index dv, Fn&& fn) {
    auto run = [&](auto tag) {
      using MT = decltype(tag);
      fn(kvc::MomentState<kvc::HostSpace, MT>{
          count.data(), reinterpret_cast<MT*>(key_mean.data.data()), reinterpret_cast<MT*>(value_mean.data.data()),
          reinterpret_cast<MT*>(comoment.data.data()), k.batch, k.heads, k.dim, dv});
    };
    if (key_mean.elem == Elem::f16)
      run(kvc::half{});
    else
      run(float{});
  }
};

void load_moment_inputs(std::string const& dir, kvc::KVExtents const& k, kvc::Index dv, MomentInputs& m) {
  m.dir = dir;
  std::string const dims = "(the keys' batch and KV heads";
  auto expect_shape = [&](Array const& a, std::size_t i, std::vector<kvc::Index> const& want, std::string const& what) {
    if (a.shape != want)
      fail(exit_invalid,
           "moments file " + m.path(i) + ": field 'shape' is " + shape_text(a.shape) + ", expected " + what + " = " +
               shape_text(want) + " " + dims +
               (want.size() > 2 ? std::string(", the keys' head_dim d_k and the values' d_v)") : std::string(")")));
  };
  Array count;
  read_array(m.path(0), "moments file " + m.path(0) + ": ", count);
  if (count.elem != Elem::i64)
    fail(exit_invalid, "moments file " + m.path(0) + ": " + count.dtype_error("'<i8' (int64)", "I64"));
  expect_shape(count, 0, {k.batch, k.heads}, "[B, Hkv]");
  m.count = buffer<kvc::Index>(static_cast<std::size_t>(count.size()), "the moments of " + dir);
  std::copy_n(count.as<std::int64_t>(), count.size(), m.count.data());
  for (std::size_t i = 0; i < m.count.size(); ++i)
    if (m.count[i] < 0)
      fail(exit_invalid, "moments file " + m.path(0) + ": field 'data': the count of head (" +
                             std::to_string(i / static_cast<std::size_t>(k.heads)) + ", " +
                             std::to_string(i % static_cast<std::size_t>(k.heads)) + ") is " +
                             std::to_string(m.count[i]) + ", expected >= 0 (evicted tokens)");
  m.file_bytes = count.data.size();
  Array* arrays[] = {&m.key_mean, &m.value_mean, &m.comoment};
  std::vector<kvc::Index> const shapes[] = {
      {k.batch, k.heads, k.dim}, {k.batch, k.heads, dv}, {k.batch, k.heads, dv, k.dim}};
  char const* const names[] = {"[B, Hkv, d_k]", "[B, Hkv, d_v]", "[B, Hkv, d_v, d_k]"};
  for (std::size_t i = 0; i < 3; ++i) {
    Array& a = *arrays[i];
    std::string const where = "moments file " + m.path(i + 1) + ": ";
    read_array(m.path(i + 1), where, a);
    if (a.elem != Elem::f32 && a.elem != Elem::f16)
      fail(exit_invalid, where + a.dtype_error("'<f4' (float32) or '<f2' (float16)", "F32 or F16"));
    if (i > 0 && a.elem != m.key_mean.elem)
      fail(exit_invalid, where + "field 'descr' is " + a.dtype_text + ", expected " + m.key_mean.dtype_text + " (" +
                             moment_outputs[1] + "'s: the moments share one dtype)");
    expect_shape(a, i + 1, shapes[i], names[i]);
    for (kvc::Index j = 0; j < a.size(); ++j) {
      float const x = a.elem == Elem::f16 ? kvc::to_float(a.as<kvc::half>()[j]) : a.as<float>()[j];
      if (!std::isfinite(x))
        fail(exit_invalid,
             where + "field 'data' holds NaN or Inf (element " + std::to_string(j) + "), expected finite values");
      if (i == 0 && !kvc::in_exact_range(x, k.dim))
        fail(exit_invalid, where + "field 'data': element " + std::to_string(j) + " is " + short_number(x) + ", " +
                               range_text(k.dim));
    }
    m.file_bytes += a.data.size();
  }
}

int cmd_attend(Options const& o) {
  if (!o.has("--keys") || !o.has("--values") || !o.has("--queries") || !o.has("--out-dir"))
    fail(exit_usage, "attend needs --keys, --values, --queries and --out-dir");
  AttendSettings const a = attend_settings(o);
  bool const moments = o.has("--moments");
  std::string const out_dir = o.get("--out-dir");
  struct stat st {};
  if (::stat(out_dir.c_str(), &st) == 0 && !S_ISDIR(st.st_mode))
    fail(exit_invalid, "--out-dir " + out_dir + " exists and is not a directory");
  std::vector<NamedInput> inputs = option_inputs(o);
  if (moments)
    for (char const* name : moment_outputs)
      inputs.emplace_back("--moments file", o.get("--moments") + "/" + name);
  std::vector<std::string> outputs;
  for (std::size_t i = 0; i < (moments ? 4u : 2u); ++i)
    outputs.push_back(out_dir + "/" + attend_outputs[i]);
  check_outputs(inputs, outputs, "output file");
  kvc::Index const threads = thread_count(o);

  Input keys = load_tensor(o.get("--keys"), "keys", kv_dims, /*fp8=*/true);
  Input values = load_tensor(o.get("--values"), "values", kv_dims, /*fp8=*/true);
  set_scale(keys, scale_option(o, "--k-scale"), "--k-scale", "keys");
  set_scale(values, scale_option(o, "--v-scale"), "--v-scale", "values");
  kvc::KVExtents const k = extents_of(keys);
  kvc::Index const dv = values.array.shape[3];
  std::vector<kvc::Index> lengths, key_positions;  // --indices
  if (o.has("--indices"))
    load_indices(o.get("--indices"), k, lengths, key_positions);
  Queries q;
  load_queries(o.get("--queries"), o.get("--positions"), &k, keys.path, false, a.rope, q);
  kvc::Index const n = q.ext.tokens;
  if (q.positions.empty()) {  // the cache's last n positions, as kvc::attend takes them (kvc::context_end)
    q.positions = buffer<kvc::Index>(static_cast<std::size_t>(q.ext.batch * n), "the positions of " + q.path);
    for (kvc::Index b = 0; b < k.batch; ++b) {
      kvc::Index end = 0;
      for (kvc::Index h = 0; h < k.heads; ++h) {
        auto const bh = static_cast<std::size_t>(b * k.heads + h);
        kvc::Index const len = lengths.empty() ? k.tokens : lengths[bh];
        kvc::Index const last =
            len == 0
                ? 0
                : (key_positions.empty()
                       ? len
                       : key_positions[bh * static_cast<std::size_t>(k.tokens) + static_cast<std::size_t>(len - 1)] +
                             1);
        end = std::max(end, last);
      }
      if (end < n)
        fail(exit_invalid, "queries file " + q.path + ": field 'shape': " + std::to_string(n) +
                               " query rows (shape[2]) would sit at the cache's last positions, but sequence " +
                               std::to_string(b) + "'s cache ends at position " + std::to_string(end) +
                               " (pass --positions P.npy)");
      for (kvc::Index i = 0; i < n; ++i)
        q.positions[static_cast<std::size_t>(b * n + i)] = end - n + i;
    }
  }
  if (a.pre_rope) {
    kvc::Index const max_position = *std::max_element(q.positions.begin(), q.positions.end());
    std::size_t const per_position = static_cast<std::size_t>(q.ext.dim) * sizeof(float);
    if (static_cast<std::size_t>(max_position) >= max_rope_table_bytes / per_position)
      fail(exit_invalid, "queries file " + q.path + ": position " + std::to_string(max_position) +
                             " needs a RoPE table over 1 GiB; expected positions < " +
                             std::to_string(max_rope_table_bytes / per_position));
    fill_query_rope(a.rope, max_position, q);
    for (kvc::Index r = 0; r < q.ext.rows(); ++r) {  // row (b, head, i) rotated to position positions[b, i]
      kvc::Index const b = r / (q.ext.heads * n), i = r % n;
      q.rope.rotate(q.rows.data() + r * q.ext.dim, q.positions[static_cast<std::size_t>(b * n + i)]);
    }
  }
  MomentInputs mi;
  if (moments)
    load_moment_inputs(o.get("--moments"), k, dv, mi);

  std::size_t const out_size = kvc::bytes_product(q.ext.rows(), dv);
  std::string const what = "the attention output of " + q.path;
  std::vector<float> out = buffer<float>(out_size, what),
                     lse = buffer<float>(static_cast<std::size_t>(q.ext.rows()), what);
  std::vector<float> plain_out, plain_lse;
  if (moments) {
    plain_out = buffer<float>(out_size, what);
    plain_lse = buffer<float>(static_cast<std::size_t>(q.ext.rows()), what);
  }
  kvc::ThreadPool pool(threads);
  kvc::Cpu const cpu = threads > 1 ? pool.cpu() : kvc::Cpu{};
  std::string const context = "keys file " + keys.path + " / queries file " + q.path;
  double seconds = 0, corrected_seconds = -1;
  std::size_t workspace_bytes = 0, moment_bytes = 0;
  with_cache(keys, &values, KeyRange::logits, [&](auto const& plain) {
    auto const cache = kvc::make_cache(plain.keys, plain.values,
                                       lengths.empty() ? kvc::Lengths{} : kvc::head_lengths(lengths.data(), k.heads),
                                       key_positions.empty() ? nullptr : key_positions.data());
    kvc::AttendQueries<float> const aq{
        kvc::TokenRows<float const, kvc::StridedLayout>(q.rows.data(), kvc::bhtd_layout(q.ext)), q.positions.data()};
    float* const plain_o = moments ? plain_out.data() : out.data();
    float* const plain_l = moments ? plain_lse.data() : lse.data();
    Scratch const ws = workspace(kvc::attend_workspace_bytes(cpu, a.op.attention, aq, cache),
                                 "the attention's workspace over " + context);
    auto plain_once = [&] {
      check_status(kvc::attend(cpu, a.op.attention, aq, cache, kvc::AttendOutput<>{plain_o, plain_l}, ws.span()),
                   context);
    };
    plain_once();
    workspace_bytes = ws.size;
    if (o.time)
      seconds = median_seconds(timing_repeats, plain_once);
    if (!moments)
      return;
    mi.with_state(k, dv, [&](auto const& state) {
      using MT = typename std::remove_cvref_t<decltype(state)>::value_type;
      Scratch const cws = workspace(kvc::attend_corrected_workspace_bytes(cpu, a.op, aq, cache, state),
                                    "the corrected attention's workspace over " + context);
      auto corrected_once = [&] {
        check_status(
            kvc::attend_corrected(cpu, a.op, aq, cache, state, kvc::AttendOutput<>{out.data(), lse.data()}, cws.span()),
            context + " / moments " + mi.dir);
      };
      corrected_once();
      workspace_bytes = std::max(workspace_bytes, cws.size);
      moment_bytes = kvc::moment_state_bytes<MT>(k.batch, k.heads, k.dim, dv);
      if (o.time)
        corrected_seconds = median_seconds(timing_repeats, corrected_once);
    });
  });
  // The outputs are finite (lse may be -inf where a query sees nothing): moments too large for fp32 are refused.
  for (std::size_t i = 0; i < out.size(); ++i)
    if (!std::isfinite(out[i])) {
      std::size_t const row = i / static_cast<std::size_t>(dv);
      std::string const at = "[" + std::to_string(row / static_cast<std::size_t>(q.ext.heads * n)) + ", " +
                             std::to_string(row / static_cast<std::size_t>(n) % static_cast<std::size_t>(q.ext.heads)) +
                             ", " + std::to_string(row % static_cast<std::size_t>(n)) + "]";
      fail(exit_invalid, moments ? "moments " + mi.dir + ": the corrected attention output of query " + at +
                                       " is not finite in float32 (moment_comoment.npy or moment_value_mean.npy holds "
                                       "values too large for the correction)"
                                 : "the attention output of query " + at + " over " + context + " is not finite");
    }
  if (o.time) {
    nlohmann::ordered_json j;
    j["command"] = "attend";
    j["seconds"] = seconds;
    if (corrected_seconds >= 0)
      j["corrected_seconds"] = corrected_seconds;
    j["repeats"] = timing_repeats;
    j["bytes_read"] = keys.array.data.size() + values.array.data.size() + q.file_bytes + mi.file_bytes;
    j["workspace_bytes"] = workspace_bytes;
    j["moment_bytes"] = moment_bytes;
    j["threads"] = threads;
    j["isa"] = compiled_isa();
    print_json_line(j);
  }
  std::vector<Output> files = {
      {out_dir + "/" + attend_outputs[0], kvc::NpyDtype::f32, {q.ext.batch, q.ext.heads, n, dv}, out.data()},
      {out_dir + "/" + attend_outputs[1], kvc::NpyDtype::f32, {q.ext.batch, q.ext.heads, n}, lse.data()}};
  if (moments) {
    files.push_back(
        {out_dir + "/" + attend_outputs[2], kvc::NpyDtype::f32, {q.ext.batch, q.ext.heads, n, dv}, plain_out.data()});
    files.push_back(
        {out_dir + "/" + attend_outputs[3], kvc::NpyDtype::f32, {q.ext.batch, q.ext.heads, n}, plain_lse.data()});
  }
  std::vector<std::string> made;
  Staged staged;
  try {
    make_folders(out_dir, made);
    stage_outputs(files, staged);
    commit_outputs(staged);
  } catch (Failure const&) {
    staged.files.clear();
    for (auto folder = made.rbegin(); folder != made.rend(); ++folder)
      ::rmdir(folder->c_str());
    throw;
  }
  return 0;
}

int cmd_policies() {
  auto param_text = [](ParamInfo const& p) {
    std::string s = std::string("--param ") + p.name + "=" + p.default_value;
    if (p.kvpress_default)
      s += std::string(" (kvpress: ") + p.kvpress_default + ")";
    if (p.authors_default)
      s += std::string(" (authors: ") + p.authors_default + ")";
    return s;
  };
  std::size_t width = 0;
  for (auto const& policy : policies())
    for (auto const& p : policy.params)
      width = std::max(width, param_text(p).size());
  for (auto const& a : allocators())
    for (auto const& p : a.params)
      width = std::max(width, param_text(p).size());
  for (auto const& policy : policies()) {
    char const* reads = !policy.token_scores   ? "--queries"
                        : policy.reads_queries ? "keys and --queries"
                                               : (policy.reads_keys ? "keys" : "no tensor data");
    std::fprintf(io.out, "%s  (reads %s)\n    %s\n", policy.name, reads, policy.summary);
    for (auto const& p : policy.params)
      std::fprintf(io.out, "    %-*s  %s\n", static_cast<int>(width), param_text(p).c_str(), p.help);
  }
  std::fprintf(
      io.out,
      "n_sink and n_recent protect tokens in compress's top-k selection; `kvc score` rejects them, and rdkv's and\n"
      "kivi's allocation and packing parameters too.\n"
      "budgets (compress): --ratio R (fraction removed, kept = floor(N*(1-R))) or --budget N (tokens per head)\n");
  std::fprintf(io.out,
               "\nallocators (compress --allocator ada_kv, pyramid_kv or pyramid_kv+ada_kv, with any policy): their "
               "parameters\nare --param too; one the policy also has (reference, snap_kv's window_size) is one "
               "parameter, with the\nallocator's default\n");
  for (auto const& a : allocators()) {
    std::fprintf(io.out, "%s  (allocator)\n    %s\n", a.name, a.summary);
    for (auto const& p : a.params)
      std::fprintf(io.out, "    %-*s  %s\n", static_cast<int>(width), param_text(p).c_str(), p.help);
  }
  return 0;
}

}  // namespace

namespace kvc::cli {

int run(int argc, char const* const* argv, std::FILE* out, std::FILE* err) {
  io = {out, err};
  CommandInfo const* command = nullptr;
  try {
    Options const o = parse_args(argc, argv);
    command = o.command;
    if (o.help) {
      std::fputs(o.command ? help_text(*o.command).c_str() : overview_text, io.out);
      return 0;
    }
    std::string_view const name = o.command->name;
    if (name == "score")
      return cmd_score(o);
    if (name == "compress")
      return cmd_compress(o);
    if (name == "attend")
      return cmd_attend(o);
    return cmd_policies();
  } catch (Failure const& f) {
    std::fprintf(io.err, "kvc: error: %s\n", f.message.c_str());
    if (f.code == exit_usage) {
      if (command == nullptr && argc > 1)
        command = find_command(argv[1]);
      if (command)
        std::fprintf(io.err, "%sRun `kvc %s --help` for the options.\n", command->synopsis, command->name);
      else
        std::fputs(overview_text, io.err);
    }
    return f.code;
  } catch (std::bad_alloc const&) {  // every large buffer is named by buffer(); this is a last resort
    std::fprintf(io.err, "kvc: error: out of memory\n");
    return exit_invalid;
  } catch (std::logic_error const& e) {  // a bug in kvc, not in the input: its own exit code (the fuzzer stops)
    std::fprintf(io.err, "kvc: internal error: %s\n", e.what());
    return exit_internal;
  } catch (std::exception const& e) {
    std::fprintf(io.err, "kvc: error: %s\n", e.what());
    return exit_invalid;
  }
}

}  // namespace kvc::cli
