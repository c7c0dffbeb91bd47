// SPDX-License-Identifier: Apache-2.0
// tools/kvc/compress.cpp: `kvc compress`: the options, the jobs (the options' files, or each layer of a `kvc-eval
// dump` folder), and their outputs staged and renamed into place together.

#include "compress.hpp"

#include "common/moment_kv.hpp"
#include "io/json.hpp"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <sys/stat.h>
#include <tuple>
#include <unistd.h>

namespace kvc::cli {

LastRows last_rows(Job const& job, kvc::Index used) {
  Queries const& q = job.queries;
  kvc::Index const batch = extents_of(job.keys).batch, tokens = extents_of(job.keys).tokens, r = q.ext.tokens;
  LastRows l;
  l.positions = buffer<kvc::Index>(static_cast<std::size_t>(batch * used), "the positions of " + job.context());
  for (kvc::Index b = 0; b < batch; ++b)
    for (kvc::Index i = 0; i < used; ++i)
      l.positions[static_cast<std::size_t>(b * used + i)] =
          q.positions.empty() ? tokens - used + i : q.positions[static_cast<std::size_t>(b * r + r - used + i)];
  kvc::StridedLayout window = kvc::bhtd_layout(q.ext);
  window.ext.tokens = used;
  l.queries = {{used > 0 ? q.rows.data() + (r - used) * q.ext.dim : nullptr, window}, l.positions.data()};
  return l;
}

namespace {

/// A `kvc-eval dump` folder: meta.json and layer<L>/{keys,values,queries,queries_prerope}.npy.
struct Dump {
  std::string dir;
  kvc::Index layers = 0;
  std::optional<kvc::RopeSpec> rope;  ///< meta.json's "rope" (theta, style), when it has one
  bool scaled = false;                ///< "rope": {"scaled": true}: inv_freq kvc cannot rebuild from theta
  std::optional<kvc::Index> tokens, kv_heads, head_dim;  ///< meta.json's sizes, checked against each layer's keys

