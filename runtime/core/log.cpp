#include "runtime/core/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include "runtime/core/error.h"

namespace mt {

spdlog::level::level_enum parse_log_level(const std::string& level) {
  for (auto [name, lvl] : {std::pair{"trace", spdlog::level::trace}, {"debug", spdlog::level::debug},
                           {"info", spdlog::level::info}, {"warn", spdlog::level::warn},
                           {"error", spdlog::level::err}, {"off", spdlog::level::off}})
    if (level == name) return lvl;
  fail("log", "bad log level '{}' (expected trace, debug, info, warn, error or off)", level);
}

void init_logging(int rank, const std::string& level) {
  // The level first: a bad one throws while the current logger (the one the error is reported through) still
  // exists; dropping it first left no default logger, and reporting the error crashed every rank.
  auto lvl = level.empty() ? spdlog::level::info : parse_log_level(level);
  // stderr for every rank: stdout stays for tables and results a user may pipe.
  spdlog::drop("meshtrain");  // init_logging may be called again (tests, --log-level)
  auto logger = spdlog::stderr_color_mt("meshtrain");
  logger->set_pattern(fmt::format("[%H:%M:%S.%e] [r{}] [%^%l%$] %v", rank));
  if (!level.empty()) {
    // An explicit level applies to rank 0; other ranks never go below warn so
    // that 64 ranks do not print 64 copies (debug and trace apply everywhere).
    logger->set_level(rank == 0 || lvl < spdlog::level::info ? lvl : std::max(lvl, spdlog::level::warn));
  } else {
    logger->set_level(rank == 0 ? spdlog::level::info : spdlog::level::warn);
  }
  logger->flush_on(spdlog::level::warn);
  spdlog::set_default_logger(logger);
}

}  // namespace mt
