// SPDX-License-Identifier: Apache-2.0
// tools/eval/engine.hpp: the interface of kvc-eval's engine (a Session per sequence, make_session); its implementation
// is engine_impl.hpp, compiled once per cache element type (engine_instance.cpp, the kvc_eval_lib library).
//
// A small Llama inference engine whose KV cache is a kvc cache, used the way an engine uses kvc: keys rotated at their
// absolute positions and appended with kvc::append, attention through kvc::attend (causal by the cache's positions,
// GQA), and every policy through the per-layer compressor (kvc::LayerCompressor, engine/layer_compressor.hpp): one per
// layer, planned for the layer's stores, its state owned by the engine, the last forward call's pre-RoPE queries handed
// to it with their positions (rotated by a RopeTable built by kvc::fill_rope_table).
//
// One sequence (batch 1). Storage fp32, fp16, bf16 or fp8 (E4M3, E5M2: per-layer K and V scales, vLLM's k_scale and
// v_scale, set at the layer's first forward call to the amax of its K (V) over the format's largest finite value, and
// fixed from then on: later tokens beyond that amax saturate); layout dense ([Hkv, capacity, d] per layer, the Hugging
// Face cache) or paged (vLLM-style NHD pages of 16 tokens found through a block table whose page order is reversed, so
// that a layout bug cannot hide behind contiguous pages). Activations and attention accumulate in fp32.
//
// After the prompt (compress): each layer's compressor of a kvc::Press{scorer, selection} runs prefill() in place on
// the engine's cache (score, select, compact; MomentKV's rounds; UNComp's state and budgets). With an allocator
// (AdaKV, PyramidKV: heads or layers keep different counts), and for UNComp, the layer then moves into a ragged
// per-head store (kvc::ragged_cache, store/ragged.hpp) of count + reserve rows per head, and from then on that
// layer's appends, attention and decode-time compressions (in place) run on the store. A head whose segment would
// overflow re-lays the whole store out with a fresh reserve (kvc::append into a new store), as the AdaKV authors do,
// once per reserve tokens.
//
// While decoding (begin_decode): every layer keeps its compressor (options.decode with the schedule), and after each
// forward call its decode() runs on the layer's store with that call's query; each layer's attention goes through the
// compressor's attend(). The same calls for every policy: kvpress's DecodingPress schedule, H2O's accumulator (its
// prefill() only starts the state), MomentKV's Algorithm 1 (one eviction per token, each head back to its budget;
// attention corrected by its growing moments), UNComp's per-token eviction to its budgets.
//
// MomentKV (`moment_kv` rows, eval/moment_kv.hpp) keeps a copy of each layer's moments after prefill
// (tools::HostMoments: their bytes, and the corrected attention, correction=true, of a compressed prompt).
//
// RDKV and KIVI (`rdkv` and `kivi` rows, tools/common/rdkv.hpp) pack each layer once after the prompt through the
// per-layer compressor of a kvc::RDKVPress (token weights from RDKVTokenScorer or a policy's scorer, ThinK channel
// weights, kvc::allocate_bits at the row's budget) or a kvc::KIVIPress, its state (the packed store) owned by the
// layer. The engine's own cache then holds only the fp16 tail (zone C): the newest `residual` tokens (compacted to
// the front); tokens appended later (the continuation, decode steps) land there at positions continuing from the
// prompt. Attention over such a layer is the compressor's attend(): the packed store and the tail, merged through
// their log-sum-exps.
#pragma once

#include <kvc/core/element.hpp>
#include <kvc/pipeline/decode.hpp>

#include "common/policies.hpp"
#include "common/uncomp.hpp"
#include "eval/model.hpp"

#include <Eigen/Core>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace kvc::eval {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

enum class CacheType : std::uint8_t { f32, f16, bf16, f8_e4m3, f8_e5m2 };
enum class CacheLayout : std::uint8_t { dense, paged };

struct CacheOptions {
  CacheType type = CacheType::f16;
  CacheLayout layout = CacheLayout::dense;
  Index page_size = 16;  ///< tokens per page (paged layout)
};

char const* cache_type_name(CacheType t) noexcept;

/// One layer's projections of the tokens of a forward call, head-major as a Hugging Face dump: keys and values
/// [Hkv, n, d] (keys post-RoPE), queries [Hq, n, d] post-RoPE and pre-RoPE, fp32.
struct LayerProjections {
  std::vector<float> keys, values, queries, queries_prerope;
};

