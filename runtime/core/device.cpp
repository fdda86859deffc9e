#include "runtime/core/device.h"

#include <cstdlib>

#include "runtime/core/error.h"

namespace mt {

Device Device::parse(const std::string& s) {
  if (s == "cpu") return cpu();
  if (s == "cuda") return cuda(0);
  if (s.rfind("cuda:", 0) == 0) {
    char* end = nullptr;
    long i = std::strtol(s.c_str() + 5, &end, 10);
    if (end && *end == '\0' && end != s.c_str() + 5 && i >= 0) return cuda(int(i));
  }
  fail("core", "bad device '{}' (expected cpu, cuda or cuda:N)", s);
}

}  // namespace mt
