// SPDX-License-Identifier: Apache-2.0
// tools/kvc/compress.hpp: what the units of `kvc compress` share: the settings of one call, a compressor's memory,
// query rows and timing (the way an engine drives a kvc::LayerCompressor), and each job's results and files:
// compress.cpp (the command: options, --dump, staging), compress_job.cpp (the policy table's policies, the
// allocators, MomentKV and UNComp) and compress_packed.cpp (RDKV and KIVI).
#pragma once

#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/engine/layer_compressor.hpp>
#include <kvc/store/ragged.hpp>

#include "common/rdkv.hpp"
#include "common/uncomp.hpp"
#include "internal.hpp"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace kvc::cli {

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

LastRows last_rows(Job const& job, kvc::Index used);

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

/// The moments a compress job writes, and their memory.
struct MomentFiles {
  kvc::NpyDtype dtype = kvc::NpyDtype::f32;
  std::vector<kvc::Index> count;
  std::vector<std::byte> key_mean, value_mean, comoment;
  kvc::Index bytes = 0, head_bytes = 0;  ///< in the storage dtype (moment_state_bytes, moment_head_bytes)
};

/// The files compress --policy rdkv|kivi writes into --out-dir (or its layer<L>/).
inline constexpr char const* packed_outputs[] = {"v_bits.npy", "k_bits.npy"};

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
PackedCompressed compress_packed(Job& job, CompressSettings const& s, kvc::tools::RDKVConfig const& cfg);

// ---------------------------------------------------------------------------------------------------------------
// compress: one job per input (the options' files, or each layer of a --dump folder).

/// The files compress writes into --out-dir (or --out-dir/layer<L> with --dump); the ragged store's with
/// --allocator.
inline constexpr char const* compress_outputs[] = {"keys.npy", "values.npy", "indices.npy", "counts.npy"};
inline constexpr char const* ragged_outputs[] = {"ragged_keys.npy", "ragged_values.npy", "offsets.npy"};

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

/// One loaded job compressed the way an engine compresses a layer: the policy's kvc::LayerCompressor planned for the
/// job's cache and query rows, bound to a state, reset, then prefill(cache, queries) (score, select, fold the evicted
/// tokens into the scorer's state, compact in place). The cache has a per-head length table (`counts`: each head's
/// kept count after) and a positions table of slot numbers, which compaction carries: each head's first `count`
/// positions are then the indices of its kept tokens. The queries are the last rows the policy reads (rows_used), at
/// their --positions or at N - rows .. N - 1. The ragged store gets each head's kept rows (kvc::append). With --time,
/// each of the 7 repeats compresses the original input again (restored untimed): "seconds" is reset + prefill.
Compressed compress_job(Job& job, CompressSettings const& s);

}  // namespace kvc::cli
