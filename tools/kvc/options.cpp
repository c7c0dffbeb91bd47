// SPDX-License-Identifier: Apache-2.0
// tools/kvc/options.cpp: kvc's commands and options (options.hpp): the table, CLI11 parsing, generated --help.
#include "options.hpp"

#include "common/policies.hpp"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstddef>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace kvc::cli {

using kvc::tools::exit_usage;
using kvc::tools::fail;

char const* const overview_text =
    "kvc: score and compress .npy or .safetensors KV-cache dumps with kvc's policies.\n"
    "usage:\n"
    "  kvc score    --policy NAME [--param NAME=VALUE]... --keys K.npy [--queries Q.npy] --out scores.npy\n"
    "  kvc score    --policy uncomp_entropy [--param NAME=VALUE]... --queries Q.npy --out E.npy   per-head\n"
    "               truncated matrix entropies [B, Hq] (UNComp; calibration files: `kvc-eval calibrate`)\n"
    "  kvc compress --policy NAME (--ratio R | --budget N) [--allocator A] [--param NAME=VALUE]...\n"
    "               (--keys K.npy --values V.npy [--queries Q.npy] | --dump DIR) --out-dir DIR\n"
    "  kvc attend   --keys K.npy --values V.npy --queries Q.npy [--indices I.npy] [--moments DIR]\n"
    "               [--param NAME=VALUE]... --out-dir DIR   attention over a (compressed) cache, plain and\n"
    "               corrected by MomentKV's moments\n"
    "  kvc policies        every policy and allocator with its parameters and defaults\n"
    "  kvc COMMAND --help  the options of one command\n"
    "Keys and values are [B, Hkv, N, d] float32 or float16 .npy (C order), post-RoPE as an engine caches them, or\n"
    "a tensor of a .safetensors file (FILE.safetensors:TENSOR, or FILE.safetensors holding one tensor; F32, F16,\n"
    "BF16, or the fp8 caches F8_E4M3 and F8_E5M2 with --k-scale / --v-scale). Outputs are .npy.\n"
    "Exit codes: 0 success, 2 usage error, 3 invalid input (the message names the file, the field and what was\n"
    "expected).\n";

namespace {

// The inputs score and compress share (attend describes its own: its queries are post-RoPE by default).
OptionDoc const policy_option{"--policy", "NAME", "a policy from `kvc policies`"};
OptionDoc const param_option{"--param", "NAME=VALUE",
                             "a parameter of the policy (repeatable); names the policy does not have are rejected"};
OptionDoc const keys_option{"--keys", "K.npy",
                            "[B, Hkv, N, d] float32 or float16, C order, post-RoPE as an engine caches them;\n"
                            "slot t holds position t. Every input may instead be FILE.safetensors:TENSOR (split\n"
                            "at the last ':' after \".safetensors\"), or FILE.safetensors when it holds one\n"
                            "tensor; F32, F16 or BF16 (I64 for --positions); keys and values also F8_E4M3 or\n"
                            "F8_E5M2 (an fp8 cache; kept rows are written as their float32 values)"};
OptionDoc const values_option{"--values", "V.npy", "[B, Hkv, N, d_v], the keys' dtype"};
OptionDoc const k_scale_option{"--k-scale", "S",
                               "fp8 keys: each element's value is decode(byte) * S (vLLM's k_scale; default 1)"};
OptionDoc const v_scale_option{"--v-scale", "S", "fp8 values: likewise (vLLM's v_scale; default 1)"};
OptionDoc const queries_option{"--queries", "Q.npy",
                               "[B, Hq, w, d] float32 or float16 (Hq a multiple of Hkv; query head q reads KV head\n"
                               "q / (Hq / Hkv)): the last w queries of the context. Required by the policies that\n"
                               "read queries (snap_kv, tova), rejected by the others. Pre-RoPE unless\n"
                               "--param queries=post_rope"};
OptionDoc const positions_option{"--positions", "P.npy",
                                 "int64 [B, w]: each query's absolute position, for RoPE and the causal mask\n"
                                 "(default: the context's last w positions, N - w + i)"};
OptionDoc const rope_option{"--rope", "theta=T,style=S",
                            "the RoPE that rotates pre-RoPE queries (default theta=10000,style=neox); style neox\n"
                            "(rotate-half: Hugging Face Llama, Qwen, Mistral) or interleaved (GPT-J, llama.cpp);\n"
                            "rejected with --param queries=post_rope"};
OptionDoc const threads_option{"--threads", "N",
                               "worker threads over (sequence, KV head) items, over sequences for tova (default 1;\n"
                               "results do not depend on it)"};
OptionDoc const out_dir_option{"--out-dir", "DIR", "created if absent"};

/// The input options score and compress share, then the command's own.
std::vector<OptionDoc> with_inputs(std::initializer_list<OptionDoc> own) {
  std::vector<OptionDoc> all = {policy_option,  param_option,   keys_option,      values_option, k_scale_option,
                                v_scale_option, queries_option, positions_option, rope_option};
  all.insert(all.end(), own.begin(), own.end());
  return all;
}

char const* const exit_codes = "Exit codes: 0 success, 2 usage error, 3 invalid input.\n";

}  // namespace

