#include <doctest/doctest.h>

#include "check_error.h"
#include "comm/mesh.h"

using namespace mt;

TEST_CASE("mesh specs parse in the order given, with one inferred size") {
  auto d = parse_mesh_spec("dp_shard=2,cp=2,tp=2", 8);
  REQUIRE(d.size() == 3);
  CHECK(d[0].name == "dp_shard");
  CHECK(d[2].size == 2);
  auto e = parse_mesh_spec("dp_replicate=-1,tp=2", 8);
  CHECK(e[0].size == 4);
  CHECK(mesh_str(e) == "dp_replicate=4,tp=2");
}

TEST_CASE("bad mesh specs name the problem") {
  CHECK_ERROR_CONTAINS(parse_mesh_spec("dp_shard=2,tp=2", 8),
                       "[mesh] mesh dp_shard=2,tp=2 has 4 ranks but the job has 8");
  CHECK_ERROR_CONTAINS(parse_mesh_spec("tp=-1,cp=-1", 8), "only one dim may be -1");
  CHECK_ERROR_CONTAINS(parse_mesh_spec("tp=3,dp=-1", 8), "does not divide 8 ranks");
  CHECK_ERROR_CONTAINS(parse_mesh_spec("tp", 8), "bad mesh dim 'tp'");
  CHECK_ERROR_CONTAINS(parse_mesh_spec("tp=x", 8), "mesh dim 'tp' has size 'x'");
  CHECK_ERROR_CONTAINS(parse_mesh_spec("tp=0", 8), "has size '0'");
  CHECK_ERROR_CONTAINS(parse_mesh_spec("tp=2,tp=4", 8), "mesh dim 'tp' appears twice");
  CHECK_ERROR_CONTAINS(parse_mesh_spec("world=8", 8), "'world' cannot name a mesh dim");
}
