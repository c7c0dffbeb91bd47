// SPDX-License-Identifier: Apache-2.0
// tools/kvc/cli.cpp: the `kvc` command-line tool: score and compress .npy or .safetensors KV dumps with any kvc
// policy.
// Contract (docs/cli.md, DESIGN.md §6): exit 0 success, 2 usage error, 3 invalid input (the message names the file,
// the field and what was expected). Every policy is one row of policies() and one branch of with_policy().
// Files are untrusted (docs/cli.md "Untrusted input"): inputs must be regular files whose sizes bound every
// allocation; outputs are staged beside their destination and renamed into place only when all of them are whole.
#include "cli.hpp"

#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/scorers/key_diff.hpp>
#include <kvc/backend/cpu/scorers/knorm.hpp>
#include <kvc/backend/cpu/scorers/random.hpp>
#include <kvc/backend/cpu/scorers/snap_kv.hpp>
#include <kvc/backend/cpu/scorers/streaming_llm.hpp>
#include <kvc/backend/cpu/scorers/tova.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/backend/cpu/thread_pool.hpp>
#include <kvc/core/rope.hpp>
#include <kvc/core/validate.hpp>
#include <kvc/io/file.hpp>
#include <kvc/io/json.hpp>
#include <kvc/io/npy.hpp>
#include <kvc/io/safetensors.hpp>
#include <kvc/pipeline/press.hpp>

#include "common/observations.hpp"
#include "common/policies.hpp"

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
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <sys/stat.h>
#include <type_traits>
#include <unistd.h>
#include <utility>
#include <vector>

