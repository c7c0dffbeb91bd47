// SPDX-License-Identifier: Apache-2.0
// tools/eval/engine_impl.hpp: kvc-eval's engine (engine.hpp) itself: the layers' caches, the forward pass and every
// policy through kvc::LayerCompressor. The class's longest members (the forward pass, UNComp's and MomentKV's
// compressions) are defined in engine_passes.hpp. Included through it by engine_instance.cpp alone, once per cache
// element type.
#pragma once

#include <kvc/backend/cpu/attention/attend.hpp>
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/pipeline/query_statistics.hpp>
#include <kvc/backend/cpu/pipeline/rerotate.hpp>
#include <kvc/backend/cpu/pipeline/state.hpp>
#include <kvc/backend/cpu/scorers/expected_attention.hpp>
#include <kvc/backend/cpu/scorers/h2o.hpp>
#include <kvc/backend/cpu/scorers/random.hpp>
#include <kvc/backend/cpu/scorers/uncomp.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/backend/cpu/selectors/uncomp.hpp>
#include <kvc/core/observations.hpp>
#include <kvc/core/rope.hpp>
#include <kvc/engine/layer_compressor.hpp>
#include <kvc/pipeline/layer_stages.hpp>
#include <kvc/pipeline/press.hpp>
#include <kvc/store/ragged.hpp>

#include "common/ragged_store.hpp"
#include "common/rdkv.hpp"
#include "eval/engine.hpp"
#include "eval/moment_kv.hpp"

#include <chrono>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string_view>
#include <type_traits>
#include <variant>

namespace kvc::eval {

namespace detail {

/// x * w / sqrt(mean(x^2) + eps), row by row (the Llama RMSNorm, in fp32 as Hugging Face computes it).
inline void rms_norm(RowMatrix const& x, RowVectorMap w, double eps, RowMatrix& out) {
  out.resize(x.rows(), x.cols());
  for (Index r = 0; r < x.rows(); ++r) {
    float const mean_square = x.row(r).squaredNorm() / static_cast<float>(x.cols());
    float const inv = 1.0f / std::sqrt(mean_square + static_cast<float>(eps));
    out.row(r) = (x.row(r) * inv).cwiseProduct(w);
  }
}

template <class T, bool Paged>
class Engine final : public Session {
 public:
  Engine(Model const& model, CacheOptions const& options, Index capacity) : model_(&model), options_(options) {
    ModelConfig const& c = model.config;
    Index const page = options.page_size;
    capacity_ = Paged ? (capacity + page - 1) / page * page : capacity;
    ext_ = {1, c.kv_heads, capacity_, c.head_dim};
    layers_.resize(static_cast<std::size_t>(c.layers));
    for (Layer& l : layers_) {
      l.k.resize(static_cast<std::size_t>(ext_.rows() * ext_.dim));
      l.v.resize(l.k.size());
      l.lengths.assign(static_cast<std::size_t>(c.kv_heads), 0);
      l.positions.assign(static_cast<std::size_t>(ext_.rows()), 0);
      l.held = capacity_;
    }
    if constexpr (Paged) {
      Index const pages = capacity_ / page;
      block_table_.resize(static_cast<std::size_t>(pages));
      for (Index p = 0; p < pages; ++p)
        block_table_[static_cast<std::size_t>(p)] = static_cast<std::int32_t>(pages - 1 - p);
    }
    static_assert(std::is_same_v<CacheView, decltype(view(std::declval<Layer&>()))>);
    rope_storage_.resize(static_cast<std::size_t>(rope_table_floats(capacity_, c.head_dim)));
    // The config's RoPE was checked when the model loaded; a table that still fails is a bug, not an input error.
    if (!fill_rope_table(c.rope(), c.head_dim, capacity_, rope_storage_.data(), rope_).ok())
      throw std::logic_error("kvc-eval: the model's RoPE does not fill a table");
  }

  // The rope table points into rope_storage_, and the views are rebuilt from members on each call: copies are deep.
  Engine(Engine const& o)
      : Session(o),
        model_(o.model_),
        options_(o.options_),
        capacity_(o.capacity_),
        reserve_(o.reserve_),
        ext_(o.ext_),
        layers_(o.layers_),
        block_table_(o.block_table_),
        rope_storage_(o.rope_storage_),
        rope_(o.rope_) {
    rope_.cos = rope_storage_.data();
    rope_.sin = rope_storage_.data() + (o.rope_.sin - o.rope_.cos);
  }
  Engine& operator=(Engine const&) = delete;

