// SPDX-License-Identifier: Apache-2.0
// tools/eval/cmd_logits.cpp: `kvc-eval logits`: the model's logits of a token file, as .npy (the oracle comparison's
// input: tools/reference/eval_vectors.py).
#include "eval/cli.hpp"
#include "io/npy.hpp"

#include <string>

namespace kvc::eval::cli {

void declare_logits(Options& o) {
  o.describe("The logits [tokens, vocab] (float32 .npy) of a token file, one forward pass from position 0.",
             "TYPE: the KV cache's element type: fp32 (the default), fp16, bf16, fp8_e4m3 or fp8_e5m2.\n"
             "DIR: a Hugging Face Llama directory or a llama2.c checkpoint (see kvc-eval run --help, docs/eval.md).");
  o.option("--model", "DIR", "the model", true);
  o.option("--tokens", "T.npy", "the tokens: a 1-D int32 or int64 array, at most the model's context", true);
  o.option("--out", "L.npy", "where to write the logits (written whole or not at all)", true);
  o.option("--cache", "TYPE", "the KV cache's element type (default fp32)");
  o.option("--layout", "dense|paged", "the KV cache's layout (default dense)");
}

int command_logits(Options const& o) {
  auto const model = load_model(o.get("--model"));
  auto const tokens = load_tokens(o.get("--tokens"), model.config.vocab, model.config.context);
  std::string const out = o.get("--out");
  auto session = make_session(model, cache_options(o, "fp32"), static_cast<Index>(tokens.size()));
  RowMatrix logits;
  if (auto const st = session->forward(tokens, logits); !st.ok())
    kvc::tools::fail(kvc::tools::exit_invalid, std::string("forward: ") + st.message());
  Index const shape[2] = {logits.rows(), logits.cols()};
  Outputs files;
  files.add(out, kvc::serialize_npy(kvc::NpyDtype::f32, shape, logits.data()));
  files.commit();
  return 0;
}

}  // namespace kvc::eval::cli
