// SPDX-License-Identifier: Apache-2.0
// examples/03_cuda_engine/main.cu: the engine loop of examples/02_paged_engine on CUDA (docs/integration.md shows
// main()): fp16 caches in device memory ([batch, Hkv, capacity, d], the Hugging Face layout) with GQA, one
// kvc::LayerCompressor<Press, kvc::Cuda> per layer, every call enqueued on the engine's stream and none reading device
// memory on the host; with --graphs the decode steps are replayed from two captured CUDA graphs. Built with
// KVC_ENABLE_CUDA (nvcc) and run under the CUDA emulator in CI (both ways).
#include <kvc/cuda.cuh>  // every CUDA kernel, so that any policy compiles

#include <cstdio>
#include <string_view>
#include <vector>

using kvc::Index;

/// Stand-in for the engine's device memory and model: per layer K and V [batch, Hkv, capacity, d] fp16, lengths per
/// (sequence, KV head), positions per slot; the per-step inputs (the new token's K, V and positions, the queries its
/// projections and rotary kernel would write) in buffers allocated once.
struct DeviceEngine {
  static constexpr Index layers = 2, batch = 2, kv_heads = 2, q_heads = 8, dim = 64, capacity = 128;
  kvc::KVExtents const ext{batch, kv_heads, capacity, dim}, one{batch, kv_heads, 1, dim};
  std::vector<Index> const prompt = {100, 70};
  cudaStream_t stream = nullptr;
  std::vector<void*> owned;  // every device buffer, freed by the destructor
  std::vector<kvc::half*> k, v;
  std::vector<Index*> lengths, positions;
  std::vector<float> queries_host, rope_host;
  kvc::RopeTable<> host_rope;
  kvc::RopeTable<kvc::DeviceSpace> rope;
  float *queries = nullptr, *rotated = nullptr, *out = nullptr;
  kvc::half *k_new = nullptr, *v_new = nullptr;
  Index *token_positions = nullptr, *query_positions = nullptr;

  static float fake(std::size_t i, int salt) {
    return static_cast<float>((i * 7919 + static_cast<std::size_t>(salt) * 104729) % 97) / 97 - 0.5f;
  }
  template <class T>
  T* device(std::vector<T> const& host) {  // a device copy of a host vector
    T* p = nullptr;
    cudaMalloc(&p, host.size() * sizeof(T));
    owned.push_back(p);
    cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
    return p;
  }
  std::vector<kvc::half> fill(std::size_t n, int salt) {
    std::vector<kvc::half> x(n);
    for (std::size_t i = 0; i < n; ++i)
      x[i] = kvc::half(fake(i, salt));
    return x;
  }

  DeviceEngine() : queries_host(batch * q_heads * 16 * dim), rope_host(kvc::rope_table_floats(1024, dim)) {
    cudaStreamCreate(&stream);
    std::vector<Index> positions_host;
    for (Index i = 0; i < ext.rows(); ++i)
      positions_host.push_back(i % capacity);
    for (Index l = 0; l < layers; ++l) {  // the prefilled caches of the layers
      k.push_back(device(fill(ext.rows() * dim, int(l))));
      v.push_back(device(fill(ext.rows() * dim, int(l) + 7)));
      lengths.push_back(device(std::vector<Index>{100, 100, 70, 70}));
      positions.push_back(device(positions_host));
    }
    for (std::size_t i = 0; i < queries_host.size(); ++i)
      queries_host[i] = fake(i, 3);
    (void)kvc::fill_rope_table(kvc::RopeSpec{}, dim, 1024, rope_host.data(), host_rope);
    float const* table = device(rope_host);
    rope = {table, table + (host_rope.sin - host_rope.cos), host_rope.positions, host_rope.rotary_dim};
    queries = device(queries_host);
    rotated = device(std::vector<float>(batch * q_heads * dim));
    out = device(std::vector<float>(batch * q_heads * dim));
    k_new = device(fill(one.rows() * dim, 0));
    v_new = device(fill(one.rows() * dim, 1));
    token_positions = device(std::vector<Index>(batch * kv_heads));
    query_positions = device(std::vector<Index>(16 * batch));
  }
  ~DeviceEngine() {
    cudaStreamSynchronize(stream);
    for (void* p : owned)
      cudaFree(p);
    cudaStreamDestroy(stream);
  }
  DeviceEngine(DeviceEngine const&) = delete;
  DeviceEngine& operator=(DeviceEngine const&) = delete;