  std::unique_ptr<Session> clone() const override { return std::make_unique<Engine>(*this); }

  Status forward(std::span<std::int32_t const> tokens, RowMatrix& logits, ForwardTrace* trace) override;

  Status begin_decode(tools::PolicyInfo const& policy, tools::Params const& params, DecodeSchedule const& schedule,
                      std::uint64_t salt, tools::AllocatorChoice const& alloc, bool relayout_on_compress) override {
    Status status = schedule.check();
    if (!status.ok())
      return status;
    if (std::string_view(policy.name) == "moment_kv")
      return begin_moment_decode(params, schedule, alloc);
    if (tools::is_packed_policy(policy.name)) {  // one allocation after the prompt; decoded tokens stay fp16
      if (alloc.any())
        return {Errc::invalid_argument, "kvc-eval: rdkv and kivi allocate their own bits (no allocator rows)"};
      reserve_ = capacity_ - next_position_;
      auto const start = std::chrono::steady_clock::now();
      status = compress_packed(policy, params, std::nullopt, schedule.target_size);
      decode_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      return status;
    }
    if (std::string_view(policy.name) == "uncomp")
      return alloc.any() ? Status{Errc::invalid_argument, "kvc-eval: uncomp allocates its own per-head budgets"}
                         : begin_uncomp_decode(params, schedule);
    tools::with_policy(policy, params, [&](auto const& scorer, tools::Selection sel) {
      using S = std::remove_cvref_t<decltype(scorer)>;
      if constexpr (StatefulScorer<S>) {
        if (alloc.any()) {
          status = {Errc::invalid_argument,
                    "kvc-eval: --decode with an allocator does not support stateful scorers (h2o): their per-token "
                    "state would not follow the ragged store's re-layouts"};
          return;
        }
      }
      auto run = std::make_shared<DecodeRun>();
      run->relayout_on_compress = relayout_on_compress;
      RopeTable<> const rope = long_rope(scorer, run->rope_storage);
      // The selection's own sink and recent windows apply (the policy's n_sink, n_recent, H2O's share of the target).
      DecodeSchedule steps = schedule;
      steps.n_sink = steps.n_recent = 0;
      set_reserve(schedule.compression_interval);
      for (std::size_t li = 0; li < layers_.size() && status.ok(); ++li) {
        Layer& layer = layers_[li];
        tools::with_selection(
            alloc, layer_params(params, alloc, li), sel, std::nullopt, schedule.target_size, schedule.target_size,
            [&](auto const& selector) {
              using P = Press<S, std::remove_cvref_t<decltype(selector)>>;
              auto l = std::make_unique<DecodingCompressor<P>>(P{scorer, selector});
              auto& c = l->compressor;
              if constexpr (std::is_same_v<S, RandomScorer>)
                c.policy.scorer.seed = mix_seed(scorer.seed, salt, li);
              c.options.rope = rope;
              c.options.prefill = false;  // the prompt stays; a stateful scorer's state starts
              c.options.decode = true;
              c.options.schedule = steps;
              status = start_compressor(c, l->state, ext_.heads, li);
              if (status.ok())
                status = c.prefill(view(layer), last_queries(layer), {workspace_.data(), workspace_.size()});
              run->layers.push_back(std::move(l));
            });
        if (status.ok() && alloc.any() && !layer.store)  // the allocator's selections run on a ragged store
          status = to_ragged(layer);
      }
      if (status.ok())
        decode_run_ = std::move(run);
    });
    return status;
  }

