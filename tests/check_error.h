// Checks that an expression throws mt::Error whose message contains a text.
#pragma once
#include <doctest/doctest.h>

#include <string>

#include "runtime/core/error.h"

#define CHECK_ERROR_CONTAINS(expr, text)                                                            \
  do {                                                                                              \
    std::string mt_msg_;                                                                            \
    try {                                                                                           \
      (void)(expr);                                                                                 \
    } catch (const mt::Error& e) {                                                                  \
      mt_msg_ = e.what();                                                                           \
    }                                                                                               \
    INFO("message: ", mt_msg_);                                                                     \
    CHECK_MESSAGE(mt_msg_.find(text) != std::string::npos, "expected an error containing: ", text); \
  } while (0)
