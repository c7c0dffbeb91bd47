// SPDX-License-Identifier: Apache-2.0
// tools/fuzz/model_fuzz.cpp: libFuzzer harness for kvc-eval's model readers (files are untrusted input): a Hugging
// Face config.json and a llama2.c checkpoint's header checked against the file's size. The first byte chooses the
// reader; the rest is the file. The readers (tools/eval/model.cpp) are compiled with the fuzzer's instrumentation
// (kvc_eval_readers_fuzz, tools/CMakeLists.txt).
//   cmake -DCMAKE_CXX_COMPILER=clang++ -DKVC_BUILD_FUZZERS=ON ... && ./tools/kvc_model_fuzz -max_total_time=60
#include "eval/model.hpp"

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  if (size == 0)
    return 0;
  std::span<std::byte const> const file(reinterpret_cast<std::byte const*>(data) + 1, size - 1);
  kvc::eval::ModelConfig c;
  std::string error;
  bool ok = false;
  if (data[0] % 2 == 0) {
    ok = kvc::eval::parse_config({reinterpret_cast<char const*>(file.data()), file.size()}, "config.json", c, error);
  } else {
    kvc::eval::Llama2cLayout layout;
    ok = kvc::eval::parse_llama2c_header(file, "model.bin", c, layout, error);
    if (ok) {  // an accepted header describes exactly the file: the last group ends at its end
      std::uint64_t const end = kvc::eval::Llama2cLayout::header_bytes +
                                static_cast<std::uint64_t>(layout.offset[12] + layout.size[12]) * sizeof(float);
      if (end != file.size())
        std::abort();
    }
  }
  if (ok) {  // an accepted shape is consistent
    if (c.heads % c.kv_heads != 0 || c.head_dim % 2 != 0 || c.hidden < 1 || c.vocab < 1 || c.layers < 1)
      std::abort();
  } else if (error.empty()) {
    std::abort();  // every rejection says why
  }
  return 0;
}
