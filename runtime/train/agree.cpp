#include "runtime/train/agree.h"

#include <cstdint>
#include <vector>

#include "comm/world.h"

namespace mt {

namespace {

// FNV-1a 64 of the message; 0 stands for "no error".
uint64_t message_hash(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : s) h = (h ^ ch) * 1099511628211ull;
  return h == 0 ? 1 : h;
}

}  // namespace

void agree_on_error(const MpiEnv& env, std::exception_ptr error, std::string_view label) {
  std::string msg;
  int code = 1;
  if (error) {
    try {
      std::rethrow_exception(error);
    } catch (const ReportedError& e) {
      msg = e.what(), code = e.code;
    } catch (const std::exception& e) {
      msg = e.what();
    } catch (...) {
      msg = "unknown error";
    }
  }
  uint64_t mine = error ? message_hash(msg) : 0;
  std::vector<uint64_t> all(size_t(env.size()), mine);  // (world size) each rank's hash
  if (env.size() > 1) all = world::all_gather(mine, fmt::format("errors in {}", label));
  std::string failed;
  bool same = true;
  for (int r = 0; r < env.size(); ++r) {
    if (all[size_t(r)] != 0) failed += (failed.empty() ? "" : ",") + std::to_string(r);
    same = same && all[size_t(r)] == all[0];
  }
  if (failed.empty()) return;
  if (same) throw ReportedError(msg, code, env.rank() == 0);
  if (error) throw ReportedError(msg, code, true);
  throw ReportedError(
      fmt::format("[{}] ranks {} failed (their messages are above); this rank had no error", label, failed), code,
      env.rank() == 0);
}

}  // namespace mt
