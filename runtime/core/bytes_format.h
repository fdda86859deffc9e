// Byte figures as every command prints them: "12.34 MiB", and from 1 GiB up "1.23 GiB".
#pragma once
#include <fmt/format.h>

#include <string>

namespace mt {

inline std::string format_mib(double bytes, int decimals = 2) {
  return fmt::format("{:.{}f} MiB", bytes / double(1 << 20), decimals);
}
inline std::string format_bytes(double bytes) {
  return bytes >= double(1 << 30) ? fmt::format("{:.2f} GiB", bytes / double(1 << 30)) : format_mib(bytes);
}

}  // namespace mt