  Status compress(tools::PolicyInfo const& policy, tools::Params const& params, double ratio, double& seconds,
                  std::uint64_t salt, tools::AllocatorChoice const& alloc) override {
    for (Layer const& layer : layers_)
      if (layer.store)
        return {Errc::invalid_argument, "kvc-eval: this session's cache is already a ragged store"};
    Status status;
    reserve_ = capacity_ - next_position_;  // the tokens still to come: the continuation
    auto const start = std::chrono::steady_clock::now();
    if (tools::is_packed_policy(policy.name)) {
      status = alloc.any() ? Status{Errc::invalid_argument, "kvc-eval: rdkv and kivi allocate their own bits"}
                           : compress_packed(policy, params, ratio, 0);
      seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      return status;
    }
    if (std::string_view(policy.name) == "moment_kv") {
      status = compress_moment_kv(params, ratio, 0, alloc);
      seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      return status;
    }
    if (std::string_view(policy.name) == "uncomp") {
      status = alloc.any() ? Status{Errc::invalid_argument, "kvc-eval: uncomp allocates its own per-head budgets"}
                           : compress_uncomp(params, ratio, 0);
      seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      return status;
    }
    tools::with_policy(policy, params, [&](auto const& scorer, tools::Selection sel) {
      using S = std::remove_cvref_t<decltype(scorer)>;
      std::vector<float> rope_storage;
      RopeTable<> const rope = long_rope(scorer, rope_storage);
      std::vector<std::byte> state;
      for (std::size_t li = 0; li < layers_.size() && status.ok(); ++li) {
        Layer& layer = layers_[li];
        tools::with_selection(
            alloc, layer_params(params, alloc, li), sel, ratio, 0, longest(layer), [&](auto const& selector) {
              LayerCompressor compressor{Cpu{}, Press{scorer, selector}};
              if constexpr (std::is_same_v<S, RandomScorer>)
                compressor.policy.scorer.seed = mix_seed(scorer.seed, salt, li);
              compressor.options.rope = rope;
              status = start_compressor(compressor, state, ext_.heads, li);
              if (status.ok())
                status = compressor.prefill(view(layer), last_queries(layer), {workspace_.data(), workspace_.size()});
            });
        if (status.ok() && alloc.any())  // the kept tokens move into a ragged store: each head its count + reserve
          status = to_ragged(layer);
        else if (status.ok())
          layer.held = longest(layer) + reserve_;
      }
    });
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return status;
  }

  StoreBytes store_bytes() const override {
    StoreBytes s;
    s.min_count = capacity_;
    for (Layer const& l : layers_) {
      StoreReport r;
      std::size_t held = 0;
      if (l.packed) {  // the packed zones: what the store measures of itself (its bits), the state reserved for it
        PackedKVView<> const kv = l.packed->packed();
        std::int64_t payload = 0, overhead = 0;
        for (Index h = 0; h < kv.kv_heads; ++h) {
          payload += kv.head(0, h).payload_bits;
          overhead += kv.head(0, h).overhead_bits;
        }
        s.payload_bits += payload;
        s.overhead_bits += overhead;
        s.kv += static_cast<std::size_t>((payload + overhead + 7) / 8);
        s.held += l.packed->state_bytes();
      }
      if (l.store) {
        r = store_report(l.store->view());
        held = static_cast<std::size_t>(r.held_bytes);
      } else {
        r = store_report(view(const_cast<Layer&>(l)));  // read only: store_report writes nothing
        held = static_cast<std::size_t>(l.held * ext_.heads * r.row_bytes);
      }
      Index const rows = r.row_bytes > 0 ? r.used_bytes / r.row_bytes : 0;
      std::size_t const rows_bytes =
          static_cast<std::size_t>(rows) * static_cast<std::size_t>(2 * ext_.dim) * sizeof(T);
      s.kv += rows_bytes;
      s.held += held;
      if (l.packed)  // the fp16 tail's K and V are payload too (zone C, stored as they are)
        s.payload_bits += static_cast<std::int64_t>(8 * rows_bytes);
      for (Index h = 0; h < heads_of(l); ++h) {
        Index const n = length(l, h) + (l.packed ? l.packed->packed().head(0, h).tokens : 0);
        s.min_count = std::min(s.min_count, n);
        s.max_count = std::max(s.max_count, n);
      }
    }
    return s;
  }

  std::pair<float, float> kv_scales(std::size_t layer) const override {
    Layer const& l = layers_.at(layer);
    if constexpr (is_fp8<T>)
      return {l.k_access.scale(0, 0), l.v_access.scale(0, 0)};
    else
      return {1.0f, 1.0f};
  }
  std::size_t moment_bytes() const override {
    std::size_t bytes = 0;
    for (Layer const& l : layers_)
      bytes += l.moments ? l.moments->bytes() : 0;
    return bytes;
  }

  void set_reserve(Index reserve) override {
    reserve_ = reserve;
    for (Layer& l : layers_) {
      if (l.store)
        *l.store = tools::relayout(*l.store, reserve_);
      else
        l.held = longest(l) + reserve_;
    }
  }

  bool ragged(Index layer) const override { return layers_[static_cast<std::size_t>(layer)].store.has_value(); }