/// What a forward pass can record besides the logits: per layer, the attention output (before o_proj) of every
/// token of the call, [n, Hq * d] fp32, and, when `projections` is set, the layer's K, V and Q.
struct ForwardTrace {
  std::vector<RowMatrix> attention;  ///< [layers] of [n, Hq * d]
  bool projections = false;
  std::vector<LayerProjections> qkv;  ///< [layers], filled when `projections`
};

/// What a session's caches hold, measured from their stores with kvc::store_report, summed over layers.
struct StoreBytes {
  std::size_t kv = 0;    ///< K + V bytes of the valid tokens (positions not counted); packed layers (rdkv, kivi):
                         ///< ceil((payload + overhead bits) / 8) of the packed store + the fp16 tail's K + V bytes
  std::size_t held = 0;  ///< bytes allocated for K, V and positions (see Session::store_bytes); packed layers: the
                         ///< compressor's state (the packed store reserved for the widest plan: a region of
                         ///< kvc::packed_head_bytes_bound per head) + the tail's store
  Index min_count = 0;   ///< fewest valid tokens of one (layer, KV head) (packed layers: packed + tail)
  Index max_count = 0;   ///< most valid tokens of one (layer, KV head)
  std::int64_t payload_bits = 0;   ///< packed layers: PackedHead::payload_bits (codes and fp16 V / K) + the tail's
                                   ///< K + V bits, all layers
  std::int64_t overhead_bits = 0;  ///< packed layers: PackedHead::overhead_bits (scales, offsets, pads, permutation)
};

/// UNComp's hidden-state pruning during a prefill (spec §2.9, pipeline/layer_stages.hpp): at the first layer of each
/// stage c > 0 the hidden states keep hidden_state_counts' K_c rows (min_tokens: empty = 3/8 of the call's tokens,
/// the code's 1536 of 4096; step 0 = the code's), chosen by select_hidden_states from the attention the previous
/// layer's last `window` queries paid each row, summed over its query heads (the last `window` rows always kept).
/// Kept rows keep their positions (RoPE, the causal mask); later layers never see the dropped tokens.
struct HiddenStatePlan {
  std::vector<Index> stage_of_layer;  ///< [layers] contiguous, non-decreasing, from 0
  Index stages = 1;
  std::optional<Index> min_tokens;
  Index step = 0;
  Index window = 8;
  std::vector<Index> kept;  ///< after the call: the hidden-state rows each layer saw
};

/// The state of one sequence: a KV cache per layer and the next absolute position. Copyable through clone(), so a
/// prefilled cache can be compressed by many policies in turn.
class Session {
 public:
  virtual ~Session() = default;
  virtual std::unique_ptr<Session> clone() const = 0;

  /// Runs `tokens` at the next positions (appending their K and V to every layer) and writes the next-token logits
  /// of each into `logits` [tokens.size(), vocab]. `trace` (optional) receives every layer's attention output.
  virtual Status forward(std::span<std::int32_t const> tokens, RowMatrix& logits, ForwardTrace* trace = nullptr) = 0;

  /// Compresses every layer's cache with a policy of the tool's policy table at `ratio` (fraction of each head's
  /// tokens removed): score + select (kvc::compress) then kvc::compact. Window queries are the last forward call's
  /// queries (the prompt's, after prefill). Adds the wall time spent to `seconds`. `salt` varies the random
  /// baseline: its seed becomes a hash of (seed parameter, salt, layer), so that every layer and every sample draws
  /// its own tokens (kvc::RandomScorer hashes (seed, b, h, t) only, the same draw in every layer otherwise).
  /// With an allocator (`alloc`: ada_kv, pyramid_kv or both; its parameters are in `params`, pyramid_kv's layer
  /// and num_layers are set per layer here), the selection is the allocator's (tools::with_selection) and each
  /// layer's kept tokens are gathered into a ragged per-head store with a reserve of the tokens the session can
  /// still take (capacity - position(): the continuation).
  /// rdkv rows allocate bits at a budget of floor(n (1 - ratio)) fp16-equivalent tokens per (layer, KV head) and
  /// pack the layer (see the file comment); kivi rows ignore `ratio` (their memory is what their bits give).
  virtual Status compress(tools::PolicyInfo const& policy, tools::Params const& params, double ratio, double& seconds,
                          std::uint64_t salt = 0, tools::AllocatorChoice const& alloc = {}) = 0;

