// SPDX-License-Identifier: Apache-2.0
// tools/fuzz/cli_fuzz.cpp: libFuzzer harness for the whole `kvc` path: parse -> validate -> score -> select ->
// compact -> write, on small fuzzed files (keys, values, queries, positions) and fuzzed options; MomentKV's score and
// compress (with its moments) and `kvc attend` (fuzzed --indices and --moments files) included.
//   cmake -DCMAKE_CXX_COMPILER=clang++ -DKVC_BUILD_FUZZERS=ON ... && ./tools/kvc_cli_fuzz -max_total_time=60
//
// Each input chooses a command, a policy with parameters, and each file either as raw bytes (the parser's hostile
// side) or as a well-formed header of a fuzzed dtype and small shape over fuzzed data (so that runs reach the
// scorers, the selection and the writers with NaN, Inf, huge and tiny values and mismatched shapes). Beyond "no
// crash, no sanitizer report", every run must keep the contract (docs/cli.md):
//   - the exit code is 0, or 3 with one "kvc: error: " line (never 2: the options are well formed);
//   - exit 0 writes every output, each a .npy file of the documented shape (moment_kv: each head's kept and evicted
//     counts add up to N; attend: finite outputs); exit 3 writes none;
//   - no temporary file is left behind, and the inputs are unchanged.

#include "cli.hpp"
#include "io/npy.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using kvc::Index;

/// Reads the fuzz input front to back; past the end it yields zeros.
struct Bytes {
  std::uint8_t const* data;
  std::size_t size;
  std::size_t pos = 0;

  std::uint8_t u8() { return pos < size ? data[pos++] : 0; }
  std::vector<std::byte> take(std::size_t n) {
    n = std::min(n, size - pos);
    std::vector<std::byte> out(n);
    if (n > 0)
      std::memcpy(out.data(), data + pos, n);
    pos += n;
    return out;
  }
};

[[noreturn]] void violated(char const* what, std::string const& detail = {}) {
  std::fprintf(stderr, "cli_fuzz: contract violated: %s %s\n", what, detail.c_str());
  std::abort();
}

/// The folder the harness works in: on tmpfs when there is one (outputs are fsync'ed).
fs::path const& work_dir() {
  static fs::path const dir = [] {
    std::string base = fs::exists("/dev/shm") ? "/dev/shm" : fs::temp_directory_path().string();
    std::string templ = base + "/kvc_cli_fuzz.XXXXXX";
    if (::mkdtemp(templ.data()) == nullptr)
      violated("cannot create the work folder");
    static std::string const made = templ;
    std::atexit([] {
      std::error_code ec;
      fs::remove_all(made, ec);
    });
    return fs::path(templ);
  }();
  return dir;
}