std::vector<CommandInfo> const& commands() {
  static std::string const policies_line =
      "Policies: " + kvc::tools::policy_names() + " (parameters: `kvc policies`).\n" + exit_codes;
  static std::string const compress_footer = "Policies: " + kvc::tools::policy_names() +
                                             " (parameters: `kvc policies`).\n"
                                             "Allocators: ada_kv, pyramid_kv, pyramid_kv+ada_kv (parameters: `kvc "
                                             "policies`).\n" +
                                             exit_codes;
  static std::vector<CommandInfo> const list = {
      {"score",
       "usage: kvc score --policy NAME [--param NAME=VALUE]... --keys K.npy [--values V.npy]\n"
       "                 [--queries Q.npy [--positions P.npy] [--rope theta=T,style=neox|interleaved]]\n"
       "                 --out scores.npy [--time] [--threads N]\n"
       "       kvc score --policy uncomp_entropy [--param NAME=VALUE]... --queries Q.npy [--positions P.npy]\n"
       "                 [--rope theta=T,style=neox|interleaved] --out E.npy [--time]\n"
       "       kvc score --policy rdkv [--param NAME=VALUE]... --keys K.npy [--values V.npy] --queries Q.npy\n"
       "                 --out W.npy [--channel-out C.npy] [--time] [--threads N]\n",
       "Scores every cached token with a policy: writes [B, Hkv, N] float32, higher = keep.\n"
       "With --policy rdkv: RDKV's token weights [B, Hkv, N] (the distortion weight of each V token; --values with\n"
       "--param weight=derived) and, with --channel-out, ThinK's channel weights [B, Hkv, d] (mean over the group's\n"
       "window queries of q_c^2 times mean over the tokens of k_c^2), both float32 (kivi has no scores).\n"
       "With --policy uncomp_entropy (no --keys): UNComp's truncated matrix entropy of each query head's rows of\n"
       "--queries [B, Hq, n, d] (pre-RoPE ones rotated to --positions, default 0 .. n - 1), written as [B, Hq]\n"
       "(--param unit=normalized|truncated|erank, dtype=float64|float32; head_dim at most 1024).\n",
       with_inputs({{"--out", "scores.npy", "the scores"},
                    {"--channel-out", "C.npy", "--policy rdkv: the channel weights [B, Hkv, d] too"},
                    {"--time", "",
                     "print one JSON line to stderr: {\"command\", \"policy\", \"seconds\" (scoring, median of\n"
                     "7 calls, file I/O excluded), \"repeats\", \"bytes_read\" (K and Q bytes read per scoring\n"
                     "call), \"workspace_bytes\" (kvc's scratch for those calls), \"threads\", \"isa\" (the\n"
                     "instruction set kvc's kernels were compiled for, e.g. avx2+fma+f16c)}"},
                    threads_option}),
       policies_line.c_str()},
      {"compress",
       "usage: kvc compress --policy NAME (--ratio R | --budget N) [--allocator ada_kv|pyramid_kv|pyramid_kv+ada_kv]\n"
       "                    [--param NAME=VALUE]... (--keys K.npy --values V.npy [--queries Q.npy\n"
       "                    [--positions P.npy] [--rope theta=T,style=S]] | --dump DIR) --out-dir DIR [--time]\n"
       "                    [--threads N]\n"
       "       kvc compress --policy uncomp --calibration calib.json [--ratio R | --budget B] [--param NAME=VALUE]...\n"
       "                    (--keys K.npy --values V.npy --queries Q.npy --layer L | --dump DIR) --out-dir DIR\n",
       "Keeps the best-scored tokens of each (sequence, KV head) and writes, in DIR: keys.npy and values.npy\n"
       "([B, Hkv, n_kept, d], input dtype; n_kept the longest head's count), indices.npy (int64 [B, Hkv, n_kept],\n"
       "ascending, -1 padding where heads keep different counts) and counts.npy (int64 [B, Hkv]); with --allocator\n"
       "also the ragged store that holds exactly each head's kept tokens: ragged_keys.npy [rows, d],\n"
       "ragged_values.npy [rows, d_v] (rows = the sum of the counts) and offsets.npy (int64 [B * Hkv + 1]: head\n"
       "b * Hkv + h holds rows offsets[i] .. offsets[i + 1] - 1). With --policy moment_kv also the moments of\n"
       "each head's evicted set: moment_count.npy (int64 [B, Hkv]), moment_key_mean.npy [B, Hkv, d],\n"
       "moment_value_mean.npy [B, Hkv, d_v] and moment_comoment.npy [B, Hkv, d_v, d] (float32, or float16 with\n"
       "--param storage=fp16; bf16 storage is written as float32), which `kvc attend --moments` reads.\n"
       "With --policy rdkv (--budget N: N fp16-equivalent tokens of memory per head, 2 N d 16 bits for K + V; --ratio\n"
       "R: floor(N_tokens (1 - R)) of them) or --policy kivi (neither: its memory is what its bits give): the bit\n"
       "plans instead, v_bits.npy (int8 [B, Hkv, N]: each token's V bits, 0 = evicted) and k_bits.npy (int8\n"
       "[B, Hkv, d]: each channel's K bits, 0 = pruned), bits in {0, 2, 4, 8, 16}; the cache is packed\n"
       "to measure its memory (--time). Every policy runs through its kvc::LayerCompressor, as in an engine.\n"
       "All files are written, or none.\n",
       with_inputs({{"--ratio", "R", "the fraction of tokens removed, in [0, 1]: kept = floor(N * (1 - R))"},
                    {"--budget", "N", "tokens kept per head"},
                    {"--allocator", "A",
                     "ada_kv (head-adaptive budgets inside a layer), pyramid_kv (per-layer budgets)\n"
                     "or pyramid_kv+ada_kv, over any policy's scores; their parameters are --param\n"
                     "too (`kvc policies`; reference=kvpress sets the policy's and the allocator's)"},
                    {"--dump", "DIR",
                     "every layer of a `kvc-eval dump` folder (meta.json, layer<L>/keys.npy,\n"
                     "values.npy, queries_prerope.npy or, with --param queries=post_rope,\n"
                     "queries.npy) instead of --keys/--values/--queries; RoPE from meta.json;\n"
                     "pyramid_kv's layer and num_layers from the dump; outputs in --out-dir's layer<L>/"},
                    out_dir_option,
                    {"--calibration", "FILE",
                     "--policy uncomp: the calibration file `kvc-eval calibrate` writes; each layer's\n"
                     "per-head budgets come from its head groups (average B = --budget, or\n"
                     "floor(N * (1 - R)) with --ratio; neither with --param schedule=paper or list).\n"
                     "Writes the ragged store too; with --param gqa=expand every output is per query head"},
                    {"--layer", "L", "--policy uncomp without --dump: the calibration's layer of these keys"},
                    {"--time", "",
                     "one JSON line on stderr: \"seconds\" (the policy's compressor: reset + prefill,\n"
                     "median of 7, each over the original input), \"workspace_bytes\" and\n"
                     "\"state_bytes\" (the compressor's), then the memory, \"threads\" and \"isa\".\n"
                     "Memory: \"input_bytes\" (K + V of the input), \"padded_bytes\" (a uniform cache padded to\n"
                     "the longest head: what keys.npy and values.npy hold), \"ragged_bytes\" (the\n"
                     "ragged store), \"row_bytes\" (one token's K + V row), \"input_tokens\",\n"
                     "\"kept_tokens\", in the input dtype; with --dump one line per layer and a total;\n"
                     "moment_kv adds \"moment_bytes\" (the moments, all heads, in the storage\n"
                     "dtype), \"moment_head_bytes\" and \"moment_ratio\" (moment_bytes / ragged_bytes);\n"
                     "rdkv and kivi: \"input_bytes\", \"input_tokens\", \"kept_tokens\" (packed + tail),\n"
                     "\"tail_tokens\" (the fp16 residual), \"payload_bits\" (codes + fp16 values, tail\n"
                     "included), \"overhead_bits\" (scales, offsets, pads, channel permutation),\n"
                     "\"payload_bytes\", \"overhead_bytes\", \"packed_bytes\" (their sum), \"state_bytes\"\n"
                     "(the compressor's state: the packed store as reserved) and \"retention\"\n"
                     "(payload / (2 N d 16))"},
                    threads_option}),
       compress_footer.c_str()},
      {"attend",
       "usage: kvc attend --keys K.npy --values V.npy --queries Q.npy [--positions P.npy] [--rope theta=T,style=S]\n"
       "                  [--indices I.npy] [--moments DIR] [--param NAME=VALUE]... --out-dir DIR [--time]\n"
       "                  [--threads N]\n",
       "Attention of the queries over a cache (kvc::attend), e.g. one `kvc compress` wrote, and with --moments\n"
       "MomentKV's normalisation-corrected attention (kvc::attend_corrected): the evicted set of each KV head\n"
       "enters as one virtual token of log-weight log n + c q.k_mean and value v_mean + (c / n) C q. Writes, in\n"
       "DIR: out.npy (float32 [B, Hq, n, d_v]) and lse.npy (float32 [B, Hq, n], the softmax's log-sum-exp,\n"
       "-inf for a query that sees nothing); with --moments out.npy and lse.npy are the corrected ones and\n"
       "plain_out.npy and plain_lse.npy the uncorrected. All files are written, or none.\n",
       {{"--keys", "K.npy",
         "[B, Hkv, N, d] float32 or float16 (or a .safetensors tensor, also BF16, F8_E4M3\n"
         "and F8_E5M2)"},
        values_option,
        {"--k-scale", "S", "fp8 keys: each element's value is decode(byte) * S (default 1)"},
        {"--v-scale", "S", "fp8 values: likewise (default 1)"},
        {"--queries", "Q.npy",
         "[B, Hq, n, d]: POST-RoPE by default (as the attention sees them); with --rope or\n"
         "--param queries=pre_rope they are rotated to their positions first"},
        {"--positions", "P.npy",
         "int64 [B, n]: each query's position, for the causal mask (and RoPE); default:\n"
         "the cache's last n positions (context_end - n + i)"},
        {"--rope", "theta=T,style=S", "the RoPE of pre-RoPE queries (neox or interleaved); implies queries=pre_rope"},
        {"--indices", "I.npy",
         "int64 [B, Hkv, N]: each slot's original position, ascending, -1 padding after a\n"
         "head's count (compress's indices.npy); default: slot t at position t, all full"},
        {"--moments", "DIR", "the four moment_*.npy files `kvc compress --policy moment_kv` writes"},
        {"--param", "NAME=VALUE",
         "order=first: first (f_E = v_mean + (c / n) C q) or zeroth (f_E = v_mean); with --moments\n"
         "clamp_tau=1e-6: entries of C below tau in magnitude read as 0; with --moments\n"
         "scale=0: the logit scale c; 0: 1 / sqrt(d)\n"
         "queries=post_rope: post_rope or pre_rope (rotated with --rope, default\n"
         "theta=10000,style=neox)"},
        out_dir_option,
        {"--threads", "N", "worker threads over (sequence, KV head) items (default 1)"},
        {"--time", "",
         "one JSON line on stderr: \"seconds\" (kvc::attend, median of 7 calls),\n"
         "\"corrected_seconds\" (kvc::attend_corrected), \"repeats\", \"bytes_read\",\n"
         "\"workspace_bytes\", \"moment_bytes\", \"threads\", \"isa\""}},
       exit_codes},
      {"policies",
       "usage: kvc policies\n",
       "Lists every policy with every parameter (--param NAME=DEFAULT) and what it reads, then the allocators\n"
       "(compress --allocator) with theirs.\n",
       {},
       ""},
  };
  return list;
}