  /// Compression while decoding: from now on every forward call ends with kvc::decode_step on every layer (the
  /// decode driver), with a policy of the tool's table and `schedule` (interval, target, query buffer; the
  /// selection's protections come from the policy's parameters: n_sink, n_recent, H2O's recent_share of the
  /// target). A stateful scorer's state starts from the last forward call's queries (the prompt's). Later forward
  /// calls take one token each. A clone does not inherit it. `salt` varies the random baseline as in compress().
  /// With an allocator, every layer moves into a ragged store (reserve: one interval) and each compression runs
  /// the allocator's selection (AdaKVSelector / PyramidKVBudget of the target) in place on it; stateful scorers
  /// (h2o) are refused there (their per-token state does not follow a re-layout). The store is re-laid out when a
  /// head would overflow, and with `relayout_on_compress` also after every compression (freeing the slots the
  /// in-place compaction emptied).
  /// rdkv and kivi allocate once (the paper's static allocation): every layer is packed now, rdkv at a budget of
  /// schedule.target_size fp16-equivalent tokens per head, and the decoded tokens stay in the fp16 tail.
  virtual Status begin_decode(tools::PolicyInfo const& policy, tools::Params const& params,
                              DecodeSchedule const& schedule, std::uint64_t salt = 0,
                              tools::AllocatorChoice const& alloc = {}, bool relayout_on_compress = false) = 0;
  /// Wall time the decode driver spent since begin_decode (all layers), and the compressions it ran (all layers).
  double decode_seconds() const noexcept { return decode_seconds_; }

  /// The bytes the caches hold, measured with kvc::store_report on every layer's store. `held` is what a store
  /// allocates for K, V and positions: a ragged store's segments (counts + reserve, every row allocated); for the
  /// uniform cache, a uniform store sized by the same rule (every head: the longest head + the reserve), since
  /// kvc-eval's own dense or paged buffer is sized for the whole sample and never shrinks.
  virtual StoreBytes store_bytes() const = 0;
  /// Bytes of MomentKV's moments held (every compressed layer's tools::HostMoments; 0 for other policies).
  virtual std::size_t moment_bytes() const = 0;
  /// Layer `layer`'s K and V scales (fp8 caches: set at the layer's first forward call; 1 otherwise).
  virtual std::pair<float, float> kv_scales(std::size_t layer) const = 0;
  /// Bytes of K and V held (valid tokens of every layer and KV head, in the cache's storage type).
  std::size_t kv_bytes() const { return store_bytes().kv; }
  /// From now on a store that fills up is re-sized to its longest head + `reserve` (ragged: re-laid out), and every
  /// store is sized so now (the full cache of a decode run is measured under the same rule as the compressed ones).
  virtual void set_reserve(Index reserve) = 0;
  /// Whether layer l's cache is a ragged per-head store.
  virtual bool ragged(Index layer) const = 0;
  /// Valid tokens of layer l, KV head h.
  virtual Index length(Index layer, Index head) const = 0;
  /// Absolute position of the token in slot `slot` (< length) of layer l, KV head h.
  virtual Index slot_position(Index layer, Index head, Index slot) const = 0;
  /// The next token's absolute position (the tokens seen so far, whatever was evicted).
  Index position() const noexcept { return next_position_; }
  /// UNComp's stage variant: the next forward call of more than one token prunes its hidden states at `plan`'s
  /// stage boundaries (spec §2.9; the logits then have one row per kept token, the last always kept). The plan
  /// applies to that call only; hidden_state_plan() returns it afterwards with the rows each layer saw.
  void set_hidden_state_plan(HiddenStatePlan plan) { stage_plan_ = std::move(plan); }
  std::optional<HiddenStatePlan> const& hidden_state_plan() const noexcept { return last_stage_plan_; }
  /// UNComp's calibration (tools/common/uncomp.hpp), which `uncomp` rows read their head groups from; clones share it.
  void set_calibration(std::shared_ptr<tools::Calibration const> calibration) noexcept {
    calibration_ = std::move(calibration);
  }

 protected:
  Index next_position_ = 0;
  double decode_seconds_ = 0;
  std::shared_ptr<tools::Calibration const> calibration_;
  std::optional<HiddenStatePlan> stage_plan_, last_stage_plan_;
};

/// A session over `model` holding up to `capacity` tokens per head (positions [0, capacity) for RoPE).
std::unique_ptr<Session> make_session(Model const& model, CacheOptions const& options, Index capacity);

// ---------------------------------------------------------------------------------------------------------------
namespace detail {
/// The session of element type T (engine_impl.hpp), explicitly instantiated for each CacheType in its own translation
/// unit (engine_instance.cpp): including this header instantiates nothing.
template <class T>
std::unique_ptr<Session> make_typed(Model const& model, CacheOptions const& options, Index capacity);
}  // namespace detail

}  // namespace kvc::eval
