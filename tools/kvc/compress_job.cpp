// SPDX-License-Identifier: Apache-2.0
// tools/kvc/compress_job.cpp: one compress job of a policy of the table (top-k or the allocators), MomentKV (with
// the moments of the evicted sets) or UNComp, by its kvc::LayerCompressor, and the ragged store.

#include <kvc/backend/cpu/attention/corrected.hpp>

#include "common/moment_kv.hpp"
#include "compress.hpp"

#include <cmath>
#include <cstring>

namespace kvc::cli {

namespace {

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
    fn(kvc::Press{cfg.scorer,
                  kvc::UNCompSelector{kvc::HeadBudgets{budgets.data(), e.heads}, 0, cfg.scorer.window_size}});
  } else {
    with_policy(job.policy, job.params, [&](auto const& scorer, Selection sel) {
      with_selection(s.alloc, job.params, sel, s.ratio, s.budget, e.tokens, [&](auto const& selector) {
        fn(kvc::Press{scorer, selector});
      });
    });
  }
}

}  // namespace

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

}  // namespace kvc::cli
