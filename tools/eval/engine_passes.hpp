// SPDX-License-Identifier: Apache-2.0
// tools/eval/engine_passes.hpp: kvc-eval's engine (engine_impl.hpp), continued: Engine's forward pass, the pruning of
// UNComp's hidden states, and the UNComp and MomentKV compressions (prefill and decode-time), defined out of the class.
// Included by engine_instance.cpp alone, once per cache element type.
#pragma once

#include "eval/engine_impl.hpp"

namespace kvc::eval::detail {

template <class T, bool Paged>
Status Engine<T, Paged>::forward(std::span<std::int32_t const> tokens, RowMatrix& logits, ForwardTrace* trace) {
  ModelConfig const& c = model_->config;
  Index const count = static_cast<Index>(tokens.size());
  Index n = count;  // rows of the hidden states (fewer after a stage boundary's pruning)
  if (next_position_ + n > capacity_)
    return {Errc::out_of_capacity, "kvc-eval: the sequence is longer than the session's capacity"};
  for (std::int32_t t : tokens)
    if (t < 0 || t >= c.vocab)
      return {Errc::invalid_argument, "kvc-eval: a token id is outside the vocabulary"};
  Index const hq = c.heads, hkv = c.kv_heads, d = c.head_dim;
  positions_.resize(static_cast<std::size_t>(n));
  src_positions_.resize(static_cast<std::size_t>(hkv * n));
  for (Index t = 0; t < n; ++t) {
    positions_[static_cast<std::size_t>(t)] = next_position_ + t;
    for (Index h = 0; h < hkv; ++h)
      src_positions_[static_cast<std::size_t>(h * n + t)] = next_position_ + t;
  }
  x_.resize(n, c.hidden);
  MatrixMap const embed = model_->embed.matrix();
  for (Index t = 0; t < n; ++t)
    x_.row(t) = embed.row(tokens[static_cast<std::size_t>(t)]);
  if (trace)
    trace->attention.resize(layers_.size());
  // UNComp's stage variant (spec §2.9): this call's hidden states are pruned at stage boundaries.
  std::optional<HiddenStatePlan> plan = std::exchange(stage_plan_, std::nullopt);
  std::vector<Index> counts;
  if (plan && n > 1) {
    counts.resize(static_cast<std::size_t>(plan->stages));
    KVC_RETURN_IF_ERROR(
        hidden_state_counts(n, plan->stages, plan->min_tokens.value_or((3 * n + 7) / 8), plan->step, counts.data()));
    plan->kept.assign(layers_.size(), n);
  }

  for (std::size_t li = 0; li < layers_.size(); ++li) {
    LayerWeights const& w = model_->layers[li];
    Layer& layer = layers_[li];
    if (!counts.empty() && li > 0 &&
        plan->stage_of_layer[li] != plan->stage_of_layer[li - 1]) {  // q_, k_ still hold layer li - 1's
      KVC_RETURN_IF_ERROR(
          prune_hidden_states(counts[static_cast<std::size_t>(plan->stage_of_layer[li])], plan->window, n));
      if (trace)
        return {Errc::invalid_argument, "kvc-eval: a forward call with hidden-state pruning records no trace"};
    }
    if (plan && !counts.empty())
      plan->kept[li] = n;
    rms_norm(x_, w.attn_norm.vector(), c.rms_eps, h_);
    q_.noalias() = h_ * w.wq.matrix().transpose();  // [n, Hq * d]
    k_.noalias() = h_ * w.wk.matrix().transpose();  // [n, Hkv * d]
    v_.noalias() = h_ * w.wv.matrix().transpose();
    layer.queries = q_;  // pre-RoPE: the window queries compression observes
    layer.query_positions = positions_;
    for (Index t = 0; t < n; ++t) {
      for (Index h = 0; h < hq; ++h)
        rope_.rotate(q_.data() + (t * hq + h) * d, positions_[static_cast<std::size_t>(t)]);
      for (Index h = 0; h < hkv; ++h)
        rope_.rotate(k_.data() + (t * hkv + h) * d, positions_[static_cast<std::size_t>(t)]);
    }
    if (trace && trace->projections) {
      trace->qkv.resize(layers_.size());
      LayerProjections& p = trace->qkv[li];
      head_major(k_, hkv, d, p.keys);
      head_major(v_, hkv, d, p.values);
      head_major(q_, hq, d, p.queries);
      head_major(layer.queries, hq, d, p.queries_prerope);
    }
    // K and V of the new tokens, [1, Hkv, n, d] token-major (bthd), appended after each head's length.
    // A layer UNComp expanded to one KV head per query head (gqa=expand) takes each KV head's rows once per query
    // head of its group.
    Index const store_heads = heads_of(layer);
    if (store_heads != hkv) {
      Index const g = store_heads / hkv;
      kx_.resize(n, store_heads * d);
      vx_.resize(n, store_heads * d);
      for (Index t = 0; t < n; ++t)
        for (Index h = 0; h < store_heads; ++h) {
          kx_.block(t, h * d, 1, d) = k_.block(t, (h / g) * d, 1, d);
          vx_.block(t, h * d, 1, d) = v_.block(t, (h / g) * d, 1, d);
        }
      src_positions_x_.resize(static_cast<std::size_t>(store_heads * n));
      for (Index h = 0; h < store_heads; ++h)
        for (Index t = 0; t < n; ++t)
          src_positions_x_[static_cast<std::size_t>(h * n + t)] = positions_[static_cast<std::size_t>(t)];
    }
    bool const expanded = store_heads != hkv;
    KVExtents const new_ext{1, store_heads, n, d};
    auto const src =
        make_cache(TokenRows<float const, StridedLayout>(expanded ? kx_.data() : k_.data(), bthd_layout(new_ext)),
                   TokenRows<float const, StridedLayout>(expanded ? vx_.data() : v_.data(), bthd_layout(new_ext)),
                   Lengths{}, expanded ? src_positions_x_.data() : src_positions_.data());
    if constexpr (is_fp8<T>)
      if (!layer.scaled)  // the prompt's call: the layer's scales (see the file comment)
        set_scales(layer);
    make_room(layer, n);
    AttendQueries<float> const queries{TokenRows<float const, StridedLayout>(q_.data(), bthd_layout({1, hq, n, d})),
                                       positions_.data()};
    out_.resize(hq * n, d);  // [Hq, n, d]
    Status const attended = with_view(layer, [&](auto const& cache) -> Status {
      KVC_RETURN_IF_ERROR(append(Cpu{}, cache, src));
      if (decode_run_)  // while decoding, every layer attends through its compressor
        return decode_run_->layers[li]->attend(*this, layer, queries, {out_.data()});
      if (layer.packed) {  // rdkv / kivi: the compressor's attention over its packed store and the fp16 tail
        if constexpr (std::is_same_v<std::remove_cvref_t<decltype(cache)>, CacheView>) {
          grow(workspace_, layer.packed->workspace_bytes());
          return layer.packed->attend(queries, cache, {out_.data()}, {workspace_.data(), workspace_.size()});
        } else {
          return {Errc::invalid_argument, "kvc-eval: a packed layer has no ragged store"};
        }
      }
      if (layer.moments && layer.moments->correction)  // MomentKV: the evicted set joins as one virtual token
        return std::visit(
            [&](auto const& m) -> Status {
              CorrectedAttention const& op = layer.moments->op;
              grow(workspace_, attend_corrected_workspace_bytes(Cpu{}, op, queries, cache, m.view));
              return attend_corrected(Cpu{}, op, queries, cache, m.view, {out_.data()},
                                      {workspace_.data(), workspace_.size()});
            },
            layer.moments->moments);
      grow(workspace_, attend_workspace_bytes(Cpu{}, Attention{}, queries, cache));
      return attend(Cpu{}, Attention{}, queries, cache, {out_.data()}, {workspace_.data(), workspace_.size()});
    });
    if (!attended.ok())
      return attended;
    o_.resize(n, hq * d);
    for (Index h = 0; h < hq; ++h)
      for (Index t = 0; t < n; ++t)
        o_.block(t, h * d, 1, d) = out_.row(h * n + t);
    if (trace)
      trace->attention[li] = o_;
    x_.noalias() += o_ * w.wo.matrix().transpose();

    rms_norm(x_, w.ffn_norm.vector(), c.rms_eps, h_);
    gate_.noalias() = h_ * w.gate.matrix().transpose();
    up_.noalias() = h_ * w.up.matrix().transpose();
    gate_ = gate_.unaryExpr([](float g) { return g / (1.0f + std::exp(-g)); }).cwiseProduct(up_);  // SwiGLU
    x_.noalias() += gate_ * w.down.matrix().transpose();
  }
  rms_norm(x_, model_->final_norm.vector(), c.rms_eps, h_);
  logits.noalias() = h_ * model_->lm_head.matrix().transpose();
  next_position_ += count;
  if (plan && !counts.empty())
    last_stage_plan_ = std::move(plan);
  if (decode_run_) {  // the decode driver, after the layers' attention, as an engine runs it per layer
    auto const start = std::chrono::steady_clock::now();
    Status const st = decode_run_->step(*this);
    decode_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return st;
  }
  return {};
}

template <class T, bool Paged>
Status Engine<T, Paged>::prune_hidden_states(Index keep, Index window, Index& n) {
  ModelConfig const& c = model_->config;
  Index const hq = c.heads, hkv = c.kv_heads, d = c.head_dim, g = hq / hkv, rows = std::min(window, n);
  std::vector<float> u(static_cast<std::size_t>(n), 0.0f);
  std::vector<double> p(static_cast<std::size_t>(n));
  double const scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (Index h = 0; h < hq; ++h)
    for (Index t = n - rows; t < n; ++t) {
      float const* q = q_.data() + (t * hq + h) * d;
      double peak = -std::numeric_limits<double>::infinity(), total = 0.0;
      for (Index j = 0; j < n; ++j) {
        if (positions_[static_cast<std::size_t>(j)] > positions_[static_cast<std::size_t>(t)])
          continue;
        float const* k = k_.data() + (j * hkv + h / g) * d;
        double dot = 0.0;
        for (Index i = 0; i < d; ++i)
          dot += static_cast<double>(q[i]) * static_cast<double>(k[i]);
        p[static_cast<std::size_t>(j)] = dot * scale;
        peak = std::max(peak, dot * scale);
      }
      for (Index j = 0; j < n; ++j)
        if (positions_[static_cast<std::size_t>(j)] <= positions_[static_cast<std::size_t>(t)])
          total += std::exp(p[static_cast<std::size_t>(j)] - peak);
      for (Index j = 0; j < n; ++j)
        if (positions_[static_cast<std::size_t>(j)] <= positions_[static_cast<std::size_t>(t)])
          u[static_cast<std::size_t>(j)] += static_cast<float>(std::exp(p[static_cast<std::size_t>(j)] - peak) / total);
    }
  std::vector<Index> kept_rows(static_cast<std::size_t>(std::min(n, std::max(keep, window))));
  Index kept = 0;
  KVC_RETURN_IF_ERROR(select_hidden_states(u.data(), n, keep, window, kept_rows.data(), kept));
  RowMatrix x(kept, x_.cols());
  std::vector<Index> positions(static_cast<std::size_t>(kept));
  for (Index i = 0; i < kept; ++i) {
    Index const r = kept_rows[static_cast<std::size_t>(i)];
    x.row(i) = x_.row(r);
    positions[static_cast<std::size_t>(i)] = positions_[static_cast<std::size_t>(r)];
  }
  x_.swap(x);
  positions_ = std::move(positions);
  n = kept;
  src_positions_.resize(static_cast<std::size_t>(hkv * n));
  for (Index h = 0; h < hkv; ++h)
    for (Index t = 0; t < n; ++t)
      src_positions_[static_cast<std::size_t>(h * n + t)] = positions_[static_cast<std::size_t>(t)];
  return {};
}

template <class T, bool Paged>
Status Engine<T, Paged>::compress_uncomp(tools::Params const& params, std::optional<double> ratio, Index budget,
                                         DecodeRun* decode) {
  if (!calibration_)
    return {Errc::invalid_argument, "kvc-eval: uncomp rows need a calibration (--calibration or the built-in one)"};
  tools::UNCompConfig const cfg = tools::uncomp_config(params);
  ModelConfig const& c = model_->config;
  bool const expand = cfg.gqa == tools::UNCompGqa::expand;
  Index const heads = expand ? c.heads : ext_.heads, g = c.heads / ext_.heads, w = cfg.scorer.window_size;
  using P = Press<UNCompScorer<>, UNCompSelector<>>;
  Status status;
  for (std::size_t li = 0; li < layers_.size() && status.ok(); ++li) {
    Layer& layer = layers_[li];
    Index const n = longest(layer);                        // (after hidden-state pruning: fewer than the prompt)
    Index const prompt = cfg.stages ? next_position_ : n;  // the same average budget as the unpruned rows
    double const average = cfg.absolute() ? 0.0
                           : ratio        ? static_cast<double>(RatioBudget{*ratio}.keep(0, 0, prompt))
                                          : static_cast<double>(budget);
    auto l = std::make_unique<DecodingCompressor<P>>(P{});
    l->table = tools::uncomp_budgets(cfg, *calibration_, "(kvc-eval)", static_cast<Index>(li), average);
    UNCompScorer<> const scorer = cfg.scorer;  // (its state is the compressor's)
    auto& compressor = l->compressor;
    compressor.policy = P{scorer, UNCompSelector{HeadBudgets{l->table.data(), heads}, 0, w}};
    compressor.options.rope = rope_;
    if (decode) {
      compressor.options.decode = true;
      compressor.options.schedule.compression_interval = 1;
      compressor.options.schedule.hidden_states_buffer_size = 1;
      compressor.options.schedule.target_size = budget;
    }
    KVC_RETURN_IF_ERROR(start_compressor(compressor, l->state, heads, li));
    auto run = [&](auto const& cache) -> Status {
      KVC_RETURN_IF_ERROR(compressor.prefill(cache, last_queries(layer), {workspace_.data(), workspace_.size()}));
      return to_ragged(layer, cache);
    };
    if (!expand) {
      status = run(view(layer));
    } else {  // K/V of KV head h / g for query head h, positions alike
      auto const src = view(layer);
      KVExtents const xe{1, heads, n, ext_.dim};
      std::vector<T> xk(static_cast<std::size_t>(xe.rows() * xe.dim)), xv(xk.size());
      std::vector<Index> xlen(static_cast<std::size_t>(heads)), xpos(static_cast<std::size_t>(xe.rows()));
      for (Index h = 0; h < heads; ++h) {
        xlen[static_cast<std::size_t>(h)] = length(layer, h / g);
        for (Index t = 0; t < xlen[static_cast<std::size_t>(h)]; ++t) {
          std::copy_n(src.keys.row(0, h / g, t), ext_.dim, xk.data() + (h * n + t) * ext_.dim);
          std::copy_n(src.values.row(0, h / g, t), ext_.dim, xv.data() + (h * n + t) * ext_.dim);
          xpos[static_cast<std::size_t>(h * n + t)] = slot_position(static_cast<Index>(li), h / g, t);
        }
      }
      status = run(dense_view(layer, xk.data(), xv.data(), xe, head_lengths(xlen.data(), heads), xpos.data()));
    }
    if (decode)
      decode->layers.push_back(std::move(l));
  }
  return status;
}

template <class T, bool Paged>
Status Engine<T, Paged>::begin_uncomp_decode(tools::Params const& params, DecodeSchedule const& schedule) {
  for (Layer const& layer : layers_)
    if (layer.store || layer.moments)
      return {Errc::invalid_argument, "kvc-eval: this session's cache is already compressed"};
  reserve_ = 1;
  auto run = std::make_shared<DecodeRun>();
  auto const start = std::chrono::steady_clock::now();
  Status const status = compress_uncomp(params, std::nullopt, schedule.target_size, run.get());
  decode_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!status.ok())
    return status;
  decode_run_ = std::move(run);
  return {};
}

