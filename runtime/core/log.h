// Logging through spdlog. Every line carries the rank ("[r3] ..."); rank 0
// logs at info by default, the other ranks at warn, so a 64-rank job prints
// one copy of progress but every rank's warnings and errors.
#pragma once
#include <string>

#include <spdlog/spdlog.h>

namespace mt {

// level: trace, debug, info, warn, error, off. Empty keeps the default.
void init_logging(int rank, const std::string& level = "");
spdlog::level::level_enum parse_log_level(const std::string& level);  // throws "[log] ..."

}  // namespace mt

#define MT_LOG_INFO(...) ::spdlog::info(__VA_ARGS__)
#define MT_LOG_WARN(...) ::spdlog::warn(__VA_ARGS__)
#define MT_LOG_ERROR(...) ::spdlog::error(__VA_ARGS__)
#define MT_LOG_DEBUG(...) ::spdlog::debug(__VA_ARGS__)