namespace {

using namespace kvc::tools;  // the policy table, Failure and the exit codes (tools/common/policies.hpp)

/// Where the tool prints: the standard streams for the program, others for the fuzzer.
struct Streams {
  std::FILE* out = stdout;
  std::FILE* err = stderr;
} io;

// ---------------------------------------------------------------------------------------------------------------
// Commands and options.

struct CommandInfo {
  char const* name;
  char const* synopsis;     ///< usage lines (printed with usage errors)
  char const* intro;        ///< what the command does (--help)
  char const* own_options;  ///< the options only this command has (--help)
  std::vector<std::string_view> options;
};

char const* const overview_text =
    "kvc: score and compress .npy or .safetensors KV-cache dumps with kvc's policies.\n"
    "usage:\n"
    "  kvc score    --policy NAME [--param NAME=VALUE]... --keys K.npy [--queries Q.npy] --out scores.npy\n"
    "  kvc compress --policy NAME (--ratio R | --budget N) [--param NAME=VALUE]... --keys K.npy --values V.npy\n"
    "               [--queries Q.npy] --out-dir DIR\n"
    "  kvc policies        every policy with its parameters and defaults\n"
    "  kvc COMMAND --help  the options of one command\n"
    "Keys and values are [B, Hkv, N, d] float32 or float16 .npy (C order), post-RoPE as an engine caches them, or\n"
    "a tensor of a .safetensors file (FILE.safetensors:TENSOR, or FILE.safetensors holding one tensor; F32, F16\n"
    "or BF16). Outputs are .npy.\n"
    "Exit codes: 0 success, 2 usage error, 3 invalid input (the message names the file, the field and what was\n"
    "expected).\n";

char const* const input_details =
    "  --policy NAME          a policy from `kvc policies`\n"
    "  --param NAME=VALUE     a parameter of the policy (repeatable); names the policy does not have are rejected\n"
    "  --keys K.npy           [B, Hkv, N, d] float32 or float16, C order, post-RoPE as an engine caches them;\n"
    "                         slot t holds position t. Every input may instead be FILE.safetensors:TENSOR (split\n"
    "                         at the last ':' after \".safetensors\"), or FILE.safetensors when it holds one\n"
    "                         tensor; F32, F16 or BF16 (I64 for --positions)\n"
    "  --values V.npy         [B, Hkv, N, d_v], the keys' dtype\n"
    "  --queries Q.npy        [B, Hq, w, d] float32 or float16 (Hq a multiple of Hkv; query head q reads KV head\n"
    "                         q / (Hq / Hkv)): the last w queries of the context. Required by the policies that\n"
    "                         read queries (snap_kv, tova), rejected by the others. Pre-RoPE unless\n"
    "                         --param queries=post_rope\n"
    "  --positions P.npy      int64 [B, w]: each query's absolute position, for RoPE and the causal mask\n"
    "                         (default: the context's last w positions, N - w + i)\n"
    "  --rope theta=T,style=S the RoPE that rotates pre-RoPE queries (default theta=10000,style=neox); style neox\n"
    "                         (rotate-half: Hugging Face Llama, Qwen, Mistral) or interleaved (GPT-J, llama.cpp);\n"
    "                         rejected with --param queries=post_rope\n"
    "  --time                 print one JSON line to stderr: {\"command\", \"policy\", \"seconds\" (scoring, median "
    "of\n"
    "                         7 calls, file I/O excluded), \"select_seconds\" (compress: the selection, likewise),\n"
    "                         \"repeats\", \"bytes_read\" (K and Q bytes read per scoring call),\n"
    "                         \"workspace_bytes\" (kvc's scratch for those calls), \"threads\"}\n"
    "  --threads N            worker threads over (sequence, KV head) items, over sequences for tova (default 1;\n"
    "                         results do not depend on it)\n";

std::vector<CommandInfo> const& commands() {
  static std::vector<CommandInfo> const list = {
      {"score",
       "usage: kvc score --policy NAME [--param NAME=VALUE]... --keys K.npy [--values V.npy]\n"
       "                 [--queries Q.npy [--positions P.npy] [--rope theta=T,style=neox|interleaved]]\n"
       "                 --out scores.npy [--time] [--threads N]\n",
       "Scores every cached token with a policy: writes [B, Hkv, N] float32, higher = keep.\n",
       "  --out scores.npy       the scores\n",
       {"--policy", "--param", "--keys", "--values", "--queries", "--positions", "--rope", "--out", "--time",
        "--threads"}},
      {"compress",
       "usage: kvc compress --policy NAME (--ratio R | --budget N) [--param NAME=VALUE]... --keys K.npy\n"
       "                    --values V.npy [--queries Q.npy [--positions P.npy] [--rope theta=T,style=S]]\n"
       "                    --out-dir DIR [--time] [--threads N]\n",
       "Keeps the best-scored tokens of each (sequence, KV head) and writes, in DIR: keys.npy and values.npy\n"
       "([B, Hkv, n_kept, d], input dtype), indices.npy (int64 [B, Hkv, n_kept], ascending, -1 padding where heads\n"
       "keep different counts) and counts.npy (int64 [B, Hkv]).\n",
       "  --ratio R              the fraction of tokens removed, in [0, 1]: kept = floor(N * (1 - R))\n"
       "  --budget N             tokens kept per head\n"
       "  --out-dir DIR          created if absent\n",
       {"--policy", "--param", "--keys", "--values", "--queries", "--positions", "--rope", "--ratio", "--budget",
        "--out-dir", "--time", "--threads"}},
      {"policies",
       "usage: kvc policies\n",
       "Lists every policy with every parameter (--param NAME=DEFAULT) and what it reads.\n",
       "",
       {}},
  };
  return list;
}

CommandInfo const* find_command(std::string_view name) {
  for (auto const& c : commands())
    if (name == c.name)
      return &c;
  return nullptr;
}

void print_help(CommandInfo const& c) {
  std::fputs(c.synopsis, io.out);
  std::fputs(c.intro, io.out);
  if (std::string_view(c.name) != "policies") {
    std::fputs(input_details, io.out);
    std::fputs(c.own_options, io.out);
    std::fprintf(io.out, "Policies: %s (parameters: `kvc policies`).\n", policy_names().c_str());
    std::fputs("Exit codes: 0 success, 2 usage error, 3 invalid input.\n", io.out);
  }
}

struct Options {
  CommandInfo const* command = nullptr;
  std::map<std::string, std::string, std::less<>> values;  ///< option -> value, e.g. "--keys" -> path
  std::vector<std::string> params;
  bool time = false;
  bool help = false;