template <class T, bool Paged>
Status Engine<T, Paged>::compress_moment_kv(tools::Params const& params, std::optional<double> ratio, Index budget,
                                            tools::AllocatorChoice const& alloc, DecodeRun* decode) {
  tools::MomentKVConfig const cfg = eval_moment_config(params, alloc, "moment_kv");
  Status status;
  tools::with_moment_storage(cfg.storage, [&](auto tag) {
    using MT = decltype(tag);
    MomentKVScorer<HostSpace, MT> const scorer = tools::moment_scorer<MT>(cfg);
    for (std::size_t li = 0; li < layers_.size() && status.ok(); ++li) {
      Layer& layer = layers_[li];
      tools::with_selection(
          alloc, layer_params(params, alloc, li), tools::Selection{cfg.n_sink, cfg.n_recent}, ratio, budget,
          longest(layer), [&](auto const& selector) {
            using P = Press<MomentKVScorer<HostSpace, MT>, std::remove_cvref_t<decltype(selector)>>;
            auto l = std::make_unique<DecodingCompressor<P>>(P{scorer, selector});
            auto& c = l->compressor;
            c.options.rope = rope_;
            c.options.attention = cfg.attention();
            c.options.corrected = cfg.correction;
            if (decode) {
              c.options.decode = true;
              c.options.schedule.compression_interval = 1;
              c.options.schedule.hidden_states_buffer_size = 1;
              c.options.schedule.target_size = budget;
            }
            status = start_compressor(c, l->state, ext_.heads, li);
            if (status.ok())
              status = c.prefill(view(layer), last_queries(layer), {workspace_.data(), workspace_.size()});
            if (!status.ok())
              return;
            layer.moments.emplace(AnyMoments(copy_moments(c.moments())), cfg.attention(), cfg.correction);
            if (decode)
              decode->layers.push_back(std::move(l));
          });
      if (status.ok() && alloc.any())
        status = to_ragged(layer);
      else if (status.ok())
        layer.held = longest(layer) + reserve_;
    }
  });
  return status;
}

template <class T, bool Paged>
Status Engine<T, Paged>::begin_moment_decode(tools::Params const& params, DecodeSchedule const& schedule,
                                             tools::AllocatorChoice const& alloc) {
  for (Layer const& layer : layers_)
    if (layer.store || layer.moments)
      return {Errc::invalid_argument, "kvc-eval: this session's cache is already compressed"};
  tools::MomentKVConfig const cfg = eval_moment_config(params, alloc, "moment_kv");
  // Algorithm 1 evicts back every step: a ragged segment needs one free slot; without it the cache grows.
  reserve_ = cfg.decode_evict ? 1 : capacity_ - next_position_;
  auto run = cfg.decode_evict ? std::make_shared<DecodeRun>() : nullptr;
  auto const start = std::chrono::steady_clock::now();
  Status const status = compress_moment_kv(params, std::nullopt, schedule.target_size, alloc, run.get());
  decode_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (status.ok() && run)
    decode_run_ = std::move(run);
  return status;
}

}  // namespace kvc::eval::detail