  auto cache(Index l) {
    return kvc::make_cache(kvc::bhtd_device_rows(k[l], ext), kvc::bhtd_device_rows(v[l], ext),
                           kvc::head_lengths(lengths[l], kv_heads), positions[l]);
  }
  /// Writes positions [batch, n] (the query rows' or the new tokens') on the stream.
  Index* upload_positions(Index* to, std::vector<Index> const& from) {
    cudaMemcpyAsync(to, from.data(), from.size() * sizeof(Index), cudaMemcpyHostToDevice, stream);
    cudaStreamSynchronize(stream);  // `from` is a temporary (pinned memory and a ring of buffers would avoid this)
    return to;
  }
  kvc::LayerQueries<float, kvc::DeviceSpace> prompt_queries(Index, Index window) {
    std::vector<Index> p;
    for (Index b = 0; b < batch; ++b)
      for (Index i = 0; i < window; ++i)
        p.push_back(prompt[b] - window + i);
    return {{queries, kvc::bhtd_layout({batch, q_heads, window, dim})}, upload_positions(query_positions, p)};
  }
  auto new_tokens(Index, Index s) {
    upload_positions(token_positions, {prompt[0] + s, prompt[0] + s, prompt[1] + s, prompt[1] + s});
    return kvc::make_cache(kvc::bhtd_device_rows(k_new, one), kvc::bhtd_device_rows(v_new, one), kvc::Lengths{},
                           token_positions);
  }
  kvc::LayerQueries<float, kvc::DeviceSpace> step_queries(Index s) {
    return {{queries, kvc::bhtd_layout({batch, q_heads, 1, dim})},
            upload_positions(query_positions, {prompt[0] + s, prompt[1] + s})};
  }
  kvc::AttendQueries<float, kvc::DeviceSpace> attend_queries(Index s) {
    std::vector<float> r(batch * q_heads * dim);  // stand-in for the engine's rotary kernel
    for (Index i = 0; i < batch * q_heads; ++i) {
      std::copy_n(queries_host.data() + i * dim, dim, r.data() + i * dim);  // step_queries' row of (b, h)
      host_rope.rotate(r.data() + i * dim, prompt[i / q_heads] + s);
    }
    cudaMemcpy(rotated, r.data(), r.size() * sizeof(float), cudaMemcpyHostToDevice);
    kvc::LayerQueries<float, kvc::DeviceSpace> const q = step_queries(s);
    return {{rotated, q.rows.layout()}, q.positions};
  }
};

// example-begin integration-cuda-graphs
/// main()'s decode loop with CUDA graphs: each step's inputs are written into the same buffers; the first plain and
/// the first compressing decode forward (every layer's append, attend and decode) are captured, then replayed.
/// compresses_next() says which graph a step needs; replayed() counts a replay on the host, in place of decode().
template <class Layers>
kvc::Status decode_with_graphs(DeviceEngine& engine, Layers& layer, kvc::Workspace workspace, Index steps) {
  kvc::Cuda const gpu{engine.stream};
  cudaGraphExec_t graphs[2] = {nullptr, nullptr};  // a plain step's, a compressing step's
  kvc::Status st;
  for (Index s = 0; s < steps && st.ok(); ++s) {
    auto const fresh = engine.new_tokens(0, s);  // the step's inputs, written before its graph runs
    auto const attend_queries = engine.attend_queries(s);
    auto const step_queries = engine.step_queries(s);
    bool const compressing = layer[0].compresses_next();  // every layer runs the same schedule
    cudaGraphExec_t& graph = graphs[compressing ? 1 : 0];
    if (graph == nullptr) {  // the first step of its kind: capture it (decode() counts it), then launch it
      cudaGraph_t captured = nullptr;
      cudaStreamBeginCapture(engine.stream, cudaStreamCaptureModeGlobal);
      for (Index l = 0; l < engine.layers && st.ok(); ++l) {
        st = kvc::append(gpu, engine.cache(l), fresh);
        if (st.ok())
          st = layer[l].attend(attend_queries, engine.cache(l), {engine.out}, workspace);
        if (st.ok())
          st = layer[l].decode(engine.cache(l), step_queries, workspace);
      }
      bool const ended = cudaStreamEndCapture(engine.stream, &captured) == cudaSuccess;
      if (st.ok() && (!ended || cudaGraphInstantiate(&graph, captured, 0) != cudaSuccess))
        st = {kvc::Errc::backend_error, "capturing a decode step failed"};
      if (captured)
        cudaGraphDestroy(captured);
    } else {
      for (Index l = 0; l < engine.layers && st.ok(); ++l)
        st = layer[l].replayed();
    }
    if (st.ok() && cudaGraphLaunch(graph, engine.stream) != cudaSuccess)
      st = {kvc::Errc::backend_error, "cudaGraphLaunch failed"};
  }
  for (cudaGraphExec_t g : graphs)
    if (g)
      cudaGraphExecDestroy(g);
  return st;
}
// example-end integration-cuda-graphs

