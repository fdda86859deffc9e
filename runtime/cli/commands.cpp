#include "runtime/cli/command.h"

#include <charconv>
#include <cmath>
#include <cstdlib>

#include <fmt/format.h>

namespace mt {

const std::vector<Command>& commands() {
  static const std::vector<Command> table = {check_command(),    layout_command(), train_command(),
                                             plan_command(),     estimate_command(), generate_command(),
                                             logits_command(),   export_command(),   tokenize_command(), supervise_command(),
                                             trace_command()};
  return table;
}

const Command* command_without_mpi(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--") break;
    for (const Command& c : commands())
      if (c.name == a) return c.needs_mpi ? nullptr : &c;
  }
  return nullptr;
}

CLI::Validator whole_number(long long min, long long max) {
  const std::string desc = max == INT_MAX ? (min == 0 ? "NONNEGATIVE" : fmt::format(">= {}", min))
                                          : fmt::format("in [{} - {}]", min, max);
  return CLI::Validator(
      [min, max](std::string& s) -> std::string {
        const char* b = s.data() + (s.size() > 1 && s[0] == '+');
        long long v = 0;
        const auto [end, ec] = std::from_chars(b, s.data() + s.size(), v);
        if (ec == std::errc::result_out_of_range && end == s.data() + s.size())
          return s[0] == '-' ? fmt::format("must be at least {}, got {}", min, s)
                             : fmt::format("must be at most {}, got {}", max, s);
        if (ec != std::errc() || end != s.data() + s.size() || b == end)
          return fmt::format("must be an integer, got '{}'", s);
        if (v < min) return fmt::format("must be at least {}, got {}", min, v);
        if (v > max) return fmt::format("must be at most {}, got {}", max, v);
        s = std::to_string(v);
        return "";
      },
      desc);
}

CLI::Validator number_at_least(double min) {
  return CLI::Validator(
      [min](std::string& s) -> std::string {
        char* end = nullptr;
        const double v = s.empty() ? 0 : std::strtod(s.c_str(), &end);
        if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(v))
          return fmt::format("must be a number, got '{}'", s);
        if (v < min) return fmt::format("must be at least {:g}, got {}", min, s);
        return "";
      },
      min == 0 ? "NONNEGATIVE" : fmt::format(">= {:g}", min));
}

}  // namespace mt
