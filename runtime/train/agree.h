// Errors that every rank hits at the same point are printed once. Start-up
// (config, command line, data files, the mesh's sizes) fails the same way on
// every rank when the inputs are the same, and 64 copies of one message bury
// it; a file missing on one node fails differently there, and that rank must
// say so. agree_on_error compares the ranks' errors (one small all-gather of
// message hashes, watched like every collective) at a point every rank
// reaches without communicating before it.
#pragma once
#include <exception>
#include <string>
#include <string_view>

#include "comm/env.h"
#include "runtime/core/error.h"

namespace mt {

// An error already handled across the job: every rank leaves with code, and only the ranks with print set print
// what() (the others stay quiet). No rank waits in a collective, so the job ends without an abort.
struct ReportedError : Error {
  ReportedError(const std::string& msg, int code, bool print) : Error(msg), code(code), print(print) {}
  int code;
  bool print;
};

// Every rank calls this at the same point with what it caught there (nullptr: nothing). Returns when no rank failed;
// otherwise throws ReportedError on every rank: when all ranks failed with the same message, rank 0 prints it;
// when the messages differ, each failing rank prints its own, and rank 0 (if it did not fail) names the ranks
// that did. label names the point ("the config") in the watchdog's messages.
void agree_on_error(const MpiEnv& env, std::exception_ptr error, std::string_view label);

// Runs fn (which must not communicate), then agree_on_error on what it threw.
template <class F> void run_agreed(const MpiEnv& env, std::string_view label, F&& fn) {
  std::exception_ptr error;
  try {
    fn();
  } catch (...) {
    error = std::current_exception();
  }
  agree_on_error(env, error, label);
}

}  // namespace mt