  Index slot_position(Index layer, Index head, Index slot) const override {
    Layer const& l = layers_[static_cast<std::size_t>(layer)];
    if (l.store)
      return l.store->positions[static_cast<std::size_t>(l.store->offsets[static_cast<std::size_t>(head)] + slot)];
    return l.positions[static_cast<std::size_t>(head * capacity_ + slot)];
  }

  Index length(Index layer, Index head) const override {
    return length(layers_[static_cast<std::size_t>(layer)], head);
  }

 private:
  /// The engine's own cache view of a layer (view(Layer&)'s type; checked in the constructor).
  using CacheView = std::conditional_t<Paged, KVCache<TokenRows<T, PagedLayout>, TokenRows<T, PagedLayout>>,
                                       KVCache<TokenRows<T, StridedLayout>, TokenRows<T, StridedLayout>>>;

  /// A layer packed by rdkv or kivi: its kvc::LayerCompressor (of a kvc::RDKVPress or a kvc::KIVIPress) and the state
  /// it packed into. Immutable after prefill (attention only reads it), so clones share it.
  struct PackedLayer {
    virtual ~PackedLayer() = default;
    /// The compressor's attend(): the packed store and the fp16 tail `tail` (the engine's cache), merged.
    virtual Status attend(AttendQueries<float> const& queries, CacheView const& tail, AttendOutput<> out,
                          Workspace ws) = 0;
    virtual PackedKVView<> packed() const = 0;
    virtual std::size_t workspace_bytes() const = 0;
    virtual std::size_t state_bytes() const = 0;
  };
  template <class P>
  struct PackedCompressor final : PackedLayer {
    std::vector<float> rope_storage;  // the compressor's RoPE table (long enough for ExpectedAttention's future)
    LayerCompressor<P, Cpu> compressor;
    std::vector<std::byte> state;
    explicit PackedCompressor(P const& policy) : compressor{Cpu{}, policy} {}
    Status attend(AttendQueries<float> const& queries, CacheView const& tail, AttendOutput<> out,
                  Workspace ws) override {
      return compressor.attend(queries, tail, out, ws);
    }
    PackedKVView<> packed() const override { return compressor.packed(); }
    std::size_t workspace_bytes() const override { return compressor.workspace_bytes(); }
    std::size_t state_bytes() const override { return state.size(); }
  };

  struct Layer {
    std::vector<T> k, v;                             // dense: [Hkv, capacity, d]; paged: pool [pages, page, Hkv, d]
    default_access<T> k_access{}, v_access{};        // fp8: the layer's K and V scales (tensor_scale)
    bool scaled = false;                             // fp8: the scales are set (at the first forward call)
    std::vector<Index> lengths;                      // [Hkv] valid tokens
    std::vector<Index> positions;                    // [Hkv, capacity] absolute position of each slot
    RowMatrix queries;                               // the last forward call's pre-RoPE queries [n, Hq * d]
    std::vector<Index> query_positions;              // [n]
    Index held = 0;                                  // uniform: slots per head a store sized by the reserve rule holds
    std::optional<tools::HostRaggedStore<T>> store;  // after compression with an allocator: the ragged store
    std::optional<LayerMoments> moments;             // after MomentKV's compression: its moments
    std::shared_ptr<PackedLayer> packed;             // after rdkv / kivi: the packed zones (the cache: the tail)
  };

  /// RDKV's or KIVI's compression of every layer (see the file comment) through the per-layer compressor: an
  /// RDKVPress at floor(n (1 - ratio)) fp16-equivalent tokens per head, or `budget` without a ratio (weights: RDKV's
  /// own, or the `weight` policy's scores with its default parameters), or a KIVIPress. Bad parameters exit 3
  /// (tools::Failure).
  Status compress_packed(tools::PolicyInfo const& policy, tools::Params const& params, std::optional<double> ratio,
                         Index budget) {
    tools::RDKVConfig const cfg = tools::rdkv_config(policy, params);
    for (Layer const& layer : layers_)
      if (layer.store || layer.packed || layer.moments)
        return {Errc::invalid_argument, "kvc-eval: this session's cache is already compressed"};
    Status status;
    tools::with_packed_press(cfg, ratio, budget, [&](auto const& press) {
      for (std::size_t li = 0; li < layers_.size() && status.ok(); ++li)
        status = pack_layer(layers_[li], press);
    });
    return status;
  }

