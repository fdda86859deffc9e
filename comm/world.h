// The whole job, as the layers above comm/ see it: this rank's place and the small host-side collectives over
// every rank (the config agreement, errors printed once, the calibration's timing, the trace files), with no MPI
// type in sight. Each collective is one of control.h's: non-blocking MPI polled under the watchdog, with the
// arrival markers that let a timeout name the ranks that never reached `label`. Every rank calls the same ones in
// the same order with the same labels.
#pragma once
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include "comm/group.h"

namespace mt {

// Clock alignment for traces: rank 0 and each other rank in turn ping-pong `rounds` times (blocking
// point-to-point under the watchdog); each rank keeps the round with the smallest round trip and estimates the
// offset to add to its steady clock to read rank 0's (rank 0's time at the reply minus the round trip's middle).
// zero_ns: rank 0's clock when the sync ended (broadcast), the traces' zero.
struct ClockSync {
  int64_t offset_ns = 0, zero_ns = 0, rtt_ns = 0;
};

namespace world {

// This process's rank in the job and the job's ranks (what MpiEnv says; callable where no MpiEnv is at hand).
int rank();
int size();

// Returns once every rank has reached it. extra_wait_s: how much longer than comm.timeout_s a rank may wait here
// before the watchdog ends the job, for a point where one rank does work in proportion to a size every rank knows
// (writing a trace of n events) while the others wait.
void barrier(std::string_view label, double extra_wait_s = 0);

// The element types of the reductions.
template <class T>
concept Reducible =
    std::same_as<T, int> || std::same_as<T, int64_t> || std::same_as<T, uint64_t> || std::same_as<T, double>;

// Element-wise over the ranks, in place (avg: the sum divided by size(), in T's arithmetic).
template <Reducible T> void all_reduce(std::span<T> values, ReduceOp op, std::string_view label);
template <Reducible T> T all_reduce(T value, ReduceOp op, std::string_view label) {
  all_reduce(std::span<T>(&value, 1), op, label);
  return value;
}

namespace detail {
// out (size() * mine.size() bytes) <- every rank's mine, rank r's at r * mine.size().
void all_gather_bytes(std::span<std::byte> out, std::span<const std::byte> mine, std::string_view label);
template <class T> constexpr bool is_span = false;
template <class T, size_t N> constexpr bool is_span<std::span<T, N>> = true;
}  // namespace detail

// Every rank's n values, rank r's at [r * n, (r + 1) * n).
template <class T> std::vector<T> all_gather(std::span<const T> mine, std::string_view label) {
  static_assert(std::is_trivially_copyable_v<T>, "world::all_gather moves the values' bytes");
  std::vector<T> all(mine.size() * size_t(size()));
  detail::all_gather_bytes(std::as_writable_bytes(std::span<T>(all)), std::as_bytes(mine), label);
  return all;
}
// Every rank's value, by rank.
template <class T> std::vector<T> all_gather(const T& mine, std::string_view label) {
  static_assert(!detail::is_span<T>, "n values each: pass a std::span<const T>");
  return all_gather(std::span<const T>(&mine, 1), label);
}

// bytes <- root's bytes (the same size on every rank).
void broadcast(std::span<std::byte> bytes, int root, std::string_view label);

// Collective; labelled "clock sync" and "clock sync zero".
ClockSync clock_sync(int rounds = 8);

}  // namespace world

}  // namespace mt
