// SPDX-License-Identifier: Apache-2.0
// tests/backend/cuda/cuda_kernels.hpp: host-callable wrappers around kvc's CUDA kernels for the parity tests.
// The wrappers live in cuda_kernels.cu (nvcc, no Eigen, no Catch); the tests in parity_test.cpp (host compiler).
// Every wrapper mirrors a host description of a case onto the device, runs one entry point, copies the results
// back and returns "" or an error message.
#pragma once

#include <kvc/attention/corrected.hpp>
#include <kvc/core/backend.hpp>
#include <kvc/core/extents.hpp>
#include <kvc/core/rope.hpp>
#include <kvc/core/workspace.hpp>
#include <kvc/pipeline/decode.hpp>
#include <kvc/pipeline/query_statistics.hpp>
#include <kvc/scorers/expected_attention.hpp>
#include <kvc/scorers/moment_kv.hpp>
#include <kvc/scorers/uncomp.hpp>
#include <kvc/selectors/top_k.hpp>
#include <kvc/store/ragged.hpp>

#include "support/compressor_scenario.hpp"

#include <string>
#include <vector>

namespace kvc::test::cuda {

enum class Dtype { f32, f16, bf16 };
/// Where the device copy of a case's K and V rows lives: dense BHTD or BTHD; paged (pages of 16 rows, NHD, a padded
/// block table of reversed page ids); paged_hnd (the same table, pages [heads, 16, d]); paged_csr (NHD pages found
/// through CSR lists, each sequence listing only the pages its longest head's length reaches, in reversed order);
/// head_paged (HeadPagedLayout: one list per head, pages of the largest size <= 16 that divides the tokens, the
/// heads' pages interleaved in the pool); ragged (RaggedLayout: head i's segment holds its length plus i % 3 slots,
/// head 0's all the tokens). Positions of the per-head paged and ragged layouts are stored per row (their slots).
enum class Layout { bhtd, bthd, paged, paged_hnd, paged_csr, head_paged, ragged };

/// A cache (and window queries) described on the host in fp32; the device side narrows K, V and queries to `dtype`
/// with the library's round-to-nearest-even, exactly as a host HostCache<T> built from the same floats.
struct Case {
  KVExtents e;
  Index dim_v = 0;
  std::vector<float> k, v;     ///< BHTD [B, H, N, d] and [B, H, N, dim_v]
  std::vector<Index> lengths;  ///< empty, [B] or [B * H] (per_head)
  bool per_head = false;
  std::vector<Index> positions;  ///< empty or [B, H, N]
  Layout layout = Layout::bhtd;
  Dtype dtype = Dtype::f32;
  std::vector<float> queries;  ///< [B, Hq, w, d] window (or attention) queries
  KVExtents q_ext{};
  bool pre_rope = false;  ///< rotate queries with a table (theta 10000, `rope_style`) covering 4096 positions
  RopeStyle rope_style = RopeStyle::neox;
  std::vector<Index> query_positions;  ///< empty, or the window queries' positions [B, w]
  std::vector<Index> room;             ///< paged_csr and ragged: the lengths (shaped as `lengths`) their tables are
                                       ///< sized for, when not `lengths` (empty)
};

/// The RoPE spec of the parity tests' tables (theta 10000, 4096 positions; `rotary_dim` 0 = the whole head dim).
inline RopeSpec test_rope_spec(RopeStyle style, Index rotary_dim = 0) {
  RopeSpec spec;
  spec.style = style;
  spec.rotary_dim = rotary_dim;
  return spec;
}
inline constexpr Index test_rope_positions = 4096;

/// Whether a CUDA device is present (the tests skip with "SKIPPED: no CUDA device" otherwise).
bool device_available();

/// Scores with the named policy: key_diff, key_diff_raw (the raw-mean anchor), knorm, streaming_llm, random,
/// snap_kv, snap_kv_kvpress, snap_kv_chunk (chunk_mean pooling, kernel 4), snap_kv_chunk_kvpress (kernel 6), tova,
/// tova_kvpress (window policies read Case::queries with window_size = q_ext.tokens),
/// observed_attention (ObservedAttentionScorer over every row of Case::queries, query_tile 7: several tiles, the
/// last one short) and observed_attention_one_tile (query_tile 256).
std::string scores(std::string const& policy, Case const& c, std::vector<float>& out);

/// The same scores over the case's K and V stored as fp8 (`format`: e4m3 or e5m2) under per-(sequence, KV head)
/// scales `k_scales`, `v_scales` ([B, Hkv]): kvc::store of each value. The case must be BHTD and fp32.
std::string fp8_scores(std::string const& policy, Case const& c, CacheFormat format, std::vector<float> const& k_scales,
                       std::vector<float> const& v_scales, std::vector<float>& out);

/// kvc::query_statistics on the device: rows [B, Hq, R, d] (fp32, narrowed to `dtype`; token-major [B, R, Hq, d]
/// in device memory when `token_major`), positions [B, R] (empty: none); covariance skipped when `covariance` is
/// false. Returns mean [B, Hq, d] and covariance [B, Hq, d, d].
std::string query_statistics(Dtype dtype, KVExtents q_ext, std::vector<float> const& rows, bool token_major,
                             std::vector<Index> const& positions, StatisticsRows const& sel, bool covariance,
                             std::vector<float>& mean, std::vector<float>& cov);

/// ExpectedAttention's inputs besides the cache: statistics (host copies, mirrored to the device), the RoPE table
/// they are averaged with (test_rope_spec(style, rotary_dim) over test_rope_positions rows, or none), t0 sources.
struct EAInputs {
  ExpectedAttentionScorer scorer{};
  Index query_heads = 0;
  std::vector<float> mean, cov;  ///< [B, Hq, d], [B, Hq, d, d] (cov may be empty without use_covariance)
  bool rope = true;
  RopeStyle style = RopeStyle::neox;
  Index rotary_dim = 0;
  std::vector<Index> next_position;  ///< [B] or empty
  Index observed = 0;
};

/// ExpectedAttention scores of the case's cache on the device.
std::string expected_attention(Case const& c, EAInputs const& in, std::vector<float>& out);
/// The same over the case's K and V stored as fp8 under per-(sequence, KV head) scales (as fp8_scores).
std::string fp8_expected_attention(Case const& c, CacheFormat format, std::vector<float> const& k_scales,
                                   std::vector<float> const& v_scales, EAInputs const& in, std::vector<float>& out);

/// One step of an H2O run (see h2o()): append, update, score, evict.
struct H2OStep {
  Case append;                 ///< tokens appended first (append.e.tokens == 0: none), with positions [B, H, m]
  std::vector<float> queries;  ///< window queries [B, Hq, w, d] of the update (post-RoPE unless Case::pre_rope)
  KVExtents q_ext{};
  std::vector<float> columns;  ///< or the engine's column sums [B, column_heads, N] (used when non-empty)
  Index column_heads = 0;
  std::vector<Index> index, count;  ///< the plan applied after scoring (capacity N; empty: no eviction)
};

/// What an H2O step leaves: the accumulator [B, H, N] and tracked [B, H] after the update, the scores, and the
/// cache's lengths after the step.
struct H2OResult {
  std::vector<float> acc;
  std::vector<Index> tracked;
  std::vector<float> scores;
  std::vector<Index> lengths;
};

/// Runs H2OScorer<DeviceSpace> (query_tile `tile`) over `steps` on the device, the accumulator (filled with -5 at
/// the start, tracked 0) moving through kvc::compact with the cache: per step, kvc::append, kvc::update, kvc::score,
/// then kvc::on_evict and kvc::compact with the step's plan.
std::string h2o(Case const& c, Index tile, std::vector<H2OStep> const& steps, std::vector<H2OResult>& results);

/// Attention of Case::queries over the cache (causal by the cache's positions, queries at the context's last).
std::string attend(Case const& c, std::vector<float>& out, std::vector<float>& lse);

/// Runs the CUDA top-k (ratio budget when `ratio` >= 0, else `fixed`) on host scores [batch, heads, tokens].
std::string top_k(double ratio, Index fixed, Index n_sink, Index n_recent, Index batch, Index heads, Index tokens,
                  std::vector<float> const& scores, std::vector<Index> const& lengths, bool per_head, Index capacity,
                  std::vector<Index>& index, std::vector<Index>& count);

/// Top-k with a per-(sequence, head) budget table that lives on the device.
std::string top_k_per_head(std::vector<Index> const& budget, Index batch, Index heads, Index tokens,
                           std::vector<float> const& scores, std::vector<Index>& index, std::vector<Index>& count);

/// AdaKV on the device (FixedBudget{fixed}, or RatioBudget{ratio} when ratio >= 0): kvc::allocate's per-head totals
/// `table` [batch, heads] and kvc::select's plan (capacity `tokens`). `lengths` empty or per head.
struct AdaKVCase {
  double ratio = -1.0;
  Index fixed = 0;
  double alpha = 0.2;
  bool kvpress = false;
  Index n_sink = 0, n_recent = 0;
  Index batch = 0, heads = 0, tokens = 0;
  std::vector<float> scores;
  std::vector<Index> lengths;
};
std::string ada_kv(AdaKVCase const& c, std::vector<Index>& table, std::vector<Index>& index, std::vector<Index>& count);

/// UNComp's parameters for uncomp(): the scorer's window and pooling, the layer's per-head budgets [heads].
struct UNCompParams {
  Index window = 8;
  Index kernel = 7;
  Pooling pooling = Pooling::max;
  std::vector<Index> budgets;
};

/// One step of an UNComp run (see uncomp()): append, update, score, select, evict.
struct UNCompStep {
  Case append;                 ///< tokens appended first (append.e.tokens == 0: none), with positions [B, H, m]
  std::vector<float> queries;  ///< the update's window queries [B, Hq, R, d] (empty: no update this step)
  KVExtents q_ext{};
  std::vector<float> cpu_scores;    ///< the CPU's scores of this step [B, H, N], also selected on the device
  std::vector<Index> index, count;  ///< the CPU's plan (capacity N; empty: no eviction), applied to the device state
};

/// What an UNComp step leaves on the device.
struct UNCompResult {
  std::vector<float> rows;                  ///< window_rows [B, H, N, w] after the update
  std::vector<Index> tracked;               ///< tracked [B, H] after the update
  std::vector<float> scores;                ///< kvc::score
  std::vector<Index> table;                 ///< kvc::allocate (UNCompSelector) over the device's scores
  std::vector<Index> index, count;          ///< kvc::select (UNCompSelector) over the device's scores
  std::vector<Index> index_cpu, count_cpu;  ///< kvc::select (UNCompSelector) over the CPU's scores
  std::vector<Index> evicted_tracked;       ///< tracked after kvc::on_evict with the CPU's plan
  std::vector<Index> lengths;               ///< the cache's lengths after the step
};

/// Runs UNCompScorer<DeviceSpace> over `steps` on the device, window_rows (filled with 9 at the start, tracked 0)
/// moving through kvc::compact with the cache: per step, kvc::append, kvc::update (when the step has queries; they
/// are post-RoPE unless Case::pre_rope), kvc::score; then, when the step has a plan, kvc::allocate and kvc::select
/// with UNCompSelector<DeviceSpace>{budgets on the device, 0, w} over the device's and over the CPU's scores, and
/// kvc::on_evict and kvc::compact with the CPU's plan (so the device state follows the CPU's exactly).
std::string uncomp(Case const& c, UNCompParams const& p, std::vector<UNCompStep> const& steps,
                   std::vector<UNCompResult>& results);

/// UNCompSelector<DeviceSpace>{budgets [heads], 0, n_recent} on host scores [batch, heads, tokens] with per-head
/// lengths: kvc::allocate's table and kvc::select's plan (capacity `tokens`).
std::string uncomp_select(std::vector<Index> const& budgets, Index n_recent, Index batch, Index heads, Index tokens,
                          std::vector<float> const& scores, std::vector<Index> const& lengths,
                          std::vector<Index>& table, std::vector<Index>& index, std::vector<Index>& count);

/// A ragged store on the device: the case's rows kept by the plan (capacity `capacity`) gathered into a store with
/// `reserve` free slots per head, then `extra`'s tokens appended (extra: same batch, heads and dims, with
/// positions), then Case::queries (post-RoPE, at the context's last positions) attended. Returns the store's flat
/// rows (fp32) and positions, its lengths, and the attention output and LSE.
struct RaggedResult {
  std::vector<Index> offsets, lengths, positions;
  std::vector<float> k, v, out, lse;
};
std::string ragged(Case const& c, std::vector<Index> const& index, std::vector<Index> const& count, Index capacity,
                   Index reserve, Case const& extra, RaggedResult& result);

/// Compacts the cache in place with a host plan; returns K, V (as fp32), positions and lengths after compaction.
std::string compact(Case& c, std::vector<Index> const& index, std::vector<Index> const& count, Index capacity);

/// Gathers the kept rows into a new dense cache of `capacity` slots with a per-head length table and positions.
std::string gather(Case const& c, std::vector<Index> const& index, std::vector<Index> const& count, Index capacity,
                   Case& out);

/// Appends tokens [begin, begin + count) of `src` after `dst`'s lengths; dst is returned updated.
std::string append(Case& dst, Case const& src, Index begin, Index count);

/// KeyDiff's block-wise protocol on the device (kvc::blockwise_compress with FixedBudget{budget}); returns the
/// working cache's per-head lengths and positions [B, H, capacity].
std::string blockwise_key_diff(Case const& src, Index budget, Index block, std::vector<Index>& lengths,
                               std::vector<Index>& positions);

/// Compacts the cache in place with a host plan and one TokenRows extra: `rows` [B, H, N, d_v] fp32 moves with the
/// slots (empty: a TokenRows with null data, which compaction skips). K, V, positions, lengths and rows come back.
std::string compact_rows(Case& c, std::vector<Index> const& index, std::vector<Index> const& count, Index capacity,
                         std::vector<float>& rows);

/// MomentKV's moments [B, H] on the host in fp32, with values representable in `dtype` (the device's storage type,
/// so narrowing them is exact). `comoment` is [B, H, d_v, d_k].
struct Moments {
  Dtype dtype = Dtype::f32;
  std::vector<Index> count;
  std::vector<float> key_mean, value_mean, comoment;
};

/// MomentKV's u_j cache on the host: rows [B, H, N, d_v] (empty: disabled), tracked and age [B, H].
struct Residuals {
  std::vector<float> rows;
  std::vector<Index> tracked, age;
  Index refresh = 64;
};

/// MomentKVScorer on the device with the parameters of `params` (base, scale, clamp, rounds; its state and
/// residuals are ignored), the moments `m` and the u_j cache `r`: scores of the case's cache, with Case::queries as
/// the window queries (post-RoPE). `fixed_base` [B, H, N] (empty: none) replaces the window attention.
std::string moment_scores(Case const& c, MomentKVScorer<> const& params, Moments const& m, Residuals const& r,
                          std::vector<float> const& fixed_base, std::vector<float>& out);

/// kvc::update of MomentKVScorer on the device (fills the u_j rows); `r` comes back updated.
std::string moment_update(Case const& c, MomentKVScorer<> const& params, Moments const& m, Residuals& r);

/// kvc::on_evict of MomentKVScorer on the device with a host plan (capacity `capacity`); `m` and `r` come back.
std::string moment_evict(Case const& c, MomentKVScorer<> const& params, Moments& m, Residuals& r,
                         std::vector<Index> const& index, std::vector<Index> const& count, Index capacity);

/// kvc::attend_corrected of Case::queries over the cache (causal, queries at the context's last) with moments `m`.
std::string attend_corrected(Case const& c, CorrectedAttention const& op, Moments const& m, std::vector<float>& out,
                             std::vector<float>& lse);

/// kvc::moment_kv_prefill on the device with TopKSelector{FixedBudget{budget}, n_sink, n_recent} and Case::queries as
/// the window queries; the case (K, V, positions, per-head lengths) and the moments come back.
std::string moment_kv_prefill(Case& c, MomentKVScorer<> const& params, Moments& m, Index budget, Index n_sink,
                              Index n_recent);

/// While alive, every wrapper above runs its entry points with kvc::Cuda{stream} on a stream of its own (made with
/// cudaStreamCreate, destroyed with the scope) instead of the legacy default stream. The wrappers' own copies stay
/// synchronous (cudaMemcpy) and finish() synchronises the device, so results are read as before. Scopes nest.
class StreamScope {
 public:
  StreamScope();
  ~StreamScope();
  StreamScope(StreamScope const&) = delete;
  StreamScope& operator=(StreamScope const&) = delete;
  bool ok() const { return ok_; }  ///< the stream was created