  /// One layer through a packed policy's compressor: planned on the layer's cache (the prompt's query rows, attention
  /// of up to the session's capacity of rows), bound to state the layer owns, prefilled with the prompt's queries.
  template <class P>
  Status pack_layer(Layer& layer, P const& press) {
    ModelConfig const& c = model_->config;
    auto packed = std::make_shared<PackedCompressor<P>>(press);
    auto& compressor = packed->compressor;
    compressor.options.rope = long_rope(press, packed->rope_storage);
    compressor.options.packed_tokens = std::max<Index>(1, longest(layer));  // the prompt, not the continuation
    auto const cache = view(layer);
    Index const w = static_cast<Index>(layer.query_positions.size());
    KVC_RETURN_IF_ERROR(compressor.plan(cache, QueryShape{c.heads, w, 1, capacity_}));
    packed->state.resize(compressor.state_bytes());
    KVC_RETURN_IF_ERROR(compressor.bind(packed->state.data(), packed->state.size()));
    KVC_RETURN_IF_ERROR(compressor.reset());
    grow(workspace_, compressor.workspace_bytes());
    TokenRows<float const, StridedLayout> const rows(layer.queries.data(), bthd_layout({1, c.heads, w, c.head_dim}));
    KVC_RETURN_IF_ERROR(
        compressor.prefill(cache, {rows, layer.query_positions.data()}, {workspace_.data(), workspace_.size()}));
    layer.packed = std::move(packed);
    layer.held = longest(layer) + reserve_;
    return {};
  }

  /// A RoPE table over [0, capacity + n_future_positions) in `storage`, n_future_positions of the scorer (or of a
  /// packed press's scorer) when it has one (ExpectedAttention averages RoPE past the context; the others need the
  /// capacity).
  template <class S>
  RopeTable<> long_rope(S const& scorer, std::vector<float>& storage) const {
    ModelConfig const& c = model_->config;
    Index future = 0;
    if constexpr (requires { scorer.n_future_positions; })
      future = scorer.n_future_positions;
    else if constexpr (requires { scorer.scorer.n_future_positions; })
      future = scorer.scorer.n_future_positions;
    storage.resize(static_cast<std::size_t>(rope_table_floats(capacity_ + future, c.head_dim)));
    RopeTable<> rope;
    if (!fill_rope_table(c.rope(), c.head_dim, capacity_ + future, storage.data(), rope).ok())
      throw std::logic_error("kvc-eval: the model's RoPE does not fill a table");
    return rope;
  }

  /// Plans `c` for layer li's stores (`heads` KV heads: Hq for UNComp's gqa=expand; up to twice the capacity slots
  /// per head, which every ragged segment stays under; the last forward call's query rows as the prompt's, one row
  /// per decode step), binds it to `state` (sized here) and resets it; the session's workspace grows to its need.
  template <class P>
  Status start_compressor(LayerCompressor<P, Cpu>& c, std::vector<std::byte>& state, Index heads, std::size_t li) {
    ModelConfig const& mc = model_->config;
    auto const shape = dense_view(layers_[li], nullptr, nullptr, KVExtents{1, heads, 2 * capacity_, ext_.dim}, {},
                                  nullptr);  // extents only: nothing is read
    Index const rows = static_cast<Index>(layers_[li].query_positions.size());
    KVC_RETURN_IF_ERROR(c.plan(shape, QueryShape{mc.heads, rows, 1, 1}));
    state.resize(c.state_bytes());
    KVC_RETURN_IF_ERROR(c.bind(state.data(), state.size(), static_cast<Index>(li)));
    KVC_RETURN_IF_ERROR(c.reset());
    grow(workspace_, c.workspace_bytes());
    return {};
  }

  /// The last forward call's pre-RoPE queries of `layer`, [1, Hq, n, d] (token-major), with their positions.
  LayerQueries<float> last_queries(Layer const& layer) const {
    ModelConfig const& c = model_->config;
    Index const n = static_cast<Index>(layer.query_positions.size());
    return {TokenRows<float const, StridedLayout>(layer.queries.data(), bthd_layout({1, c.heads, n, c.head_dim})),
            layer.query_positions.data()};
  }

  /// Appends the last forward call's pre-RoPE queries of `layer` ([n, Hq * d]) and their positions to a decode
  /// QueryBuffer (the decode drivers of every policy); an error when they do not fit the buffer.
  static Status push_queries(ModelConfig const& c, Layer const& layer, QueryBuffer<float>& buffer) {
    Index const n = layer.queries.rows();
    if (n > buffer.capacity - buffer.count)
      return {Errc::out_of_capacity, "kvc-eval: decode-time compression takes one token per forward call"};
    for (Index t = 0; t < n; ++t) {
      for (Index q = 0; q < c.heads; ++q)
        std::copy_n(layer.queries.data() + (t * c.heads + q) * c.head_dim, c.head_dim,
                    buffer.row(0, q, buffer.count + t));
      buffer.positions[buffer.count + t] = layer.query_positions[static_cast<std::size_t>(t)];
    }
    return buffer.push(n);
  }

