// The program the fault tests run under mpirun: every rank enters an
// all_reduce on the world, except the last rank, which either exits at once
// (--mode exit) or sleeps far past the timeout (--mode stall). The job must
// end non-zero within the timeout plus a few seconds, with the watchdog's
// message naming the collective, the group and the rank.
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "comm/env.h"
#include "comm/mesh.h"
#include "comm/watchdog.h"
#include "runtime/core/log.h"

int main(int argc, char** argv) {
  mt::MpiEnv env(&argc, &argv);
  mt::init_logging(env.rank());
  const char* mode = argc > 1 ? argv[1] : "stall";
  double timeout = argc > 2 ? std::atof(argv[2]) : 3.0;
  mt::watchdog_set_timeout(timeout);
  // Two dims, so that "world" is a flattened group of its own (on one dim it would be that dim's group).
  mt::DeviceMesh mesh = mt::DeviceMesh::create({{"dp_replicate", env.size()}, {"tp", 1}});
  // "split": the missing rank never joins the creation of a group (itself collective).
  if (std::strcmp(mode, "split") == 0 && env.rank() != env.size() - 1) mesh.group("world");
  if (env.rank() == env.size() - 1) {
    if (std::strcmp(mode, "exit") == 0) std::_Exit(3);
    if (std::strcmp(mode, "split") == 0) std::this_thread::sleep_for(std::chrono::seconds(600));
    std::this_thread::sleep_for(std::chrono::seconds(600));
  }
  mt::Tensor t = mt::zeros({16}, mt::DType::f32);
  mesh.group(0).all_reduce(t, mt::ReduceOp::sum);
  return 0;
}
