// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/store/packed.cuh: a host PackedKV (kvc/store/packed_kv.hpp) copied into caller-owned device
// memory, and the PackedKVView<DeviceSpace> the CUDA kernels read over it. Offsets in the descriptors are relative
// to the arena, so the arena and the descriptors are copied as they are.
#pragma once

#include <kvc/backend/cuda/config.cuh>
#include <kvc/store/packed.hpp>
#include <kvc/store/packed_kv.hpp>

#include <cstddef>
#include <cstdint>

namespace kvc {

/// Device bytes a copy of `kv` needs: the arena (PackedKV::arena_bytes) and the descriptors
/// (PackedKV::descriptor_bytes), each a separate caller buffer.
struct PackedDeviceBytes {
  std::size_t arena = 0;
  std::size_t heads = 0;
};
inline PackedDeviceBytes packed_device_bytes(PackedKV const& kv) noexcept {
  return {kv.arena_bytes(), kv.descriptor_bytes()};
}

/// Enqueues the copy of `kv` into `arena` (>= kv.arena_bytes() bytes, 16-byte aligned: cudaMalloc's are) and
/// `heads` (>= batch * kv_heads descriptors) on `cuda.stream`, and sets `out` to the device view over them. The host
/// object must stay alive and unchanged until the copy has completed (asynchronous for pinned memory).
/// Errors: buffers smaller than needed or misaligned (invalid_argument), a CUDA error (backend_error).
inline Status to_device(Cuda const& cuda, PackedKV const& kv, void* arena, std::size_t arena_bytes, PackedHead* heads,
                        Index heads_capacity, PackedKVView<DeviceSpace>& out) {
  Index const n_heads = kv.batch() * kv.kv_heads();
  if (arena_bytes < kv.arena_bytes() || (kv.arena_bytes() > 0 && arena == nullptr))
    return {Errc::invalid_argument, "kvc::to_device(PackedKV): `arena` smaller than PackedKV::arena_bytes()"};
  if (reinterpret_cast<std::uintptr_t>(arena) % 16 != 0)
    return {Errc::invalid_argument, "kvc::to_device(PackedKV): `arena` must be 16-byte aligned"};
  if (heads_capacity < n_heads || (n_heads > 0 && heads == nullptr))
    return {Errc::invalid_argument, "kvc::to_device(PackedKV): `heads` holds fewer than batch * kv_heads descriptors"};
  KVC_RETURN_IF_ERROR(backend::cuda::pending_status());
  if (kv.arena_bytes() > 0 &&
      cudaMemcpyAsync(arena, kv.arena_data(), kv.arena_bytes(), cudaMemcpyHostToDevice, cuda.stream) != cudaSuccess)
    return {Errc::backend_error, "kvc::to_device(PackedKV): copy of the arena failed"};
  if (n_heads > 0 &&
      cudaMemcpyAsync(heads, kv.heads(), kv.descriptor_bytes(), cudaMemcpyHostToDevice, cuda.stream) != cudaSuccess)
    return {Errc::backend_error, "kvc::to_device(PackedKV): copy of the descriptors failed"};
  PackedKVView<HostSpace> const v = kv.view();
  out = PackedKVView<DeviceSpace>{
      static_cast<std::byte const*>(arena), heads, v.batch, v.kv_heads, v.dim, v.value_dim, v.max_tokens, v.quant};
  return {};
}

}  // namespace kvc