  auto view(Layer& l) {
    if constexpr (Paged) {
      Index const pages = static_cast<Index>(block_table_.size());
      auto const layout = paged_layout(ext_, options_.page_size, PageOrder::nhd, block_table_.data(), pages, pages);
      return make_cache(TokenRows<T, PagedLayout>(l.k.data(), layout, l.k_access),
                        TokenRows<T, PagedLayout>(l.v.data(), layout, l.v_access),
                        head_lengths(l.lengths.data(), ext_.heads), l.positions.data());
    } else {
      return dense_view(l, l.k.data(), l.v.data(), ext_, head_lengths(l.lengths.data(), ext_.heads),
                        l.positions.data());
    }
  }
  /// A dense BHTD cache over K and V rows of element type T read with layer l's accessors (its fp8 scales).
  static auto dense_view(Layer const& l, T* k, T* v, KVExtents e, Lengths lengths, Index* positions) {
    return make_cache(TokenRows<T, StridedLayout>(k, bhtd_layout(e), l.k_access),
                      TokenRows<T, StridedLayout>(v, bhtd_layout(e), l.v_access), lengths, positions);
  }

  /// fp8: layer l's K and V scales from this forward call's K and V (k_, v_, post-RoPE): amax over the format's
  /// largest finite value, so that no value of the call saturates (1 when the amax is 0 or not finite).
  void set_scales(Layer& l) const {
    constexpr float largest = std::is_same_v<T, float8_e4m3> ? 448.0f : 57344.0f;  // docs/fp8.md, "Formats"
    auto const scale = [&](RowMatrix const& x) {
      float const amax = x.size() > 0 ? x.cwiseAbs().maxCoeff() : 0.0f;
      return amax > 0.0f && std::isfinite(amax) ? amax / largest : 1.0f;
    };
    l.k_access = tensor_scale(scale(k_));
    l.v_access = tensor_scale(scale(v_));
    l.scaled = true;
  }
  auto view(Layer& l) const { return const_cast<Engine*>(this)->view(l); }

  /// fn(cache) over the layer's current store: the ragged store when it has one, else the engine's cache.
  template <class Fn>
  Status with_view(Layer& l, Fn&& fn) {
    if (l.store)
      return fn(l.store->view());
    return fn(view(l));
  }

  Index length(Layer const& l, Index head) const {
    return (l.store ? l.store->lengths : l.lengths)[static_cast<std::size_t>(head)];
  }
  /// KV heads of the layer's store (Hq for a layer UNComp expanded with gqa=expand).
  Index heads_of(Layer const& l) const { return l.store ? l.store->heads : ext_.heads; }
  Index longest(Layer const& l) const {
    Index n = 0;
    for (Index h = 0; h < heads_of(l); ++h)
      n = std::max(n, length(l, h));
    return n;
  }

  /// Before appending `n` tokens: a ragged store whose head would overflow is re-laid out (every head: its length
  /// + max(reserve, n) slots); a uniform store is re-sized by the same rule (its `held`).
  void make_room(Layer& l, Index n) {
    Index const fresh = std::max(reserve_, n);
    if (!l.store) {
      if (longest(l) + n > l.held)
        l.held = longest(l) + fresh;
      return;
    }
    for (Index h = 0; h < l.store->heads; ++h)
      if (l.store->lengths[static_cast<std::size_t>(h)] + n > l.store->capacity(0, h)) {
        *l.store = tools::relayout(*l.store, fresh);
        return;
      }
  }

  /// The layer's cache becomes `store`; the engine's own buffers are released (the memory an engine frees).
  void adopt(Layer& l, tools::HostRaggedStore<T>&& store) {
    l.store = std::move(store);
    std::vector<T>().swap(l.k);
    std::vector<T>().swap(l.v);
    std::vector<Index>().swap(l.positions);
    l.held = 0;
  }

