// Redistribution of device tensors: with NCCL (one rank per GPU) and with the
// MPI backend staging through the host (several ranks sharing one GPU).
#include <doctest/doctest.h>
#include <mpi.h>

#include <cstdlib>

#include "comm/nccl/nccl_group.h"
#include "parallel/dtensor.h"
#include "runtime/core/stream.h"
#include "../mpi/mpi_world.h"
#include "../skip.h"

using namespace mt;

namespace {

int check_all_pairs(const DeviceMesh& mesh) {
  std::vector<Placement> one{Placement::Replicate(), Placement::Shard(0), Placement::Shard(1),
                             Placement::Partial(ReduceOp::sum), Placement::Partial(ReduceOp::max)};
  int bad = 0;
  int k = 0;
  for (Shape s : std::vector<Shape>{{8, 6}, {5, 3}, {1, 2}, {3, 7, 5}})
    for (auto& a : one)
      for (auto& b : one) {
        if (a.is_partial() && b.is_partial() && a.op != b.op) continue;
        DType dt = (k++ % 2) ? DType::i64 : DType::f32;
        std::vector<double> v(static_cast<size_t>(shape_numel(s)));
        for (size_t i = 0; i < v.size(); ++i) v[i] = 8.0 * double(i + 1);
        Tensor x = from_values(v, s, dt);
        INFO(mesh.backend(), " ", dtype_name(dt), " ", shape_str(s), " ", a.str(), " -> ", b.str());
        DTensor src = distribute_tensor(x.to(mesh.device()), mesh, {a});
        CHECK(src.local.device() == mesh.device());
        const int64_t syncs = host_sync_count();
        DTensor dst = redistribute(src, {b});
        // On NCCL the redistribution packs, communicates and unpacks on the device: the host waits for nothing,
        // except where R or S -> P(sum) divides by the mesh size on the host (parallel/dtensor.cpp, local_partial):
        // integer dtypes, and mesh sizes that are not powers of two.
        const int n = mesh.size();
        const bool host_divide = b.is_partial() && b.op == ReduceOp::sum && !a.is_partial() && dt == DType::i64;
        if (mesh.backend() == "nccl" && (n & (n - 1)) == 0 && !host_divide) CHECK(host_sync_count() == syncs);
        CHECK(dst.local.device() == mesh.device());
        Tensor back = full_tensor(dst).to(Device::cpu());
        if (!equal(back, x)) {
          ++bad;
          MESSAGE(mesh.backend(), " ", shape_str(s), " ", a.str(), " -> ", b.str(), " got ", back.str());
        }
      }
  return bad;
}

}  // namespace

TEST_CASE("redistribute device tensors with the MPI backend (staged through the host)") {
  if (cuda_device_count() == 0) MT_SKIP("no GPU");
  MeshOptions o;
  int local = 0;
  if (const char* l = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK")) local = std::atoi(l);
  o.device = Device::cuda(local % cuda_device_count());
  o.backend = "mpi";
  DeviceMesh mesh = DeviceMesh::create({{"dp_shard", world_size()}}, o);
  CHECK(check_all_pairs(mesh) == 0);
}

TEST_CASE("redistribute device tensors with NCCL") {
  if (cuda_device_count() == 0 || world_size() > cuda_device_count()) MT_SKIP("NCCL needs one GPU per rank");
  MeshOptions o;
  int local = 0;
  if (const char* l = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK")) local = std::atoi(l);
  o.device = Device::cuda(local % cuda_device_count());
  o.backend = "nccl";
  DeviceMesh mesh = DeviceMesh::create({{"dp_shard", world_size()}}, o);
  CHECK(check_all_pairs(mesh) == 0);
}

TEST_CASE("the auto backend: NCCL when every rank has its own GPU, staged MPI when ranks share one") {
  if (cuda_device_count() == 0) MT_SKIP("no GPU");
#if defined(MT_CUDA_EMULATED)
  // Below, more ranks than devices means ranks share one (one node); each process's emulated devices are its own.
  if (world_size() > cuda_device_count())
    MT_SKIP("emulated devices are each process's own (tests/emu: ranks never share one): needs MT_EMU_DEVICES >= ranks");
#endif
  MeshOptions o;
  int local = 0;
  if (const char* l = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK")) local = std::atoi(l);
  o.device = Device::cuda(local % cuda_device_count());
  DeviceMesh mesh = DeviceMesh::create({{"dp_shard", world_size()}}, o);  // backend auto
  const bool shared = world_size() > cuda_device_count();                 // one node: some ranks get the same device
  CHECK(mesh.backend() == (shared ? "mpi" : "nccl"));
  if (shared) {
    o.backend = "nccl";
    std::string what;
    try {
      DeviceMesh::create({{"dp_shard", world_size()}}, o);
    } catch (const Error& e) {
      what = e.what();
    }
    CHECK(what.find("[mesh] comm.backend nccl: world ranks") != std::string::npos);
    CHECK(what.find("share the GPU") != std::string::npos);
  }
}
