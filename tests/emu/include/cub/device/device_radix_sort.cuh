// CUB stand-in for the emulated CUDA device (-Demulate_cuda=true; tests/emu/include comes before the toolkit's
// headers, whose CUB the host compiler cannot read): cub::DeviceRadixSort::SortPairs, the one CUB call meshtrain
// makes (runtime/kernels/cuda/embedding.cu), with CUB's documented contract:
//   - two phases: with d_temp_storage null it only stores the temporary storage size it needs in
//     temp_storage_bytes; called again with that much device memory it sorts;
//   - keys ordered by their bits [begin_bit, end_bit) (signed integers and floats in their numeric order, as CUB's
//     bit twiddling gives), values moved with their keys, the sort stable (equal keys keep their input order);
//   - the output ranges must not overlap the input ranges; everything runs in stream order on `stream`.
// Pointers are checked against the device-allocation registry and recorded for the hazard tracker
// (tests/emu/device_registry.h); a violation is reported and returns cudaErrorInvalidValue.
#pragma once
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "tests/emu/device_registry.h"

namespace cub {

struct DeviceRadixSort {
  template <typename KeyT, typename ValueT, typename NumItemsT>
  static cudaError_t SortPairs(void* d_temp_storage, size_t& temp_storage_bytes, const KeyT* d_keys_in, KeyT* d_keys_out,
                               const ValueT* d_values_in, ValueT* d_values_out, NumItemsT num_items, int begin_bit = 0,
                               int end_bit = int(sizeof(KeyT) * 8), cudaStream_t stream = 0) {
    static_assert(std::is_integral_v<KeyT> || std::is_floating_point_v<KeyT>, "SortPairs: integer or float keys");
    constexpr const char* call = "cub::DeviceRadixSort::SortPairs";
    const size_t n = num_items > 0 ? size_t(num_items) : 0;
    // What CUB's onesweep needs is in the same range: a second buffer for keys and values, plus histograms.
    const size_t need = 256 + n * (sizeof(KeyT) + sizeof(ValueT));
    if (d_temp_storage == nullptr) {
      temp_storage_bytes = need;
      return cudaSuccess;
    }
    if (begin_bit < 0 || end_bit > int(sizeof(KeyT) * 8) || begin_bit >= end_bit) {
      emu::report(call, "bit range [" + std::to_string(begin_bit) + ", " + std::to_string(end_bit) + ") of a " +
                            std::to_string(sizeof(KeyT) * 8) + "-bit key");
      return cudaErrorInvalidValue;
    }
    if (temp_storage_bytes < need) {
      emu::report(call, "temp_storage_bytes " + std::to_string(temp_storage_bytes) + " is less than the " +
                            std::to_string(need) + " the size query returned");
      return cudaErrorInvalidValue;
    }
    const size_t kb = n * sizeof(KeyT), vb = n * sizeof(ValueT);
    if (!emu::check_device_range(d_temp_storage, temp_storage_bytes, call, "d_temp_storage") ||
        !emu::check_device_range(d_keys_in, kb, call, "d_keys_in") ||
        !emu::check_device_range(d_keys_out, kb, call, "d_keys_out") ||
        !emu::check_device_range(d_values_in, vb, call, "d_values_in") ||
        !emu::check_device_range(d_values_out, vb, call, "d_values_out"))
      return cudaErrorInvalidValue;
    auto overlap = [](const void* a, size_t an, const void* b, size_t bn) {
      auto* x = static_cast<const unsigned char*>(a);
      auto* y = static_cast<const unsigned char*>(b);
      return an > 0 && bn > 0 && x < y + bn && y < x + an;
    };
    if (overlap(d_keys_in, kb, d_keys_out, kb) || overlap(d_values_in, vb, d_values_out, vb) ||
        overlap(d_keys_out, kb, d_values_out, vb)) {
      emu::report(call, "the output ranges overlap the inputs or each other (SortPairs does not sort in place)");
      return cudaErrorInvalidValue;
    }
    if (n == 0) return cudaSuccess;
    // In a stream capture: this sort, made at each replay of the graph.
    if (emu::record_if_capturing(stream, [=]() mutable {
          size_t bytes = temp_storage_bytes;
          SortPairs(d_temp_storage, bytes, d_keys_in, d_keys_out, d_values_in, d_values_out, num_items, begin_bit,
                    end_bit, stream);
        }))
      return cudaSuccess;
    if (!emu::note_read(d_keys_in, kb, stream, call) || !emu::note_read(d_values_in, vb, stream, call) ||
        !emu::note_write(d_temp_storage, temp_storage_bytes, stream, call) ||
        !emu::note_write(d_keys_out, kb, stream, call) || !emu::note_write(d_values_out, vb, stream, call))
      return cudaErrorIllegalState;
    // The key's bits as an unsigned integer in the key's numeric order, as CUB orders them.
    using U = std::conditional_t<sizeof(KeyT) == 1, uint8_t,
              std::conditional_t<sizeof(KeyT) == 2, uint16_t, std::conditional_t<sizeof(KeyT) == 4, uint32_t, uint64_t>>>;
    constexpr U top = U(U(1) << (sizeof(U) * 8 - 1));
    auto ordered = [&](KeyT k) {
      U u;
      std::memcpy(&u, &k, sizeof(U));
      if constexpr (std::is_floating_point_v<KeyT>) u = (u & top) ? U(~u) : U(u | top);
      else if constexpr (std::is_signed_v<KeyT>) u = U(u ^ top);
      const int width = end_bit - begin_bit;
      u = U(u >> begin_bit);
      if (width < int(sizeof(U) * 8)) u = U(u & U((U(1) << width) - 1));
      return u;
    };
    std::vector<KeyT> keys(d_keys_in, d_keys_in + n);
    std::vector<ValueT> values(d_values_in, d_values_in + n);
    std::vector<size_t> order(n);
    std::iota(order.begin(), order.end(), size_t(0));
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return ordered(keys[a]) < ordered(keys[b]); });
    for (size_t i = 0; i < n; ++i) {
      d_keys_out[i] = keys[order[i]];
      d_values_out[i] = values[order[i]];
    }
    std::memset(d_temp_storage, 0xff, std::min<size_t>(temp_storage_bytes, 256));  // scratch: garbage after the call
    return cudaSuccess;
  }
};

}  // namespace cub