  /// Every token of `cache` (the layer's cache, or UNComp's expanded copy of it) into a ragged store with the
  /// current reserve, which becomes the layer's.
  template <class Cache>
  Status to_ragged(Layer& l, Cache const& cache) {
    tools::HostRaggedStore<T> store(1, cache.keys.extents().heads, ext_.dim, ext_.dim, cache.lengths.data, reserve_);
    store.k_access = l.k_access;  // the same scales: the tokens move as bytes
    store.v_access = l.v_access;
    KVC_RETURN_IF_ERROR(append(Cpu{}, store.view(), cache));
    adopt(l, std::move(store));
    return {};
  }
  Status to_ragged(Layer& l) { return to_ragged(l, view(l)); }

  /// Keeps `keep` of the `n` hidden-state rows (spec §2.9): u_j = the attention the last `window` queries of the
  /// previous layer (q_, k_: its post-RoPE projections, still in place) paid row j, summed over the query heads (fp64
  /// softmax, causal by position), then select_hidden_states (the last `window` rows always kept) and the rows of
  /// the residual stream and their positions gathered. n becomes the count kept.
  Status prune_hidden_states(Index keep, Index window, Index& n);

  /// The policy's parameters for layer `li`: pyramid_kv's layer and num_layers come from the model.
  tools::Params layer_params(tools::Params params, tools::AllocatorChoice const& alloc, std::size_t li) const {
    if (alloc.pyramid_kv) {
      params["layer"] = std::to_string(li);
      params["num_layers"] = std::to_string(layers_.size());
    }
    return params;
  }

  /// splitmix64 of (seed, salt, layer): a seed per (sample, layer) for the random baseline.
  static std::uint64_t mix_seed(std::uint64_t seed, std::uint64_t salt, std::size_t layer) noexcept {
    std::uint64_t z = seed ^ (salt * 0x9E3779B97F4A7C15ull) ^ (static_cast<std::uint64_t>(layer) << 32);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }

  /// [n, heads * d] token-major -> [heads, n, d] head-major.
  static void head_major(RowMatrix const& x, Index heads, Index d, std::vector<float>& out) {
    Index const n = x.rows();
    out.resize(static_cast<std::size_t>(heads * n * d));
    for (Index h = 0; h < heads; ++h)
      for (Index t = 0; t < n; ++t)
        for (Index i = 0; i < d; ++i)
          out[static_cast<std::size_t>((h * n + t) * d + i)] = x(t, h * d + i);
  }

  static void grow(std::vector<std::byte>& ws, std::size_t bytes) {
    if (ws.size() < bytes)
      ws.resize(bytes);
  }

  /// One layer's compressor while decoding, whatever its policy: decode() after every forward call.
  struct DecodingLayer {
    virtual ~DecodingLayer() = default;
    /// The compressor's decode() on the layer's store with the last forward call's queries; `compressed`: whether
    /// it compressed.
    virtual Status decode(Engine& e, Layer& layer, bool& compressed) = 0;
    /// The compressor's attend() over the layer's store (MomentKV: corrected by its moments, which keep growing).
    virtual Status attend(Engine& e, Layer& layer, AttendQueries<float> const& queries, AttendOutput<> out) = 0;
  };
  template <class P>
  struct DecodingCompressor final : DecodingLayer {
    LayerCompressor<P, Cpu> compressor;
    std::vector<std::byte> state;
    std::vector<Index> table;  // per-head budgets the policy reads (UNComp's)
    explicit DecodingCompressor(P const& policy) : compressor{Cpu{}, policy} {}
    Status decode(Engine& e, Layer& layer, bool& compressed) override {
      return e.with_view(layer, [&](auto const& cache) {
        return compressor.decode(cache, e.last_queries(layer), {e.workspace_.data(), e.workspace_.size()}, &compressed);
      });
    }
    Status attend(Engine& e, Layer& layer, AttendQueries<float> const& queries, AttendOutput<> out) override {
      return e.with_view(layer, [&](auto const& cache) {
        return compressor.attend(queries, cache, out, {e.workspace_.data(), e.workspace_.size()});
      });
    }
  };

  /// The decode driver: every layer's compressor, and the RoPE table they share (long enough for
  /// ExpectedAttention's future positions).
  struct DecodeRun {
    bool relayout_on_compress = false;  // re-lay a ragged store out after each compression
    std::vector<std::unique_ptr<DecodingLayer>> layers;
    std::vector<float> rope_storage;