// example-begin integration-cuda
int main(int argc, char** argv) {
  DeviceEngine engine;  // fp16 caches in device memory, GQA, the engine's stream (above)
  kvc::Cuda const gpu{engine.stream};
  Index const window = 16, steps = 24;

  // The policy (this line) and the schedule, as on the CPU; the RoPE table lives in device memory.
  kvc::Press const policy{kvc::SnapKVScorer{.window_size = window},
                          kvc::TopKSelector{kvc::RatioBudget{0.5}, 0, window}};
  kvc::CompressorOptions<kvc::DeviceSpace> options{.rope = engine.rope, .decode = true};
  options.schedule = {.compression_interval = 16, .target_size = 48, .hidden_states_buffer_size = 16};

  // Plan once per layer shape; each layer binds its own state (device memory); one workspace serves them all.
  kvc::LayerCompressor planned(gpu, policy, options);
  kvc::Status st =
      planned.plan(engine.cache(0), kvc::QueryShape{.heads = engine.q_heads, .prompt_rows = window, .step_rows = 1});
  std::vector<decltype(planned)> layer(engine.layers, planned);
  std::byte* state = engine.device(std::vector<std::byte>(engine.layers * planned.state_bytes()));
  kvc::Workspace const workspace{engine.device(std::vector<std::byte>(planned.workspace_bytes())),
                                 planned.workspace_bytes()};
  for (Index l = 0; l < engine.layers && st.ok(); ++l)
    if (st = layer[l].bind(state + l * planned.state_bytes(), planned.state_bytes(), l); st.ok())
      st = layer[l].reset();  // enqueued on the stream

  for (Index l = 0; l < engine.layers && st.ok(); ++l)  // after the prompt's forward
    st = layer[l].prefill(engine.cache(l), engine.prompt_queries(l, window), workspace);

  if (argc > 1 && std::string_view(argv[1]) == "--graphs")  // the same steps replayed from CUDA graphs (above)
    st = st.ok() ? decode_with_graphs(engine, layer, workspace, steps) : st;
  else
    for (Index s = 0; s < steps && st.ok(); ++s)  // each decode forward (kvc's calls only enqueue work)
      for (Index l = 0; l < engine.layers && st.ok(); ++l) {
        st = kvc::append(gpu, engine.cache(l), engine.new_tokens(l, s));
        if (st.ok())
          st = layer[l].attend(engine.attend_queries(s), engine.cache(l), {engine.out}, workspace);
        if (st.ok())
          st = layer[l].decode(engine.cache(l), engine.step_queries(s), workspace);
      }

  std::vector<Index> n(4);
  cudaMemcpyAsync(n.data(), engine.lengths[1], n.size() * sizeof(Index), cudaMemcpyDeviceToHost, engine.stream);
  cudaStreamSynchronize(engine.stream);
  std::printf("%s: %lld compressions per layer; layer 1 heads hold %lld %lld %lld %lld tokens\n", st.message(),
              static_cast<long long>(layer[1].counter().compressions), static_cast<long long>(n[0]),
              static_cast<long long>(n[1]), static_cast<long long>(n[2]), static_cast<long long>(n[3]));
  return st.ok() ? 0 : 1;
}
// example-end integration-cuda