  bool has(std::string_view opt) const { return values.find(opt) != values.end(); }
  std::string get(std::string_view opt) const {
    auto const it = values.find(opt);
    return it == values.end() ? std::string() : it->second;
  }
};

Options parse_args(int argc, char const* const* argv) {
  if (argc < 2)
    fail(exit_usage, "missing command");
  std::string const name = argv[1];
  Options o;
  if (name == "--help" || name == "-h" || name == "help") {
    o.help = true;
    o.command = argc > 2 ? find_command(argv[2]) : nullptr;
    return o;
  }
  o.command = find_command(name);
  if (o.command == nullptr)
    fail(exit_usage, "unknown command '" + name + "'");
  auto const& allowed = o.command->options;
  for (int i = 2; i < argc; ++i)
    if (std::string_view(argv[i]) == "--help" || std::string_view(argv[i]) == "-h")
      o.help = true;
  if (o.help)
    return o;
  std::vector<std::string_view> known;
  for (auto const& c : commands())
    known.insert(known.end(), c.options.begin(), c.options.end());
  for (int i = 2; i < argc; ++i) {
    std::string const a = argv[i];
    if (std::find(allowed.begin(), allowed.end(), a) == allowed.end()) {
      if (std::find(known.begin(), known.end(), a) != known.end())
        fail(exit_usage, a + " is not an option of `kvc " + name + "`");
      fail(exit_usage, "unknown argument '" + a + "'");
    }
    if (a == "--time") {
      o.time = true;
      continue;
    }
    if (i + 1 >= argc)
      fail(exit_usage, a + " needs a value");
    std::string const value = argv[++i];
    if (a == "--param")
      o.params.push_back(value);
    else if (!o.values.emplace(a, value).second)
      fail(exit_usage, a + " given twice");
  }
  return o;
}

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

/// Usage checks of --queries, --positions and --rope against the policy (before any file is read).
void check_query_options(PolicyInfo const& policy, Options const& o, Params const& p) {
  if (!policy.reads_queries) {
    for (char const* opt : {"--queries", "--positions", "--rope"})
      if (o.has(opt))
        fail(exit_usage, std::string(opt) + " given, but policy " + policy.name +
                             " does not read queries (the policies that do: " + policy_names(true) + ")");
    return;
  }
  if (!o.has("--queries"))
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
constexpr char const* input_options[] = {"--keys", "--values", "--queries", "--positions"};

/// Checks, before any input is read, that the output paths can be replaced: each is new or a regular file (never a
/// directory or a device such as /dev/null, which renaming would replace), none is one of the inputs, and no two are
/// the same file (same device and inode, whatever the paths: symbolic and hard links included). `what` names the
/// outputs in messages ("--out", "output file").
void check_outputs(Options const& o, std::vector<std::string> const& paths, std::string const& what) {
  std::vector<std::optional<kvc::FileId>> ids;
  for (std::string const& path : paths) {
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
      fail(exit_invalid,
           what + " " + path + " exists and is not a regular file; expected a new path or a file to replace");
    std::optional<kvc::FileId> const id = kvc::file_id(path);
    for (char const* opt : input_options)
      if (id && o.has(opt) && kvc::file_id(input_spec(o.get(opt)).file) == id)
        fail(exit_invalid, what + " " + path + " is the same file as " + opt + " " + o.get(opt) +
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
};

/// Writes every output whole or none: each is staged in a temporary file beside its destination (written, synced
/// and closed, every error checked), and they are renamed into place only once all are whole. A failure removes
/// the temporaries and names the file; the destinations keep what they held. (Links are followed: an existing
/// destination is replaced where its link points.)
void write_outputs(std::vector<Output> const& outputs) {
  std::vector<kvc::StagedFile> staged(outputs.size());
  std::vector<std::string> destinations;
  std::string error;
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    Output const& out = outputs[i];
    std::error_code ec;
    std::filesystem::path const real = std::filesystem::exists(out.path, ec) && !ec
                                           ? std::filesystem::canonical(out.path, ec)
                                           : std::filesystem::path(out.path);
    destinations.push_back(ec ? out.path : real.string());
    if (!kvc::stage_npy(staged[i], destinations[i], out.dtype, out.shape, out.data, error))
      fail(exit_invalid, "output file " + out.path + ": " + error);
  }
  std::size_t failed = 0;
  if (!kvc::commit_together(staged, error, failed))
    fail(exit_invalid, "output file " + outputs[failed].path + ": " + error);
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
enum class Elem : std::uint8_t { f32, f16, bf16, i64, other };

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
    return elem == Elem::f16 || elem == Elem::bf16 ? 2 : elem == Elem::f32 ? 4 : 8;
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
  out.elem = t->dtype == SafetensorsDtype::f32    ? Elem::f32
             : t->dtype == SafetensorsDtype::f16  ? Elem::f16
             : t->dtype == SafetensorsDtype::bf16 ? Elem::bf16
             : t->dtype == SafetensorsDtype::i64  ? Elem::i64
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
};

/// Reads a rank-4 float32/float16 (or bfloat16, from .safetensors) tensor; `role` names it in messages ("keys file
/// K.npy: ..."). The file's size bounds the array, and every dimension must be >= 1, so that no size derived from
/// the shape (scores, plans, workspaces) exceeds what the file holds.
Input load_tensor(std::string const& path, char const* role, char const* dims) {
  Input in{path, {}};
  std::string const where = std::string(role) + " file " + path + ": ";
  read_array(path, where, in.array);
  auto const& s = in.array.shape;
  if (s.size() != 4)
    fail(exit_invalid,
         where + "field 'shape' has " + std::to_string(s.size()) + " dimensions, expected 4 (" + dims + ")");
  if (in.array.elem != Elem::f32 && in.array.elem != Elem::f16 && in.array.elem != Elem::bf16)
    fail(exit_invalid, where + in.array.dtype_error("'<f4' (float32) or '<f2' (float16)", "F32, F16 or BF16"));
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
    auto const cache = kvc::make_cache(kvc::bhtd_rows(kp, ek), kvc::bhtd_rows(vp, ev));
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
  if (keys.array.elem == Elem::f16)
    run(kvc::half{});
  else if (keys.array.elem == Elem::bf16)
    run(kvc::bfloat16{});
  else
    run(float{});
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

/// Loads --queries (and --positions) for keys of extents `k`, and fills the RoPE table when they are pre-RoPE.
void load_queries(Options const& o, kvc::KVExtents const& k, std::string const& keys_path, bool rotate,
                  kvc::RopeSpec const& spec, Queries& q) {
  q.path = o.get("--queries");
  Input const in = load_tensor(q.path, "queries", "[batch, query_heads, window, head_dim]");
  q.ext = extents_of(in);
  q.file_bytes = in.array.data.size();
  std::string const where = "queries file " + q.path + ": field 'shape': ";
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
    if (!kvc::in_exact_range(q.rows[i], q.ext.dim))
      fail(exit_invalid, "queries file " + q.path + ": field 'data': element " + std::to_string(i) + " is " +
                             short_number(q.rows[i]) + ", " + range_text(q.ext.dim));
  }

  kvc::Index max_position = k.tokens - 1;  // the default positions end at N - 1
  if (o.has("--positions")) {
    q.positions_path = o.get("--positions");
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
  if (!rotate)
    return;
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
template <class S>
kvc::Index rows_used(S const&, kvc::Index rows) {
  return rows;
}

/// Calls fn(scorer, obs) with the observations the scorer needs (tools/common/observations.hpp) after checking
/// that the queries hold the rows it reads and that those rows fit the context.
template <class S, class C, class Fn>
void with_observations(S const& scorer, C const& cache, Queries const& q, std::string const& keys_path,
                       kvc::RopeSpec const& spec, Fn&& fn) {
  kvc::KVExtents const k = cache.keys.extents();
  kvc::Index const used = rows_used(scorer, q.ext.tokens);
  if (used > q.ext.tokens)
    fail(exit_invalid, "queries file " + q.path + ": field 'shape': window (shape[2]) is " +
                           std::to_string(q.ext.tokens) + ", but policy " + std::string(S::name) + " reads the last " +
                           std::to_string(used) +
                           " query rows (--param window_size); pass more queries or a smaller window_size");
  if (q.positions.empty() && used > k.tokens)
    fail(exit_invalid, "keys file " + keys_path + ": field 'shape': tokens (shape[2]) is " + std::to_string(k.tokens) +
                           ", but the last " + std::to_string(used) + " query rows sit at positions N - " +
                           std::to_string(used) + " .. N - 1 (pass --positions P.npy)");
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

/// What --time prints (one JSON line on stderr).
struct Timing {
  double seconds = 0;               ///< scoring, median
  double select_seconds = -1;       ///< compress: the selection, median (left out when negative)
  std::size_t workspace_bytes = 0;  ///< kvc's workspaces for the calls timed (score, and select for compress)
  kvc::Index threads = 1;
};

void print_time(char const* command, PolicyInfo const& policy, Timing const& t, std::size_t bytes_read) {
  char selection[64] = "";
  if (t.select_seconds >= 0)
    std::snprintf(selection, sizeof selection, ", \"select_seconds\": %.9g", t.select_seconds);
  std::fprintf(io.err,
               "{\"command\": \"%s\", \"policy\": \"%s\", \"seconds\": %.9g%s, \"repeats\": %d, \"bytes_read\": %zu, "
               "\"workspace_bytes\": %zu, \"threads\": %lld}\n",
               command, policy.name, t.seconds, selection, timing_repeats, bytes_read, t.workspace_bytes,
               static_cast<long long>(t.threads));
}

/// --threads N (default 1): the worker threads of kvc::ThreadPool the kernels spread (sequence, head) items over.
kvc::Index thread_count(Options const& o) {
  kvc::Index const n = o.has("--threads") ? parse_count(o.get("--threads"), "--threads", 1) : 1;
  if (n > 1024)
    fail(exit_invalid, "--threads " + o.get("--threads") + ": expected at most 1024");
  return n;
}

void check_status(kvc::Status st, std::string const& context) {
  if (!st.ok())
    fail(exit_invalid, context + ": " + st.message());
}

/// What score and compress share: the policy, its parameters, the keys (and values) and the queries.
struct Job {
  PolicyInfo const& policy;
  Params params;
  bool rotate = false;  ///< pre-RoPE queries, rotated with `rope`
  kvc::RopeSpec rope{};
  Input keys;
  std::optional<Input> values;
  Queries queries;

  explicit Job(PolicyInfo const& p) : policy(p) {}

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
  if (o.has("--rope"))
    job.rope = parse_rope(o.get("--rope"));
  job.rotate = job.policy.reads_queries && pre_rope(job.params);
}

/// Reads the keys, the values and the queries.
void load_job(Options const& o, Job& job) {
  job.keys = load_tensor(o.get("--keys"), "keys", kv_dims);
  if (o.has("--values"))
    job.values = load_tensor(o.get("--values"), "values", kv_dims);
  if (job.policy.reads_queries)
    load_queries(o, extents_of(job.keys), job.keys.path, job.rotate, job.rope, job.queries);
}

/// A kernel's workspace: uninitialised (kernels write before they read, so untouched pages cost nothing), within
/// the memory available, and refused with a message when its size saturated (a product of two inputs' sizes).
struct Scratch {
  std::unique_ptr<std::byte[]> data;
  std::size_t size = 0;
  kvc::Workspace span() const { return {data.get(), size}; }
};

Scratch workspace(std::size_t bytes, Job const& job) {
  std::string const what = "the workspace of policy " + std::string(job.policy.name) + " over " + job.context();
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

int cmd_score(Options const& o) {
  if (!o.has("--policy") || !o.has("--keys") || !o.has("--out"))
    fail(exit_usage, "score needs --policy, --keys and --out");
  Job job(find_policy(o.get("--policy")));
  check_job(o, false, job);
  if (job.policy.reads_values && !o.has("--values") && job.params.at("use_vnorm") != "false")
    fail(exit_usage, std::string("policy ") + job.policy.name +
                         " weights scores by the value norms: pass --values V.npy (or --param use_vnorm=false)");
  check_outputs(o, {o.get("--out")}, "--out");
  load_job(o, job);
  kvc::KVExtents const e = extents_of(job.keys);
  kvc::Index const threads = thread_count(o);
  kvc::ThreadPool pool(threads);
  kvc::Cpu const cpu = threads > 1 ? pool.cpu() : kvc::Cpu{};
  std::vector<float> scores = buffer<float>(static_cast<std::size_t>(e.rows()), "the scores of " + job.context());
  job.run([&](auto const& scorer, Selection, auto const& cache, auto const& obs) {
    Scratch const ws = workspace(kvc::score_workspace_bytes(cpu, scorer, e, obs), job);
    kvc::ScoreSpan<> out{scores.data(), e.batch, e.heads, e.tokens};
    auto once = [&] { check_status(kvc::score(cpu, scorer, cache, obs, out, ws.span()), job.context()); };
    once();
    if (o.time)
      print_time("score", job.policy, {median_seconds(timing_repeats, once), -1, ws.size, threads}, job.bytes_read());
  });
  write_outputs({{o.get("--out"), kvc::NpyDtype::f32, {e.batch, e.heads, e.tokens}, scores.data()}});
  return 0;
}

/// The files compress writes into --out-dir.
constexpr char const* compress_outputs[] = {"keys.npy", "values.npy", "indices.npy", "counts.npy"};

int cmd_compress(Options const& o) {
  if (!o.has("--policy") || !o.has("--keys") || !o.has("--values") || !o.has("--out-dir"))
    fail(exit_usage, "compress needs --policy, --keys, --values and --out-dir");
  if (o.has("--ratio") == o.has("--budget"))
    fail(exit_usage, "compress needs exactly one of --ratio and --budget");
  Job job(find_policy(o.get("--policy")));
  check_job(o, true, job);
  std::optional<double> const ratio = o.has("--ratio") ? std::optional(parse_ratio(o.get("--ratio"))) : std::nullopt;
  kvc::Index const budget = o.has("--budget") ? parse_count(o.get("--budget"), "--budget") : 0;
  std::string const out_dir = o.get("--out-dir");
  struct stat st {};
  if (::stat(out_dir.c_str(), &st) == 0 && !S_ISDIR(st.st_mode))
    fail(exit_invalid, "--out-dir " + out_dir + " exists and is not a directory");
  std::vector<std::string> outputs;
  for (char const* name : compress_outputs)
    outputs.push_back(out_dir + "/" + name);
  check_outputs(o, outputs, "output file");
  load_job(o, job);
  Input const& keys = job.keys;
  Input const& values = *job.values;
  kvc::KVExtents const e = extents_of(keys);
  auto const rows = static_cast<std::size_t>(e.rows()), heads = static_cast<std::size_t>(e.batch * e.heads);
  std::vector<kvc::Index> index = buffer<kvc::Index>(rows, "the keep plan of " + job.context());
  std::vector<kvc::Index> count = buffer<kvc::Index>(heads, "the keep plan of " + job.context());
  kvc::KeepPlan<> plan{index.data(), count.data(), e.batch, e.heads, e.tokens};
  kvc::Index const threads = thread_count(o);
  kvc::ThreadPool pool(threads);
  kvc::Cpu const cpu = threads > 1 ? pool.cpu() : kvc::Cpu{};
  std::vector<float> scores = buffer<float>(rows, "the scores of " + job.context());

  // kvc::compress is kvc::score then kvc::select; they are called one by one so that --time reports each.
  job.run([&](auto const& scorer, Selection sel, auto const& cache, auto const& obs) {
    auto run = [&](auto budget_value) {
      kvc::Index const keep = budget_value.keep(0, 0, e.tokens);  // H2O's recent window is a share of it
      kvc::TopKSelector<decltype(budget_value)> const selector{budget_value, sel.n_sink, sel.recent(keep)};
      Scratch const score_ws = workspace(kvc::score_workspace_bytes(cpu, scorer, e, obs), job);
      Scratch const select_ws = workspace(kvc::select_workspace_bytes(cpu, selector, e.batch, e.heads, e.tokens), job);
      kvc::ScoreSpan<> span{scores.data(), e.batch, e.heads, e.tokens, cache.lengths};
      auto score_once = [&] {
        check_status(kvc::score(cpu, scorer, cache, obs, span, score_ws.span()), job.context());
      };
      auto select_once = [&] { check_status(kvc::select(cpu, selector, span, plan, select_ws.span()), job.context()); };
      score_once();
      select_once();
      if (o.time)
        print_time("compress", job.policy,
                   {median_seconds(timing_repeats, score_once), median_seconds(timing_repeats, select_once),
                    score_ws.size + select_ws.size, threads},
                   job.bytes_read());
    };
    if (ratio)
      run(kvc::RatioBudget{*ratio});
    else
      run(kvc::FixedBudget{budget});
    check_status(kvc::compact(cpu, plan, cache), "compact");
  });
  kvc::Index kept_max = 0;
  for (kvc::Index c : count)
    kept_max = std::max(kept_max, c);

  // Repack [B, H, kept_max, d]: compaction left each head's kept rows in its first slots. Every size is at most the
  // input's (kept_max <= tokens).
  // bfloat16 (from .safetensors) is written as float32, exactly: .npy has no bfloat16.
  auto repack = [&](Input const& in) {
    kvc::Index const d = in.array.shape[3], item = in.array.itemsize();
    bool const widen = in.array.elem == Elem::bf16;
    kvc::Index const out_item = widen ? 4 : item;
    std::vector<std::byte> out = buffer<std::byte>(heads * static_cast<std::size_t>(kept_max * d * out_item),
                                                   "the compressed copy of " + in.path);
    for (kvc::Index bh = 0; bh < e.batch * e.heads; ++bh) {
      kvc::Index const n = count[static_cast<std::size_t>(bh)] * d;
      if (widen) {
        kvc::bfloat16 const* src = in.array.as<kvc::bfloat16>() + bh * e.tokens * d;
        for (kvc::Index i = 0; i < n; ++i) {
          float const x = kvc::to_float(src[i]);
          std::memcpy(out.data() + (bh * kept_max * d + i) * 4, &x, 4);
        }
      } else {
        std::copy_n(in.array.data.data() + bh * e.tokens * d * item, n * item, out.data() + bh * kept_max * d * item);
      }
    }
    return out;
  };
  auto npy_dtype = [](Input const& in) { return in.array.elem == Elem::f16 ? kvc::NpyDtype::f16 : kvc::NpyDtype::f32; };
  std::vector<kvc::Index> kept_index =
      buffer<kvc::Index>(heads * static_cast<std::size_t>(kept_max), "the kept indices of " + job.context(), -1);
  for (kvc::Index bh = 0; bh < e.batch * e.heads; ++bh)
    std::copy_n(index.data() + bh * e.tokens, count[static_cast<std::size_t>(bh)], kept_index.data() + bh * kept_max);
  auto const k_out = repack(keys), v_out = repack(values);

  std::vector<std::string> made;  // the folders this call creates, removed again if the outputs cannot be written
  std::string const dir = out_dir + "/";
  try {
    make_folders(out_dir, made);
    write_outputs({{dir + compress_outputs[0], npy_dtype(keys), {e.batch, e.heads, kept_max, e.dim}, k_out.data()},
                   {dir + compress_outputs[1],
                    npy_dtype(values),
                    {e.batch, e.heads, kept_max, values.array.shape[3]},
                    v_out.data()},
                   {dir + compress_outputs[2], kvc::NpyDtype::i64, {e.batch, e.heads, kept_max}, kept_index.data()},
                   {dir + compress_outputs[3], kvc::NpyDtype::i64, {e.batch, e.heads}, count.data()}});
  } catch (Failure const&) {
    for (auto folder = made.rbegin(); folder != made.rend(); ++folder)  // deepest first; each is empty
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
    return s;
  };
  std::size_t width = 0;
  for (auto const& policy : policies())
    for (auto const& p : policy.params)
      width = std::max(width, param_text(p).size());
  for (auto const& policy : policies()) {
    char const* reads = policy.reads_queries ? "keys and --queries" : (policy.reads_keys ? "keys" : "no tensor data");
    std::fprintf(io.out, "%s  (reads %s)\n    %s\n", policy.name, reads, policy.summary);
    for (auto const& p : policy.params)
      std::fprintf(io.out, "    %-*s  %s\n", static_cast<int>(width), param_text(p).c_str(), p.help);
  }
  std::fprintf(
      io.out,
      "n_sink and n_recent protect tokens in compress's top-k selection; `kvc score` rejects them.\n"
      "budgets (compress): --ratio R (fraction removed, kept = floor(N*(1-R))) or --budget N (tokens per head)\n");
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
      if (o.command)
        print_help(*o.command);
      else
        std::fputs(overview_text, io.out);
      return 0;
    }
    std::string_view const name = o.command->name;
    if (name == "score")
      return cmd_score(o);
    if (name == "compress")
      return cmd_compress(o);
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