  std::string meta_path() const { return dir + "/meta.json"; }
  std::string layer_dir(kvc::Index l) const { return dir + "/layer" + std::to_string(l); }
};

/// Reads DIR/meta.json (exit 3 naming the file and the field). `pre_rope_queries`: the policy rotates the
/// queries_prerope.npy rows with meta.json's RoPE, which must then be there (and not scaled).
Dump read_dump(std::string const& dir, bool pre_rope_queries) {
  Dump d;
  d.dir = dir;
  std::string const path = d.meta_path(), where = "--dump " + dir + ": " + path + ": ";
  std::vector<std::byte> bytes;
  std::string error;
  if (!kvc::read_regular_file(path, bytes, error, std::uint64_t{1} << 20))
    fail(exit_invalid, where + error + " (expected a folder as `kvc-eval dump` writes it: meta.json and " +
                           "layer<L>/keys.npy, values.npy, queries.npy, queries_prerope.npy)");
  kvc::json::Value meta;
  if (!kvc::json::parse(std::string_view(reinterpret_cast<char const*>(bytes.data()), bytes.size()), meta, error))
    fail(exit_invalid, where + "not JSON: " + error);
  if (!meta.is_object())
    fail(exit_invalid, where + "expected a JSON object");
  auto count = [&](char const* field, bool required) -> std::optional<kvc::Index> {
    kvc::json::Value const* v = meta.find(field);
    if (v == nullptr) {
      if (required)
        fail(exit_invalid, where + "field '" + field + "' is missing, expected the model's layer count");
      return std::nullopt;
    }
    std::int64_t x = 0;
    if (!kvc::json::to_int64(*v, x) || x < 1 || x > (std::int64_t{1} << 20))
      fail(exit_invalid, where + "field '" + field + "' is not an integer in [1, 2^20]");
    return x;
  };
  d.layers = *count("layers", true);
  d.tokens = count("tokens", false);
  d.kv_heads = count("kv_heads", false);
  d.head_dim = count("head_dim", false);
  if (kvc::json::Value const* rope = meta.find("rope")) {
    kvc::json::Value const* theta = rope->find("theta");
    kvc::json::Value const* style = rope->find("style");
    kvc::json::Value const* scaled = rope->find("scaled");
    if (!rope->is_object() || theta == nullptr || !theta->is_number() || !std::isfinite(theta->as_double()) ||
        !(theta->as_double() > 1.0))
      fail(exit_invalid, where + "field 'rope.theta' is missing or not a number > 1");
    kvc::RopeSpec spec;
    spec.theta = theta->as_double();
    if (style == nullptr || (style->as_string() != "neox" && style->as_string() != "interleaved"))
      fail(exit_invalid, where + "field 'rope.style' is missing or not \"neox\" or \"interleaved\"");
    spec.style = style->as_string() == "neox" ? kvc::RopeStyle::neox : kvc::RopeStyle::interleaved;
    if (scaled != nullptr && !scaled->is_bool())
      fail(exit_invalid, where + "field 'rope.scaled' is not true or false");
    d.scaled = scaled != nullptr && scaled->as_bool();
    d.rope = spec;
  }
  if (pre_rope_queries && !d.rope)
    fail(exit_invalid, where + "field 'rope' is missing: pre-RoPE queries (queries_prerope.npy) need the model's " +
                           "RoPE ({\"theta\": T, \"style\": \"neox\"}); or pass --param queries=post_rope");
  if (pre_rope_queries && d.scaled)
    fail(exit_invalid, where + "field 'rope.scaled' is true: the model's RoPE frequencies are scaled, which kvc " +
                           "cannot rebuild from theta; pass --param queries=post_rope to read each layer's " +
                           "queries.npy (the model's own post-RoPE queries)");
  return d;
}

/// A dump layer's shape: its keys' extents and the values' head dim.
struct LayerShape {
  kvc::KVExtents ext;
  kvc::Index dim_v;
};

/// Checks, after a dump layer is read, that its keys have the shape meta.json gives and the first layer's.
void check_dump_layer(Dump const& d, Job const& job, std::optional<LayerShape> const& first) {
  auto const& s = job.keys.array.shape;
  std::string const where = "keys file " + job.keys.path + ": field 'shape'";
  for (auto const& [axis, field, value] : {std::tuple{1, "kv_heads", d.kv_heads}, std::tuple{2, "tokens", d.tokens},
                                           std::tuple{3, "head_dim", d.head_dim}})
    if (value && s[static_cast<std::size_t>(axis)] != *value)
      fail(exit_invalid, where + ": " + field + " (shape[" + std::to_string(axis) + "]) is " +
                             std::to_string(s[static_cast<std::size_t>(axis)]) + ", expected " + d.meta_path() + "'s " +
                             field + " " + std::to_string(*value));
  if (!first)
    return;
  kvc::KVExtents const e = extents_of(job.keys), f = first->ext;
  auto text = [](kvc::KVExtents x, kvc::Index dv) {
    return "(" + std::to_string(x.batch) + ", " + std::to_string(x.heads) + ", " + std::to_string(x.tokens) + ", " +
           std::to_string(dv) + ")";
  };
  if (e.batch != f.batch || e.heads != f.heads || e.tokens != f.tokens || e.dim != f.dim)
    fail(exit_invalid, where + " is " + text(e, e.dim) + ", expected layer 0's " + text(f, f.dim) +
                           ": every layer of a dump has the same shape");
  kvc::Index const dv = job.values->array.shape[3];
  if (dv != first->dim_v)
    fail(exit_invalid, "values file " + job.values->path + ": field 'shape': head_dim (shape[3]) is " +
                           std::to_string(dv) + ", expected layer 0's " + std::to_string(first->dim_v) +
                           ": every layer of a dump has the same shape");
}

/// Whether --param NAME=... was given.
bool param_given(Options const& o, std::string_view name) {
  return std::any_of(o.params.begin(), o.params.end(),
                     [&](std::string const& kv) { return std::string_view(kv).substr(0, kv.find('=')) == name; });
}

}  // namespace

int cmd_compress(Options const& o) {
  bool const dump = o.has("--dump");
  if (!o.has("--policy") || !o.has("--out-dir") || (!dump && (!o.has("--keys") || !o.has("--values"))))
    fail(exit_usage, "compress needs --policy, --out-dir, and --keys and --values or --dump");
  bool const uncomp = o.has("--policy") && o.get("--policy") == "uncomp";
  bool const kivi = o.has("--policy") && o.get("--policy") == "kivi";
  bool const packed = kvc::tools::is_packed_policy(o.get("--policy"));
  if (kivi && (o.has("--ratio") || o.has("--budget")))
    fail(exit_usage,
         "policy kivi's memory is what its bits give (--param bits, group, residual): drop --ratio and "
         "--budget");
  if (!uncomp && !kivi && o.has("--ratio") == o.has("--budget"))
    fail(exit_usage, "compress needs exactly one of --ratio and --budget");
  for (char const* opt : {"--calibration", "--layer"})
    if (!uncomp && o.has(opt))
      fail(exit_usage, std::string(opt) + " goes with --policy uncomp (its calibration file and the layer)");
  if (dump)
    for (char const* opt : {"--keys", "--values", "--queries", "--positions", "--rope"})
      if (o.has(opt))
        fail(exit_usage, std::string(opt) + " given with --dump: the dump folder gives each layer's keys, values " +
                             "and queries (at positions 0 .. N - 1), and its meta.json the RoPE");
  if (!find_policy(o.get("--policy")).token_scores)
    fail(exit_usage, "policy " + o.get("--policy") +
                         " writes per-head values (kvc score), not token scores: it does not compress (UNComp's "
                         "compression is --policy uncomp)");
  CompressSettings s;
  if (packed && o.has("--allocator"))
    fail(exit_usage, "--allocator given with --policy " + o.get("--policy") +
                         ": it allocates bits per token and channel itself (no token budgets to share)");
  if (o.has("--allocator"))
    s.alloc = parse_allocators(o.get("--allocator"));
  Job setup(with_allocators(find_policy(o.get("--policy")), s.alloc));
  check_job(o, true, setup);
  std::optional<kvc::tools::UNCompConfig> uncomp_cfg;
  if (uncomp) {
    if (s.alloc.any())
      fail(exit_usage,
           "--allocator given with --policy uncomp: UNComp allocates its own per-head budgets from the "
           "calibration's head groups");
    if (!o.has("--calibration"))
      fail(exit_usage, "--policy uncomp needs --calibration FILE (`kvc-eval calibrate` writes one)");
    if (dump && o.has("--layer"))
      fail(exit_usage, "--layer given with --dump: each layer of the dump is the calibration's layer of that index");
    if (!dump && !o.has("--layer"))
      fail(exit_usage, "--policy uncomp without --dump needs --layer L (the calibration's layer of these keys)");
    uncomp_cfg = kvc::tools::uncomp_config(setup.params);
    if (uncomp_cfg->absolute() && (o.has("--ratio") || o.has("--budget")))
      fail(exit_usage, "--param schedule=" + setup.params.at("schedule") +
                           (setup.params.at("preset").empty() ? std::string() : " (a preset)") +
                           ": the budgets are absolute; drop --ratio and --budget");
    if (!uncomp_cfg->absolute() && o.has("--ratio") == o.has("--budget"))
      fail(exit_usage, "compress --policy uncomp needs exactly one of --ratio and --budget (the average budget B)");
    if (uncomp_cfg->stages)
      fail(exit_usage, "--param stages=true prunes hidden states inside the model's prefill: kvc-eval only");
    if (uncomp_cfg->rule)
      fail(exit_usage, "--param rule: the calibration file's rule holds (`kvc-eval calibrate --rule`)");
    s.ragged = true;
    if (o.has("--layer"))
      s.layer = parse_count(o.get("--layer"), "--layer");
  }
  s.ragged = s.ragged || s.alloc.any();
  if (dump && s.alloc.pyramid_kv)
    for (char const* name : {"layer", "num_layers"})
      if (param_given(o, name))
        fail(exit_usage, std::string("--param ") + name + " given with --dump: each layer's index and the layer " +
                             "count come from the dump (meta.json's layers)");
  s.ratio = o.has("--ratio") ? std::optional(parse_ratio(o.get("--ratio"))) : std::nullopt;
  s.budget = o.has("--budget") ? parse_count(o.get("--budget"), "--budget") : 0;
  s.threads = thread_count(o);
  s.time = o.time;
  // The selection's parameters (allocators' included) are checked before any file is read.
  if (setup.params.count("reference") && !packed)  // rdkv's reference (default | authors): rdkv_config below
    reference_of(setup.params);
  if (!uncomp && !packed)
    with_selection(s.alloc, setup.params, Selection{}, s.ratio, s.budget, 0, [](auto const&) {});
  std::optional<kvc::tools::RDKVConfig> rdkv_cfg;
  if (packed) {
    rdkv_cfg = kvc::tools::rdkv_config(setup.policy, setup.params);
    kvc::tools::check_rdkv_budget(*rdkv_cfg, s.ratio, s.budget);
  }
  if (is_moment_kv(setup.policy))
    moment_kv_config(setup.params);
  if (uncomp) {  // the calibration, before any tensor is read
    s.calibration_path = o.get("--calibration");
    s.calibration = kvc::tools::read_calibration(s.calibration_path);
    if (!dump && s.layer >= s.calibration->layers)
      fail(exit_invalid, "--layer " + o.get("--layer") + ": calibration file " + s.calibration_path + " has " +
                             std::to_string(s.calibration->layers) + " layers");
    if (uncomp_cfg->absolute() || o.has("--budget"))  // every layer's budgets (with --ratio: per layer, from N)
      for (kvc::Index l = 0; l < s.calibration->layers; ++l)
        kvc::tools::uncomp_budgets(*uncomp_cfg, *s.calibration, s.calibration_path, l, static_cast<double>(s.budget));
  }
  std::string const out_dir = o.get("--out-dir");
  struct stat st {};
  if (::stat(out_dir.c_str(), &st) == 0 && !S_ISDIR(st.st_mode))
    fail(exit_invalid, "--out-dir " + out_dir + " exists and is not a directory");

  // The jobs: the options' files, or every layer of the dump (each file checked to exist before any is read).
  std::optional<Dump> d;
  std::vector<JobFiles> jobs;
  std::vector<std::string> dirs;
  std::vector<NamedInput> inputs = option_inputs(o);
  if (dump) {
    d = read_dump(o.get("--dump"), setup.policy.reads_queries && setup.rotate);
    inputs.clear();
    for (kvc::Index l = 0; l < d->layers; ++l) {
      std::string const ld = d->layer_dir(l) + "/";
      JobFiles f{ld + "keys.npy", ld + "values.npy", std::string(), std::string()};
      if (setup.policy.reads_queries)
        f.queries = ld + (setup.rotate ? "queries_prerope.npy" : "queries.npy");
      for (std::string const* file : {&f.keys, &f.values, &f.queries}) {
        if (file->empty())
          continue;
        struct stat fs {};
        if (::stat(file->c_str(), &fs) != 0) {
          int const err = errno;
          fail(exit_invalid, "--dump " + d->dir + ": " + *file + ": " + std::strerror(err) + " (" + d->meta_path() +
                                 " lists " + std::to_string(d->layers) + " layers; layer " + std::to_string(l) +
                                 " has no " + file->substr(ld.size()) + ")");
        }
        inputs.emplace_back("--dump input", *file);
      }
      jobs.push_back(f);
      dirs.push_back(out_dir + "/layer" + std::to_string(l));
    }
  } else {
    jobs.push_back(option_files(o));
    dirs.push_back(out_dir);
  }
  std::vector<std::string> outputs;
  for (std::string const& dir : dirs) {
    if (packed) {
      for (char const* name : packed_outputs)
        outputs.push_back(dir + "/" + name);
      continue;
    }
    for (char const* name : compress_outputs)
      outputs.push_back(dir + "/" + name);
    if (s.ragged)
      for (char const* name : ragged_outputs)
        outputs.push_back(dir + "/" + name);
    if (is_moment_kv(setup.policy))
      for (char const* name : moment_outputs)
        outputs.push_back(dir + "/" + name);
  }
  check_outputs(inputs, outputs, "output file");

  std::vector<std::string> made;  // the folders this call creates, removed again if the outputs cannot be written
  Staged staged;
  std::vector<Timing> timings;
  std::optional<LayerShape> first;  // layer 0's shape
  try {
    for (std::size_t i = 0; i < jobs.size(); ++i) {
      Job job(setup.policy);
      job.params = setup.params;
      job.rope = d && d->rope ? *d->rope : setup.rope;
      job.rotate = setup.rotate;
      job.k_scale = setup.k_scale;
      job.v_scale = setup.v_scale;
      if (d && s.alloc.pyramid_kv) {  // PyramidKV's schedule: this layer of the dump's
        job.params["layer"] = std::to_string(i);
        job.params["num_layers"] = std::to_string(d->layers);
      }
      load_job(jobs[i], job);
      if (d)
        check_dump_layer(*d, job, first);
      kvc::KVExtents const loaded = extents_of(job.keys);
      if (uncomp) {
        kvc::KVExtents const ke = loaded;
        kvc::tools::check_calibration_fits(
            *s.calibration, s.calibration_path, d ? d->layers : 0, job.queries.ext.heads, ke.heads, ke.dim,
            d ? "--dump " + d->dir : "keys file " + job.keys.path + " / queries file " + job.queries.path);
        if (d)
          s.layer = static_cast<kvc::Index>(i);
        if (uncomp_cfg->gqa == kvc::tools::UNCompGqa::expand && job.queries.ext.heads != ke.heads) {
          expand_heads(job.keys, job.queries.ext.heads);
          expand_heads(*job.values, job.queries.ext.heads);
        }
      }
      if (packed) {
        PackedCompressed const pc = compress_packed(job, s, *rdkv_cfg);
        make_folders(dirs[i], made);
        stage_outputs(pc.outputs(dirs[i]), staged);
        timings.push_back(pc.timing);
        if (!first)
          first = LayerShape{loaded, job.values->array.shape[3]};
        continue;
      }
      Compressed c = compress_job(job, s);
      make_folders(dirs[i], made);
      stage_outputs(c.outputs(dirs[i], s.ragged), staged);
      timings.push_back(c.timing);
      if (!first)
        first = LayerShape{loaded, c.dim_v};  // as read (gqa=expand's outputs are per query head)
    }
    commit_outputs(staged);
  } catch (Failure const&) {
    staged.files.clear();  // the temporaries go first, then the folders that held them
    for (auto folder = made.rbegin(); folder != made.rend(); ++folder)  // deepest first; each is empty
      ::rmdir(folder->c_str());
    throw;
  }
  if (s.time) {
    std::string const alloc = s.alloc.any() ? s.alloc.name() : std::string();
    Timing total = timings.front();
    total.memory = Memory{};
    total.seconds = total.select_seconds = 0;
    total.bytes_read = total.workspace_bytes = total.state_bytes = 0;
    for (std::size_t i = 0; i < timings.size(); ++i) {
      Timing const& t = timings[i];
      print_time("compress", setup.policy, alloc,
                 d ? std::optional(std::pair{"layer", static_cast<kvc::Index>(i)}) : std::nullopt, t);
      total.seconds += t.seconds;
      total.select_seconds += t.select_seconds;
      total.bytes_read += t.bytes_read;
      total.workspace_bytes = std::max(total.workspace_bytes, t.workspace_bytes);
      total.state_bytes += t.state_bytes;
      *total.memory += *t.memory;
    }
    if (d)
      print_time("compress", setup.policy, alloc, std::pair{"layers", d->layers}, total);
  }
  return 0;
}

}  // namespace kvc::cli
