// SPDX-License-Identifier: Apache-2.0
// tools/kvc/internal.hpp: what the units of the `kvc` tool share (internal to tools/kvc): the output streams (io), the
// memory checks, the inputs (InputSpec, Array, Input, Queries), the output staging (Output, Staged), the timing
// (Timing, Memory), and the jobs score and compress run (Job, Scratch). The templates are defined here; every other
// function once in a unit (inputs.cpp, outputs.cpp, timing.cpp, job.cpp) and declared here. Arrays are C order,
// shapes [batch, heads, tokens, head_dim] unless named; sizes are in bytes; every buffer is owned by the struct that
// holds it (views into them are valid while it lives).
#pragma once

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
#include <kvc/pipeline/moment_kv.hpp>
#include <kvc/pipeline/press.hpp>

#include "common/observations.hpp"
#include "common/policies.hpp"
#include "io/file.hpp"
#include "io/npy.hpp"
#include "io/safetensors.hpp"
#include "options.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <limits>
#include <memory>
#include <new>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace kvc::cli {

using namespace kvc::tools;  // the policy table, Failure and the exit codes (tools/common/policies.hpp)

/// Where the tool prints: the standard streams for the program, others for the fuzzer (set by run()).
struct Streams {
  std::FILE* out = stdout;
  std::FILE* err = stderr;
};
extern Streams io;

/// --rope theta=T,style=neox|interleaved (either key may be left out). Malformed text is a usage error.
kvc::RopeSpec parse_rope(std::string const& text);

// ---------------------------------------------------------------------------------------------------------------
// Memory and outputs.

/// The memory this program may take, in bytes: the kernel's estimate of memory available without swapping
/// (MemAvailable), or the physical memory where that is unknown. No buffer may be larger.
std::size_t memory_bytes();

/// `bytes` in GiB, "%.3g GiB", for messages.
std::string bytes_text(double bytes);

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

/// Splits an input argument (see InputSpec).
InputSpec input_spec(std::string const& arg);

/// The options naming input files, in the order they are read.
inline constexpr char const* input_options[] = {"--keys", "--values", "--queries", "--positions", "--indices"};

/// An input file for check_outputs: how messages name it ("--keys", "--dump input") and the argument.
using NamedInput = std::pair<std::string, std::string>;

/// The input files the options name.
std::vector<NamedInput> option_inputs(Options const& o);

/// Checks, before any input is read, that the output paths can be replaced: each is new or a regular file (never a
/// directory or a device such as /dev/null, which renaming would replace), none is one of the inputs, and no two are
/// the same file (same device and inode, whatever the paths: symbolic and hard links included). `what` names the
/// outputs in messages ("--out", "output file").
void check_outputs(std::vector<NamedInput> const& inputs, std::vector<std::string> const& paths,
                   std::string const& what);

/// An array to write as a .npy file.
struct Output {
  std::string path;
  kvc::NpyDtype dtype;
  std::vector<kvc::Index> shape;
  void const* data;
  bool int8 = false;  ///< int8 data ('|i1', RDKV's bit plans): `dtype` is ignored
};

/// Writes every output whole or none: each is staged in a temporary file beside its destination (written, synced
/// and closed, every error checked), and they are renamed into place only once all are whole. A failure removes
/// the temporaries and names the file; the destinations keep what they held. (Links are followed: an existing
/// destination is replaced where its link points.)
struct Staged {
  std::vector<kvc::StagedFile> files;
  std::vector<std::string> paths;  ///< the outputs as named (for messages)
};

/// Stages `outputs` (written, synced and closed) into `staged`, to be committed with the rest by commit_outputs.
void stage_outputs(std::vector<Output> const& outputs, Staged& staged);

/// Renames every staged output into place, or none.
void commit_outputs(Staged& staged);

/// Stages `outputs` and commits them: all written, or none (exit 3 naming the file).
void write_outputs(std::vector<Output> const& outputs);

/// Creates `dir` and any missing parents, one component at a time, and records the folders it made (parents
/// first) so that a failure can remove exactly those.
void make_folders(std::string const& dir, std::vector<std::string>& made);

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

/// Reads the array `arg` names (see InputSpec) into `out`, or fails (exit 3) with `where` (e.g. "keys file K.npy: ")
/// before the reader's message. The file's size bounds every allocation, and no file larger than the memory
/// available is read (a sparse file may claim more than memory).
void read_array(std::string const& arg, std::string const& where, Array& out);

struct Input {
  std::string path;  ///< the argument as given (FILE, or FILE.safetensors:TENSOR), for messages
  Array array;
  float scale = 1.0f;  ///< fp8 tensors: the value of an element is decode(byte) * scale (--k-scale, --v-scale)

  bool fp8() const noexcept { return array.elem == Elem::f8_e4m3 || array.elem == Elem::f8_e5m2; }
};

/// Reads a rank-4 float32/float16 (or, from .safetensors, bfloat16 and with `fp8` F8_E4M3 / F8_E5M2) tensor; `role`
/// names it in messages ("keys file K.npy: ..."). The file's size bounds the array, and every dimension must be >= 1,
/// so that no size derived from the shape (scores, plans, workspaces) exceeds what the file holds.
Input load_tensor(std::string const& path, char const* role, char const* dims, bool fp8 = false);

/// The axes of keys and values, for messages.
inline char const* const kv_dims = "[batch, kv_heads, tokens, head_dim]";

/// The extents of a rank-4 tensor (load_tensor): [batch, heads, tokens, head_dim].
kvc::KVExtents extents_of(Input const& in);

/// `x` in %.3g.
std::string short_number(double x);

