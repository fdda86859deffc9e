// TEMPORARY stand-in (the real one comes from the h-ground branch).
#pragma once
#include <cstddef>
#include <span>
#include <string_view>
#include <vector>

#include "comm/group.h"

namespace mt::world {
int rank();
int size();
void barrier(std::string_view label);
template <class T> void all_reduce(std::span<T> values, ReduceOp op, std::string_view label);
template <class T> T all_reduce(T value, ReduceOp op, std::string_view label) {
  all_reduce(std::span<T>(&value, 1), op, label);
  return value;
}
void all_gather_bytes(void* out, const void* in, size_t bytes, std::string_view label);
template <class T> std::vector<T> all_gather(const T& mine, std::string_view label) {
  std::vector<T> out(static_cast<size_t>(size()));
  all_gather_bytes(out.data(), &mine, sizeof(T), label);
  return out;
}
void broadcast(std::span<std::byte> bytes, int root, std::string_view label);
}  // namespace mt::world
