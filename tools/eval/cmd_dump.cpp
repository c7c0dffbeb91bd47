// SPDX-License-Identifier: Apache-2.0
// tools/eval/cmd_dump.cpp: `kvc-eval dump`: every layer's keys, values and queries of a token file as .npy, with
// meta.json (what `kvc compress --dump DIR` reads: tools/kvc/cli.cpp).
#include "eval/cli.hpp"
#include "eval/json_out.hpp"
#include "io/npy.hpp"

#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

namespace kvc::eval::cli {

void declare_dump(Options& o) {
  o.describe("Every layer's K, V and Q of a token file, as kvc reads them (kvc compress --dump DIR).",
             "Writes D/tokens.npy (int64), D/layer<L>/keys.npy, values.npy [1, kv_heads, tokens, head_dim] (keys "
             "post-RoPE),\nqueries.npy (post-RoPE) and queries_prerope.npy [1, query_heads, tokens, head_dim] "
             "(float32), D/meta.json\n(the shapes and the model's RoPE) and D/story.txt when the model has a "
             "tokenizer; all whole or none.");
  o.option("--model", "DIR", "the model", true);
  o.option("--tokens", "T.npy", "the tokens: a 1-D int32 or int64 array, at most the model's context", true);
  o.option("--out-dir", "D", "the folder to write (created if absent)", true);
}

namespace {

/// meta.json: the dump's shapes, the model's RoPE and the files' layout (read by kvc's --dump).
std::string meta_json(std::string const& model_path, ModelConfig const& c, Index tokens) {
  OrderedJson meta;
  meta["model"] = model_path;
  meta["format"] = c.format;
  meta["tokens"] = tokens;
  meta["layers"] = c.layers;
  meta["query_heads"] = c.heads;
  meta["kv_heads"] = c.kv_heads;
  meta["head_dim"] = c.head_dim;
  meta["rope"] = {{"theta", json_number(c.rope_theta)},
                  {"style", c.rope_style == kvc::RopeStyle::neox ? "neox" : "interleaved"},
                  {"scaled", !c.inv_freq.empty()}};
  meta["files"] =
      "layer<L>/keys.npy, values.npy [1, kv_heads, tokens, head_dim] (keys post-RoPE), queries.npy (post-RoPE) and "
      "queries_prerope.npy [1, query_heads, tokens, head_dim], float32; tokens.npy int64";
  return json_text(meta, 2) + "\n";
}

}  // namespace

int command_dump(Options const& o) {
  std::string const model_path = o.get("--model");
  auto const model = load_model(model_path);
  auto const tokens = load_tokens(o.get("--tokens"), model.config.vocab, model.config.context);
  std::string const dir = o.get("--out-dir");
  ModelConfig const& c = model.config;
  Index const n = static_cast<Index>(tokens.size()), d = c.head_dim;
  // An fp32 dense session: its cache holds exactly the post-RoPE keys and the values (no rounding).
  auto session = make_session(model, {CacheType::f32, CacheLayout::dense}, n);
  RowMatrix logits;
  ForwardTrace trace;
  trace.projections = true;
  if (auto const st = session->forward(tokens, logits, &trace); !st.ok())
    kvc::tools::fail(kvc::tools::exit_invalid, std::string("forward: ") + st.message());
  make_directory(dir);
  Outputs files;
  Index const kv_shape[4] = {1, c.kv_heads, n, d}, q_shape[4] = {1, c.heads, n, d}, t_shape[1] = {n};
  std::vector<std::int64_t> ids(tokens.begin(), tokens.end());
  files.add(dir + "/tokens.npy", kvc::serialize_npy(kvc::NpyDtype::i64, t_shape, ids.data()));
  auto const& layers = trace.qkv;
  for (std::size_t l = 0; l < layers.size(); ++l) {
    std::string const ld = dir + "/layer" + std::to_string(l);
    make_directory(ld);
    files.add(ld + "/keys.npy", kvc::serialize_npy(kvc::NpyDtype::f32, kv_shape, layers[l].keys.data()));
    files.add(ld + "/values.npy", kvc::serialize_npy(kvc::NpyDtype::f32, kv_shape, layers[l].values.data()));
    files.add(ld + "/queries.npy", kvc::serialize_npy(kvc::NpyDtype::f32, q_shape, layers[l].queries.data()));
    files.add(ld + "/queries_prerope.npy",
              kvc::serialize_npy(kvc::NpyDtype::f32, q_shape, layers[l].queries_prerope.data()));
  }
  files.add(dir + "/meta.json", meta_json(model_path, c, n));
  if (auto tok = load_tokenizer(model)) {  // the text without its BOS (llama2.c's decoder renders it as "\n<s>\n")
    std::span<std::int32_t const> text(tokens);
    if (!text.empty() && text.front() == c.bos)
      text = text.subspan(1);
    files.add(dir + "/story.txt", tok->decode(text) + "\n");
  }
  files.commit();
  std::printf("kvc-eval dump: %lld tokens, %lld layers written to %s\n", static_cast<long long>(n),
              static_cast<long long>(c.layers), dir.c_str());
  return 0;
}

}  // namespace kvc::eval::cli