/// "beyond the exact range ..." for head dim `dim` (docs/numerics.md, "Range").
std::string range_text(kvc::Index dim);

/// What the keys must satisfy beyond finiteness for a policy's scores to be exact (docs/numerics.md, "Range").
enum class KeyRange : std::uint8_t {
  finite,  ///< KeyDiff (exact for every finite key) and the policies that read no data
  norms,   ///< Knorm: every key's norm below FLT_MAX (past it the fp32 score is -inf and such keys would tie)
  logits,  ///< window scorers: head_dim * x^2 < 2^126, so q.k logits stay finite
};

/// The range `policy` needs: logits for the policies that read queries, norms for Knorm, finite otherwise.
KeyRange key_range(PolicyInfo const& policy);

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
inline constexpr std::size_t max_rope_table_bytes = std::size_t{1} << 30;

/// Loads the queries file `path` (and the positions file `positions_path`, when not empty) for keys of extents `*k`,
/// and fills the RoPE table when they are pre-RoPE. Without keys (`k` null: uncomp_entropy) the queries are checked
/// on their own (finite; no logit range) and the default positions are 0 .. w - 1.
void load_queries(std::string const& path, std::string const& positions_path, kvc::KVExtents const* keys,
                  std::string const& keys_path, bool rotate, kvc::RopeSpec const& spec, Queries& q);

/// Fills the RoPE table of `q` (pre-RoPE queries) over positions [0, max_position].
void fill_query_rope(kvc::RopeSpec const& spec, kvc::Index max_position, Queries& q);

/// Query rows a scorer reads: the last `rows_used` of the `rows` given (SnapKV its window, TOVA the newest row;
/// the statistics of ExpectedAttention and the attention H2O accumulates use every row).
kvc::Index rows_used(kvc::SnapKVScorer const& s, kvc::Index);
kvc::Index rows_used(kvc::TOVAScorer const&, kvc::Index);
kvc::Index rows_used(kvc::UNCompScorer<> const& s, kvc::Index);
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
                     std::string const& keys_path);

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

/// The median wall time of `repeats` calls of fn, in seconds.
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

/// The calls --time takes the median of.
inline constexpr int timing_repeats = 7;

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
void print_json_line(nlohmann::ordered_json const& j);

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
                std::optional<std::pair<char const*, kvc::Index>> layer, Timing const& t);

/// --threads N (default 1): the worker threads of kvc::ThreadPool the kernels spread (sequence, head) items over.
kvc::Index thread_count(Options const& o);

/// --k-scale / --v-scale S: the fp32 scale of fp8 keys / values (vLLM's k_scale, v_scale: an element's value is
/// decode(byte) * S); finite and > 0. Absent: 1 for fp8 tensors.
std::optional<float> scale_option(Options const& o, char const* name);

/// Gives `in` the scale of option `name`, which only an fp8 tensor takes.
void set_scale(Input& in, std::optional<float> scale, char const* name, char const* role);

/// Fails (exit 3) with "`context`: message" unless `st` is ok.
void check_status(kvc::Status st, std::string const& context);

/// The input files of one job: the options' files, or one layer of a --dump folder (empty: not given).
struct JobFiles {
  std::string keys, values, queries, positions;
};

/// --keys, --values, --queries and --positions as given.
JobFiles option_files(Options const& o);

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
void check_job(Options const& o, bool compress, Job& job);

/// Reads the keys, the values and the queries.
void load_job(JobFiles const& files, Job& job);

/// A kernel's workspace: uninitialised (kernels write before they read, so untouched pages cost nothing), within
/// the memory available, and refused with a message when its size saturated (a product of two inputs' sizes).
struct Scratch {
  std::unique_ptr<std::byte[]> data;
  std::size_t size = 0;
  kvc::Workspace span() const { return {data.get(), size}; }
};

/// `bytes` of workspace for `what` (named in the error).
Scratch workspace(std::size_t bytes, std::string const& what);

/// The workspace of the job's policy over its files.
Scratch workspace(std::size_t bytes, Job const& job);

// ---------------------------------------------------------------------------------------------------------------
// MomentKV (tools/common/moment_kv.hpp): its score before any eviction, its prefill compression with the moments of
// the evicted sets, and the moments' files (written by compress, read by attend).

/// Whether `policy` is moment_kv / uncomp (each with a score and a compression path of its own).
bool is_moment_kv(PolicyInfo const& policy);
bool is_uncomp(PolicyInfo const& policy);

/// gqa=expand: the keys or values [B, Hkv, N, d] repeated to [B, Hq, N, d] (query head q reads KV head q / (Hq / Hkv)),
/// the authors' per-query-head caches.
void expand_heads(Input& in, kvc::Index hq);

/// The files of the moments, in --out-dir (compress) or --moments (attend).
inline constexpr char const* moment_outputs[] = {"moment_count.npy", "moment_key_mean.npy", "moment_value_mean.npy",
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

// ---------------------------------------------------------------------------------------------------------------
// The commands (score.cpp, compress.cpp, attend.cpp, policies.cpp): each returns the exit code (0) or throws
// Failure.

/// `kvc score`: one policy's scores of --keys (or uncomp_entropy's per-head entropies of --queries) into --out.
int cmd_score(Options const& o);
/// `kvc compress`: one job per input (the options' files, or each layer of a --dump folder) into --out-dir.
int cmd_compress(Options const& o);
/// `kvc attend`: attention of --queries over a (compressed) cache, plain and corrected by --moments.
int cmd_attend(Options const& o);
/// `kvc policies`: the policy table and the allocators, with their parameters.
int cmd_policies();

}  // namespace kvc::cli