CommandInfo const* find_command(std::string_view name) {
  for (auto const& c : commands())
    if (name == c.name)
      return &c;
  return nullptr;
}

namespace {

/// --help as CLI11 lays options out (the name and placeholder in a 25-column field, continuation lines indented to
/// it), framed by kvc's synopsis, description and footer.
class HelpFormatter : public CLI::Formatter {
 public:
  explicit HelpFormatter(CommandInfo const& command) : command_(command) { column_width(25); }
  std::string make_help(CLI::App const* app, std::string, CLI::AppFormatMode mode) const override {
    return std::string(command_.synopsis) + command_.intro + make_groups(app, mode) + command_.footer;
  }

 private:
  CommandInfo const& command_;
};

/// The command's CLI11 parser: each option collects its values into `given` (by name); --help is handled before
/// parsing (it wins over every error). Unknown arguments stay in app.remaining() for kvc's own messages.
void declare(CLI::App& app, CommandInfo const& command, std::map<std::string, std::vector<std::string>>& given,
             bool& time) {
  app.set_help_flag();
  app.allow_extras();
  app.formatter(std::make_shared<HelpFormatter>(command));
  for (OptionDoc const& o : command.options) {
    if (*o.value == '\0') {  // the one flag, --time (a new flag needs its own field in Options)
      if (std::string_view(o.name) != "--time")
        throw std::logic_error(std::string("kvc: flag ") + o.name + " has no field in Options");
      app.add_flag(o.name, time, o.help);
      continue;
    }
    app.add_option(o.name, given[o.name], o.help)
        ->option_text(o.value)
        ->expected(1)
        ->allow_extra_args(false)  // one value per occurrence: a stray word after it is an unknown argument
        ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  }
}

bool is_option_of_some_command(std::string_view name) {
  for (auto const& c : commands())
    for (OptionDoc const& o : c.options)
      if (name == o.name)
        return true;
  return false;
}

}  // namespace

