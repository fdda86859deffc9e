// The emulated device's tests: what a call writes to stderr (the stand-ins' "[cuda-emu] CALL: WHAT" reports),
// captured through a temporary file, then still shown.
#pragma once
#include <unistd.h>

#include <cstdio>
#include <string>

struct CaptureStderr {
  FILE* tmp = std::tmpfile();
  int saved = dup(2);
  CaptureStderr() {
    std::fflush(stderr);
    dup2(fileno(tmp), 2);
  }
  std::string text() {
    std::fflush(stderr);
    dup2(saved, 2);
    close(saved);
    saved = -1;
    std::string s;
    std::rewind(tmp);
    char buf[512];
    for (size_t n; (n = std::fread(buf, 1, sizeof buf, tmp)) > 0;) s.append(buf, n);
    std::fclose(tmp);
    std::fputs(s.c_str(), stderr);  // still shown
    return s;
  }
  ~CaptureStderr() {
    if (saved >= 0) text();
  }
};
