// SPDX-License-Identifier: Apache-2.0
// tools/kvc/compress_packed.cpp: one compress job of RDKV or KIVI (tools/common/rdkv.hpp): the bit plan and the
// packed store, by its kvc::LayerCompressor (engine/packed_compressor.hpp).

#include "compress.hpp"

namespace kvc::cli {

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
  kvc::Index const tail = kvc::tail_tokens(e.tokens, cfg.residual());
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
        check_rows_used(cfg.press.scorer.window_size, "rdkv", e.tokens, q, keys.path);
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

}  // namespace kvc::cli