std::string help_text(CommandInfo const& command) {
  CLI::App app{"", std::string("kvc ") + command.name};
  std::map<std::string, std::vector<std::string>> given;
  bool time = false;
  declare(app, command, given, time);
  return app.help();
}

Options parse_args(int argc, char const* const* argv) {
  if (argc < 2)
    fail(exit_usage, "missing command");
  std::string const name = argv[1];
  Options o;
  if (name == "--help" || name == "-h" || name == "help") {
    o.help = true;
    o.command = argc > 2 ? find_command(argv[2]) : nullptr;
    return o;
  }
  o.command = find_command(name);
  if (o.command == nullptr)
    fail(exit_usage, "unknown command '" + name + "'");
  for (int i = 2; i < argc; ++i)
    if (std::string_view(argv[i]) == "--help" || std::string_view(argv[i]) == "-h")
      o.help = true;
  if (o.help)
    return o;
  CLI::App app{"", "kvc " + name};
  std::map<std::string, std::vector<std::string>> given;
  declare(app, *o.command, given, o.time);
  try {
    app.parse(argc - 1, argv + 1);  // argv[1], the command, stands in for the program name
  } catch (CLI::ArgumentMismatch const& e) {
    // CLI11 names the option first ("--out: 1 required TEXT missing"): say it as kvc always has.
    std::string const what = e.what();
    std::string const option = what.substr(0, what.find(':'));
    fail(exit_usage, option.rfind("--", 0) == 0 ? option + " needs a value" : what);
  } catch (CLI::ParseError const& e) {
    fail(exit_usage, e.what());
  }
  if (auto const rest = app.remaining(); !rest.empty()) {
    std::string const arg = rest.front();
    std::string const option = arg.substr(0, arg.find('='));
    if (option.rfind("--", 0) == 0 && is_option_of_some_command(option))
      fail(exit_usage, option + " is not an option of `kvc " + name + "`");
    fail(exit_usage, "unknown argument '" + arg + "'");
  }
  for (auto& [option, values] : given) {
    if (values.empty())
      continue;
    if (option == "--param") {
      o.params = std::move(values);
    } else {
      if (values.size() > 1)
        fail(exit_usage, option + " given twice");
      o.values.emplace(option, std::move(values.front()));
    }
  }
  return o;
}

}  // namespace kvc::cli