 private:
  void* previous_ = nullptr;
  bool ok_ = false;
};

/// Host-side operations the CUDA emulator counted (kvc::emu::counters(), see tools/cuda_emulator/include/
/// cuda_runtime.h) since reset_op_counts(). `available` is false outside the emulator: a real GPU has no such
/// counters, and the tests skip the assertions that read them.
struct OpCounts {
  bool available = false;
  long launches = 0;
  long synchronizations = 0;
  long allocations = 0;
  long default_stream_ops = 0;
  long other_stream_ops = 0;
};
void reset_op_counts();
OpCounts op_counts();

/// A run of kvc::decode_step on the device (see decode()): the buffer's pre-RoPE query rows, and the scorer.
struct DecodeRun {
  /// knorm, snap_kv (window 4, kernel 3), tova, expected_attention, h2o (query tile 5), moment_kv
  /// (MomentKVScorer::decode(), no u_j cache), uncomp (UNCompSelector over `budgets`, window 4, kernel 3)
  std::string policy;
  DecodeSchedule schedule{};
  KVExtents q_ext{};                   ///< the buffer [B, Hq, capacity, d]
  std::vector<float> queries;          ///< [B, Hq, capacity, d] pre-RoPE (rotated with the case's RoPE table)
  std::vector<Index> query_positions;  ///< [B, capacity]
  Index buffered = 0;                  ///< rows in the buffer before the first step (count; none fresh)
  Index steps = 0;                     ///< decode steps; each pushes the next row first
  std::vector<Index> budgets;          ///< UNComp's per-head budgets [Hkv]
};

/// What a decode run leaves: per step, whether it compressed and what the emulator counted during the
/// kvc::decode_step call alone (reset right before it, read right after, before any copy back); then the cache
/// (BHTD K and V, positions, lengths) and the scorer's state.
struct DecodeResult {
  std::vector<int> compressed;
  std::vector<OpCounts> counts;
  Case cache;
  std::vector<float> state;     ///< H2O's accumulator [B, H, N] or UNComp's window rows [B, H, N, 4] (else empty)
  std::vector<Index> tracked;   ///< H2O's or UNComp's tracked counts [B, H], or MomentKV's moment counts
  std::vector<float> key_mean;  ///< MomentKV's key means [B, H, d]
};

/// Runs `run.steps` decode steps of the case's cache (per-head lengths, positions, Case::pre_rope for the RoPE
/// table) on the device, inside a StreamScope when `on_stream`; no appends (the engine's, outside decode_step).
std::string decode(Case const& c, DecodeRun const& run, bool on_stream, DecodeResult& out);

/// Instantiates kvc::decode_step on the CUDA backend for every scorer with CUDA kernels (a compile-time check; not
/// meant to be called with real data).
void decode_driver_builds_for_cuda(Cuda const& cuda, Workspace ws);

/// The layer compressor's session (tests/support/compressor_scenario.hpp) on the device with the named policy
/// (scenario_policies), every call through kvc::LayerCompressor<Press, Cuda> on the wrappers' stream. `format`: the
/// scenario's cache format; `dequantised`: for an fp8 format, run on the float cache of the values it reads back;
/// `graphs`: decode steps captured into CUDA graphs and replayed (Scenario::graphs).
std::string compressor_scenario(std::string const& policy, ScenarioResult& out, CacheFormat format = CacheFormat::fp32,
                                bool dequantised = false, bool graphs = false);

}  // namespace kvc::test::cuda