void write_file(fs::path const& path, std::vector<std::byte> const& bytes) {
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<char const*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

std::vector<std::byte> read_file(fs::path const& path) {
  std::ifstream f(path, std::ios::binary);
  std::vector<char> const c{std::istreambuf_iterator<char>(f), {}};
  std::vector<std::byte> out(c.size());
  if (!c.empty())
    std::memcpy(out.data(), c.data(), c.size());
  return out;
}

kvc::NpyArray read_output(fs::path const& path) {
  kvc::NpyArray a;
  std::string error;
  if (!kvc::read_npy(path.string(), a, error))
    violated("an output does not read back:", path.string() + ": " + error);
  return a;
}

/// Exit 0 of moment_kv's compress: the moments have the documented shapes, and per head the kept and the evicted
/// tokens add up to N.
void check_moments(fs::path const& dir, kvc::NpyArray const& keys, kvc::NpyArray const& counts) {
  std::vector<Index> const& k = keys.shape;
  kvc::NpyArray const n = read_output(dir / "out" / "moment_count.npy"),
                      km = read_output(dir / "out" / "moment_key_mean.npy"),
                      vm = read_output(dir / "out" / "moment_value_mean.npy"),
                      cm = read_output(dir / "out" / "moment_comoment.npy");
  if (n.dtype != kvc::NpyDtype::i64 || n.shape != std::vector<Index>{k[0], k[1]})
    violated("moment_count.npy is not int64 [B, H]");
  if (km.shape != std::vector<Index>{k[0], k[1], k[3]} || vm.shape.size() != 3 || cm.shape.size() != 4 ||
      cm.shape[2] != vm.shape[2] || cm.shape[3] != k[3] || km.dtype != vm.dtype || km.dtype != cm.dtype ||
      (km.dtype != kvc::NpyDtype::f32 && km.dtype != kvc::NpyDtype::f16))
    violated("the moments are not [B, H, d], [B, H, d_v], [B, H, d_v, d] of one float dtype");
  for (Index bh = 0; bh < k[0] * k[1]; ++bh)
    if (n.as<std::int64_t>()[bh] + counts.as<std::int64_t>()[bh] != k[2])
      violated("a head's kept and evicted counts do not add up to N");
}

/// Exit 0 of attend: out.npy float32 [B, Hq, n, d_v] and lse.npy float32 [B, Hq, n] (and the plain ones with
/// --moments), the output finite.
void check_attend(fs::path const& dir, kvc::NpyArray const& queries, kvc::NpyArray const& values, bool moments) {
  std::vector<Index> const& q = queries.shape;
  for (char const* name : {"out.npy", "plain_out.npy"}) {
    if (!moments && name[0] == 'p')
      continue;
    kvc::NpyArray const o = read_output(dir / "out" / name);
    if (o.dtype != kvc::NpyDtype::f32 || o.shape != std::vector<Index>{q[0], q[1], q[2], values.shape[3]})
      violated("an attention output is not float32 [B, Hq, n, d_v]:", name);
    for (Index i = 0; i < o.size(); ++i)
      if (!std::isfinite(o.as<float>()[i]))
        violated("an attention output is not finite:", name);
  }
  for (char const* name : {"lse.npy", "plain_lse.npy"}) {
    if (!moments && name[0] == 'p')
      continue;
    kvc::NpyArray const l = read_output(dir / "out" / name);
    if (l.dtype != kvc::NpyDtype::f32 || l.shape != std::vector<Index>{q[0], q[1], q[2]})
      violated("a log-sum-exp output is not float32 [B, Hq, n]:", name);
  }
}

/// Exit 0: the outputs have the documented shapes for keys [B, H, N, d] and values [B, H, N, d_v]: scores
/// float32 [B, H, N]; or counts int64 [B, H] in [0, N], indices int64 [B, H, n_kept] ascending in [0, N) then -1,
/// keys and values [B, H, n_kept, d] in the input dtype.
void check_outputs(bool compress, bool allocator, fs::path const& dir, kvc::NpyArray const& keys) {
  std::vector<Index> const& k = keys.shape;
  if (!compress) {
    kvc::NpyArray const s = read_output(dir / "scores.npy");
    if (s.dtype != kvc::NpyDtype::f32 || s.shape != std::vector<Index>{k[0], k[1], k[2]})
      violated("scores.npy is not float32 [B, H, N]");
    return;
  }
  kvc::NpyArray const counts = read_output(dir / "out" / "counts.npy"),
                      indices = read_output(dir / "out" / "indices.npy"),
                      kept_keys = read_output(dir / "out" / "keys.npy");
  (void)read_output(dir / "out" / "values.npy");
  if (counts.dtype != kvc::NpyDtype::i64 || counts.shape != std::vector<Index>{k[0], k[1]})
    violated("counts.npy is not int64 [B, H]");
  if (indices.dtype != kvc::NpyDtype::i64 || indices.shape.size() != 3 || indices.shape[0] != k[0] ||
      indices.shape[1] != k[1])
    violated("indices.npy is not int64 [B, H, n_kept]");
  Index const kept = indices.shape[2];
  if (kept_keys.dtype != keys.dtype || kept_keys.shape != std::vector<Index>{k[0], k[1], kept, k[3]})
    violated("keys.npy is not [B, H, n_kept, d] in the input dtype");
  for (Index bh = 0; bh < k[0] * k[1]; ++bh) {
    Index const n = counts.as<std::int64_t>()[bh];
    if (n < 0 || n > k[2] || n > kept)
      violated("a count is outside [0, min(N, n_kept)]");
    std::int64_t const* row = indices.as<std::int64_t>() + bh * kept;
    for (Index j = 0; j < kept; ++j)
      if (j < n ? (row[j] < 0 || row[j] >= k[2] || (j > 0 && row[j] <= row[j - 1])) : row[j] != -1)
        violated("indices are not ascending in [0, N) followed by -1 padding");
  }
  if (!allocator)
    return;
  // The ragged store: offsets are the prefix sum of the counts, and the rows are exactly the kept ones.
  kvc::NpyArray const offsets = read_output(dir / "out" / "offsets.npy"),
                      ragged = read_output(dir / "out" / "ragged_keys.npy");
  (void)read_output(dir / "out" / "ragged_values.npy");
  if (offsets.dtype != kvc::NpyDtype::i64 || offsets.shape != std::vector<Index>{k[0] * k[1] + 1})
    violated("offsets.npy is not int64 [B * H + 1]");
  std::int64_t const* off = offsets.as<std::int64_t>();
  for (Index bh = 0; bh < k[0] * k[1]; ++bh)
    if (off[bh + 1] - off[bh] != counts.as<std::int64_t>()[bh] || off[0] != 0)
      violated("offsets.npy is not the prefix sum of counts.npy");
  if (ragged.shape != std::vector<Index>{off[k[0] * k[1]], k[3]})
    violated("ragged_keys.npy is not [sum of counts, d]");
}

/// A small dimension, now and then 0 or a large one.
Index dimension(Bytes& in, Index usual) {
  std::uint8_t const b = in.u8();
  if (b < 200)
    return usual;
  if (b < 230)
    return b % 6;
  if (b < 250)
    return Index{1} << (20 + b % 30);
  return 0;
}

/// A file: raw fuzz bytes, or a well-formed header of a fuzzed dtype and (mostly `shape`) shape over fuzzed data.
std::vector<std::byte> make_file(Bytes& in, std::vector<Index> shape, kvc::NpyDtype usual) {
  std::uint8_t const mode = in.u8();
  if (mode < 16)
    return in.take(in.u8() * 4u);
  kvc::NpyDtype dtype = usual;
  if (mode < 32)
    dtype = static_cast<kvc::NpyDtype>(in.u8() % 5);
  for (Index& d : shape)
    d = dimension(in, d);
  if (mode < 40)
    shape.resize(in.u8() % 6);
  Index elements = 1;
  for (Index d : shape)
    elements = d > 4096 || elements > 4096 ? 4097 : elements * d;
  std::size_t const want = elements > 4096 ? 64 : static_cast<std::size_t>(elements) * kvc::npy_itemsize(dtype);
  std::vector<std::byte> data = in.take(want);
  if (mode >= 48)
    data.resize(want);  // zero-padded to the declared size (otherwise truncated: the parser's case)
  std::vector<std::byte> file = kvc::npy_header(dtype, shape);
  file.insert(file.end(), data.begin(), data.end());
  return file;
}

bool has_temporary(fs::path const& dir) {
  std::error_code ec;
  for (auto const& entry : fs::directory_iterator(dir, ec))
    if (entry.path().filename().string().find(".kvc-") != std::string::npos)
      return true;
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  Bytes in{data, size};
  fs::path const dir = work_dir();
  std::error_code ec;
  fs::remove_all(dir / "out", ec);
  fs::remove(dir / "scores.npy", ec);

  fs::remove_all(dir / "moments", ec);

  static char const* const policies[] = {"streaming_llm", "key_diff", "knorm",    "snap_kv",
                                         "tova",          "random",   "moment_kv"};
  std::uint8_t const choice = in.u8(), flags = in.u8();
  std::string const policy = policies[choice % 7];
  bool const moment_kv = policy == "moment_kv";
  // kvc attend (with moment_kv's draw): attention over a cache, with fuzzed --indices and --moments files.
  bool const attend = moment_kv && (choice & 128);
  bool const compress = !attend && (flags & 1), queries = policy == "snap_kv" || policy == "tova" || moment_kv;
  bool const positions = queries && (flags & 2);

  Index const batch = 1 + in.u8() % 2, heads = 1 + in.u8() % 2, tokens = 1 + in.u8() % 12, dim = 2 * (1 + in.u8() % 4);
  Index const group = 1 + in.u8() % 2, window = 1 + in.u8() % 4;
  kvc::NpyDtype const dtype = flags & 4 ? kvc::NpyDtype::f16 : kvc::NpyDtype::f32;

  std::vector<std::string> args = {"kvc", attend ? "attend" : (compress ? "compress" : "score")};
  if (!attend)
    args.insert(args.end(), {"--policy", policy});
  std::vector<fs::path> inputs = {dir / "keys.npy"};
  write_file(inputs[0], make_file(in, {batch, heads, tokens, dim}, dtype));
  args.insert(args.end(), {"--keys", inputs[0].string()});
  // moment_kv's score reads the values unless mi=false (the harness never makes a usage error).
  bool const mi_false = moment_kv && !compress && !attend && !(flags & 8);
  if (compress || attend || (flags & 8)) {
    inputs.push_back(dir / "values.npy");
    write_file(inputs.back(), make_file(in, {batch, heads, tokens, dim}, dtype));
    args.insert(args.end(), {"--values", inputs.back().string()});
  }
  if (queries) {
    inputs.push_back(dir / "queries.npy");
    write_file(inputs.back(), make_file(in, {batch, heads * group, window, dim}, dtype));
    args.insert(args.end(), {"--queries", inputs.back().string()});
    if (flags & 16)
      args.insert(args.end(), {"--param", "queries=post_rope"});
    if (attend) {
      if (!(flags & 16) && (flags & 32))  // pre-RoPE queries (queries=post_rope with --rope is a usage error)
        args.insert(args.end(), {"--rope", "theta=10000,style=interleaved"});
    } else if (moment_kv) {  // MomentKV's parameters (its selection ones are compress's only)
      std::uint8_t const p = in.u8();
      args.insert(args.end(), {"--param", "window_size=" + std::to_string(1 + in.u8() % 4)});
      args.insert(args.end(), {"--param", "kernel_size=" + std::to_string(1 + in.u8() % 5)});
      args.insert(args.end(), {"--param", p & 1 ? "pooling=chunk_mean" : (p & 2 ? "pooling=none" : "pooling=max")});
      args.insert(args.end(), {"--param", "prefill_rounds=" + std::to_string(1 + (p >> 2) % 4)});
      static char const* const storage[] = {"storage=fp32", "storage=fp16", "storage=bf16"};
      args.insert(args.end(), {"--param", storage[(p >> 4) % 3]});
      if (p & 64)
        args.insert(args.end(), {"--param", "clamp_tau=" + std::to_string(in.u8() % 3)});
      if (mi_false || (compress && (p & 128)))
        args.insert(args.end(), {"--param", "mi=false"});
    } else if (policy == "snap_kv") {
      args.insert(args.end(), {"--param", "window_size=" + std::to_string(1 + in.u8() % 4)});
      args.insert(args.end(), {"--param", "kernel_size=" + std::to_string(1 + 2 * (in.u8() % 3))});
      args.insert(args.end(), {"--param", in.u8() % 2 ? "pooling=avg" : "pooling=max"});
    } else if (flags & 32) {
      args.insert(args.end(), {"--param", "reference=kvpress"});
    }
  }
  if (positions) {
    inputs.push_back(dir / "positions.npy");
    std::vector<std::byte> file = make_file(in, {batch, window}, kvc::NpyDtype::i64);
    // Positions size the RoPE table (up to the CLI's 1 GiB limit): keep most small so runs stay fast; the limit
    // itself is covered by tests/tools/hostile_test.cpp.
    if (file.size() > 128 && (flags & 32) == 0)
      for (std::size_t i = 128; i < file.size(); ++i)
        if (i % 8 != 0)
          file[i] = std::byte{0};
    write_file(inputs.back(), file);
    args.insert(args.end(), {"--positions", inputs.back().string()});
  }
  bool moments = false;
  if (attend) {
    if (flags & 64) {  // --indices: mostly compress's layout (ascending positions, -1 padding), sometimes fuzzed
      inputs.push_back(dir / "indices.npy");
      std::vector<std::byte> file = make_file(in, {batch, heads, tokens}, kvc::NpyDtype::i64);
      if (in.u8() & 1) {
        std::vector<std::int64_t> idx(static_cast<std::size_t>(batch * heads * tokens));
        for (Index bh = 0; bh < batch * heads; ++bh) {
          Index const count = in.u8() % (tokens + 1), stride = 1 + in.u8() % 3;
          for (Index t = 0; t < tokens; ++t)
            idx[static_cast<std::size_t>(bh * tokens + t)] = t < count ? t * stride : -1;
        }
        std::vector<Index> const shape = {batch, heads, tokens};
        file = kvc::serialize_npy(kvc::NpyDtype::i64, shape, idx.data());
      }
      write_file(inputs.back(), file);
      args.insert(args.end(), {"--indices", inputs.back().string()});
    }
    if (flags & 128) {  // --moments: four fuzzed files of the documented shapes (counts small and >= 0 mostly)
      moments = true;
      fs::create_directories(dir / "moments");
      kvc::NpyDtype const mt = in.u8() & 1 ? kvc::NpyDtype::f16 : kvc::NpyDtype::f32;
      std::vector<std::byte> count = make_file(in, {batch, heads}, kvc::NpyDtype::i64);
      if (in.u8() & 1) {
        std::vector<std::int64_t> n(static_cast<std::size_t>(batch * heads));
        for (auto& x : n)
          x = in.u8() % 40;
        std::vector<Index> const shape = {batch, heads};
        count = kvc::serialize_npy(kvc::NpyDtype::i64, shape, n.data());
      }
      std::vector<std::vector<std::byte>> const files = {count, make_file(in, {batch, heads, dim}, mt),
                                                         make_file(in, {batch, heads, dim}, mt),
                                                         make_file(in, {batch, heads, dim, dim}, mt)};
      static char const* const names[] = {"moment_count.npy", "moment_key_mean.npy", "moment_value_mean.npy",
                                          "moment_comoment.npy"};
      for (std::size_t i = 0; i < 4; ++i) {
        inputs.push_back(dir / "moments" / names[i]);
        write_file(inputs.back(), files[i]);
      }
      args.insert(args.end(), {"--moments", (dir / "moments").string()});
      if (in.u8() & 1)
        args.insert(args.end(), {"--param", "order=zeroth"});
    }
    args.insert(args.end(), {"--out-dir", (dir / "out").string()});
  }
  bool allocator = false;
  if (compress) {
    if (flags & 64)
      args.insert(args.end(), {"--ratio", std::to_string((in.u8() % 11) / 10.0)});
    else
      args.insert(args.end(), {"--budget", std::to_string(in.u8() % 16)});
    // An allocator (AdaKV, PyramidKV or both) over the same scores; alpha beyond 1 is refused with exit 3.
    // PyramidKV's kvpress schedule needs --ratio (a usage error otherwise, which this harness never makes).
    std::uint8_t const pick = in.u8();
    bool const kvpress = std::find(args.begin(), args.end(), "reference=kvpress") != args.end();
    if (pick & 1) {
      static char const* const allocators[] = {"ada_kv", "pyramid_kv", "pyramid_kv+ada_kv"};
      std::string const name = kvpress && !(flags & 64) ? "ada_kv" : allocators[(pick >> 1) % 3];
      args.insert(args.end(), {"--allocator", name});
      if (name != "pyramid_kv" && (pick & 8))
        args.insert(args.end(), {"--param", "alpha_safeguard=" + std::to_string((pick >> 4) / 10.0)});
      allocator = true;
    }
    if (policy != "streaming_llm" && (flags & 128))
      args.insert(args.end(), {"--param", "n_sink=" + std::to_string(in.u8() % 3), "--param",
                               "n_recent=" + std::to_string(in.u8() % 3)});
    args.insert(args.end(), {"--out-dir", (dir / "out").string()});
  } else if (!attend) {
    args.insert(args.end(), {"--out", (dir / "scores.npy").string()});
  }

  std::vector<std::vector<std::byte>> before;
  for (auto const& p : inputs)
    before.push_back(read_file(p));
  std::vector<char const*> argv;
  for (auto const& a : args)
    argv.push_back(a.c_str());

  char* message = nullptr;
  std::size_t message_size = 0;
  std::FILE* err = ::open_memstream(&message, &message_size);
  std::FILE* out = std::fopen("/dev/null", "w");
  int const code = kvc::cli::run(static_cast<int>(argv.size()), argv.data(), out, err);
  std::fclose(out);
  std::fclose(err);
  std::string const text(message, message_size);
  std::free(message);

  static bool const stats = std::getenv("KVC_FUZZ_STATS") != nullptr;
  if (stats) {  // how often runs get through (exit 0) versus are refused (exit 3), per command
    static long counts[3][4] = {};
    ++counts[attend ? 2 : compress][code & 3];
    static bool registered =
        std::atexit([] {
          std::fprintf(stderr,
                       "cli_fuzz: score exit 0/3: %ld/%ld, compress exit 0/3: %ld/%ld, attend "
                       "exit 0/3: %ld/%ld\n",
                       counts[0][0], counts[0][3], counts[1][0], counts[1][3], counts[2][0], counts[2][3]);
        }) == 0;
    (void)registered;
  }
  if (code != 0 && code != 3)
    violated("exit code other than 0 or 3:", std::to_string(code) + " " + text);
  if (code == 3 && (text.rfind("kvc: error: ", 0) != 0 || text.find('\n') + 1 != text.size()))
    violated("exit 3 without exactly one 'kvc: error: ' line:", text);
  std::vector<fs::path> outputs = compress
                                      ? std::vector<fs::path>{dir / "out" / "keys.npy", dir / "out" / "values.npy",
                                                              dir / "out" / "indices.npy", dir / "out" / "counts.npy"}
                                      : std::vector<fs::path>{dir / "scores.npy"};
  if (attend)
    outputs = {dir / "out" / "out.npy", dir / "out" / "lse.npy", dir / "out" / "plain_out.npy",
               dir / "out" / "plain_lse.npy"};
  if (allocator)
    for (char const* name : {"ragged_keys.npy", "ragged_values.npy", "offsets.npy"})
      outputs.push_back(dir / "out" / name);
  if (compress && moment_kv)
    for (char const* name : {"moment_count.npy", "moment_key_mean.npy", "moment_value_mean.npy", "moment_comoment.npy"})
      outputs.push_back(dir / "out" / name);
  for (auto const& p : outputs)
    if (code == 3 && fs::exists(p))
      violated("an output exists after a failure:", p.string());
  if (code == 0) {
    kvc::NpyArray keys;
    std::string error;
    if (!kvc::read_npy(inputs[0].string(), keys, error) || keys.shape.size() != 4)
      violated("exit 0 with keys that do not read as a rank-4 array");
    if (attend) {
      kvc::NpyArray q, v;
      if (!kvc::read_npy((dir / "queries.npy").string(), q, error) || q.shape.size() != 4 ||
          !kvc::read_npy((dir / "values.npy").string(), v, error) || v.shape.size() != 4)
        violated("exit 0 with queries or values that do not read as rank-4 arrays");
      check_attend(dir, q, v, moments);
    } else {
      check_outputs(compress, allocator, dir, keys);
    }
    if (compress && moment_kv)
      check_moments(dir, keys, read_output(dir / "out" / "counts.npy"));
  }
  if (has_temporary(dir) || (fs::exists(dir / "out") && has_temporary(dir / "out")))
    violated("a temporary file was left behind");
  if (code == 3 && (compress || attend) && fs::exists(dir / "out"))
    violated("compress left its output folder behind after a failure");
  for (std::size_t i = 0; i < inputs.size(); ++i)
    if (read_file(inputs[i]) != before[i])
      violated("an input changed:", inputs[i].string());
  return 0;
}
