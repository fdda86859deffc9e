// A checkpoint's meta.json and its own checksum (runtime/train/checkpoint.h, meta_checksum): the canonical text
// survives the file's round trip (indented, numbers an MoE bias holds), every edit that a load would read changes it,
// and every read of meta.json (checkpoint_config here) refuses an edited one, or a format-4 one without the checksum,
// and accepts one written before format 4. The end-to-end resume cases are in tests/cli/test_checkpoint.sh.
#include <doctest/doctest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "check_error.h"
#include "runtime/train/checkpoint.h"
#include "runtime/train/run_config.h"
#include "test_util.h"

using namespace mt;
using nlohmann::json;

namespace {

// A meta.json's content as a save writes it, checksum included.
json sample_meta() {
  static const Config config;
  json m;
  m["format_version"] = 4;
  m["step"] = 12;
  m["optimizer_steps"] = 12;
  m["data"] = {{"epoch", 0}, {"offset", 3072}, {"next_step", 12}};
  m["rng"] = {{"seed", std::numeric_limits<uint64_t>::max()}};
  m["config"] = config_to_yaml(config);
  // An f32 bias read back as doubles: tiny, negative zero, the largest finite f32.
  m["model_state"] = {{"router_bias", {{0.019999999552965164, -2.2351741291171123e-10, -0.0, 3.4028234663852886e38}}}};
  m["checksums"] = {{"config.json", "xxh3-64:0123456789abcdef"}};
  m["meta_checksum"] = meta_checksum(m);
  return m;
}

void write(const std::string& path, const json& m) {
  std::ofstream f(path);
  f << m.dump(2) << "\n";
}

}  // namespace

TEST_CASE("checkpoint meta.json: its own checksum survives the file, ignores itself and changes with any field") {
  const json m = sample_meta();
  // As a load sees it: the indented file parsed back.
  CHECK(meta_checksum(json::parse(m.dump(2))) == m["meta_checksum"].get<std::string>());
  json other = m;
  other["meta_checksum"] = "xxh3-64:0000000000000000";
  CHECK(meta_checksum(other) == m["meta_checksum"].get<std::string>());
  for (const char* key : {"step", "optimizer_steps"}) {
    json e = m;
    e[key] = 11;
    CHECK_MESSAGE(meta_checksum(e) != m["meta_checksum"].get<std::string>(), key);
  }
  json bias = m;
  bias["model_state"]["router_bias"][0][0] = 0.029999999329447746;
  CHECK(meta_checksum(bias) != m["meta_checksum"].get<std::string>());
  json dropped = m;
  dropped["checksums"].erase("config.json");
  CHECK(meta_checksum(dropped) != m["meta_checksum"].get<std::string>());
}

TEST_CASE("checkpoint meta.json: every read refuses an edited one or a format-4 one without its checksum") {
  test::TempDir dir("ckpt_meta");
  const std::string meta = dir / "meta.json";
  json m = sample_meta();
  write(meta, m);
  CHECK_NOTHROW(checkpoint_config(dir.path.string()));

  json e = m;
  e["step"] = 11;
  write(meta, e);
  CHECK_ERROR_CONTAINS(checkpoint_config(dir.path.string()), meta + ": checksum mismatch");

  e = m;
  e.erase("meta_checksum");
  write(meta, e);
  CHECK_ERROR_CONTAINS(checkpoint_config(dir.path.string()), meta + ": checksum missing (format_version 4");

  // Written before format 4: no checksum of its own, read as it is (verify_checkpoint warns).
  e["format_version"] = 3;
  e["step"] = 11;
  write(meta, e);
  CHECK_NOTHROW(checkpoint_config(dir.path.string()));

  std::filesystem::remove(meta);
  CHECK_ERROR_CONTAINS(checkpoint_config(dir.path.string()), meta + ": missing");
}
