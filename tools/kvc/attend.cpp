// SPDX-License-Identifier: Apache-2.0
// tools/kvc/attend.cpp: `kvc attend`: attention of queries over a (compressed) cache, plain (kvc::attend) and
// corrected by MomentKV's moments (kvc::attend_corrected).

#include <kvc/backend/cpu/attention/attend.hpp>
#include <kvc/backend/cpu/attention/corrected.hpp>

#include "common/isa.hpp"
#include "common/moment_kv.hpp"
#include "internal.hpp"

#include <cmath>
#include <sys/stat.h>
#include <unistd.h>

namespace kvc::cli {

namespace {

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

}  // namespace

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

}  // namespace kvc::cli