    /// After a forward call: each layer's compressor decodes (in place on the layer's store: the engine's cache, or
    /// the ragged store).
    Status step(Engine& e) {
      for (std::size_t li = 0; li < layers.size(); ++li) {
        Layer& layer = e.layers_[li];
        bool compressed = false;
        KVC_RETURN_IF_ERROR(layers[li]->decode(e, layer, compressed));
        if (compressed && relayout_on_compress && layer.store)  // give the emptied slots back
          *layer.store = tools::relayout(*layer.store, e.reserve_);
      }
      return {};
    }
  };

  /// UNComp's compression of every layer (tools/common/uncomp.hpp, spec §2.6-2.8) through the per-layer compressor
  /// of a Press{UNCompScorer, UNCompSelector}: per layer, the per-head budgets from the calibration's groups for an
  /// average of `ratio`'s kept count of the layer's tokens (or `budget` tokens); prefill() folds the prompt's last
  /// window_size queries into the scorer's state (each slot's attention, summed over its query group) and keeps each
  /// head's budget (the window always kept), in place; the kept tokens then move into a ragged per-head store with
  /// reserve_. gqa=expand runs on a copy of the layer whose KV heads are repeated to Hq (the authors' per-query-head
  /// caches), and the layer's store keeps Hq heads from then on. With `decode`, each layer's compressor joins it and
  /// decodes after every token (interval 1, one buffered query; target `budget`): the new query's attention row
  /// joins the state and each head over its budget evicts its lowest pooled window score (the window protected).
  Status compress_uncomp(tools::Params const& params, std::optional<double> ratio, Index budget,
                         DecodeRun* decode = nullptr);

  /// UNComp while decoding (spec §2.8): the prompt compressed to per-head budgets of average `target` (schedule
  /// target_size), then the compressors decode after every token (compress_uncomp). Ragged stores with one free
  /// slot per head.
  Status begin_uncomp_decode(tools::Params const& params, DecodeSchedule const& schedule);

  /// MomentKV's compression of every layer through the per-layer compressor of a Press{MomentKVScorer, selection} at
  /// `ratio` (or `budget` tokens per head; the selection: tools::with_selection's, TopK or AdaKV with the policy's
  /// n_sink and n_recent): prefill() in place on the engine's cache (mi: kvc::moment_kv_prefill's rounds; mi=false:
  /// the base score alone, in one shot), then (with ada_kv) into a ragged store with reserve_. Each layer keeps a copy
  /// of its moments (their bytes; the attention of a compressed prompt: corrected with correction=true). With
  /// `decode` (`budget` the target), each layer's compressor joins it and runs Algorithm 1 after every token
  /// (interval 1, one buffered query, each head back to its budget: the target, or with ada_kv what it kept at
  /// prefill (kvc::decode_budgets)); attention then goes through the compressor (its moments keep growing).
  Status compress_moment_kv(tools::Params const& params, std::optional<double> ratio, Index budget,
                            tools::AllocatorChoice const& alloc, DecodeRun* decode = nullptr);

  /// MomentKV while decoding: the prompt compressed to the target, then Algorithm 1 after every token
  /// (decode_evict=true; compress_moment_kv). decode_evict=false compresses the prompt only and the cache grows.
  Status begin_moment_decode(tools::Params const& params, DecodeSchedule const& schedule,
                             tools::AllocatorChoice const& alloc);

  std::shared_ptr<DecodeRun> decode_run_;  // set by begin_decode; never copied (a clone does not decode)
  Model const* model_;
  CacheOptions options_;
  Index capacity_ = 0;
  Index reserve_ = 0;  // free slots per head a store is (re-)sized with (set by compress, begin_decode, set_reserve)
  KVExtents ext_{};
  std::vector<Layer> layers_;
  std::vector<std::int32_t> block_table_;  // [pages]: sequence page p lives in pool page pages - 1 - p
  std::vector<float> rope_storage_;
  RopeTable<> rope_{};
  // Scratch reused across calls (sized by the largest call so far).
  RowMatrix x_, h_, q_, k_, v_, out_, o_, gate_, up_, kx_, vx_;
  std::vector<Index> positions_, src_positions_, src_positions_x_, index_, count_;
  std::vector<std::byte> workspace_;
};

template <class T>
std::unique_ptr<Session> make_typed(Model const& model, CacheOptions const& options, Index capacity) {
  if (options.layout == CacheLayout::paged)
    return std::make_unique<Engine<T, true>>(model, options, capacity);
  return std::make_unique<Engine<T, false>>(model, options, capacity);
}

}  // namespace detail

}  // namespace kvc::eval
