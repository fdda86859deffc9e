// Errors are exceptions whose message starts with the component: "[comm] ...".
// The check_* functions turn a library status into one, adding file, line,
// rank and host so that a message from rank 5 of 64 says where it came from.
#pragma once
#include <stdexcept>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace mt {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// This process's identity in error messages; set once MPI is up.
void set_process_identity(int rank, std::string host);
int process_rank();  // -1 before MPI is initialised
const std::string& process_host();
std::string where(const char* file, int line);  // "file:line, rank R on host H"

template <typename... Args>
[[noreturn]] void fail(std::string_view component, fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format("[{}] ", component) + fmt::format(f, std::forward<Args>(args)...));
}

[[noreturn]] void fail_mpi(int code, const char* call, const char* file, int line);
[[noreturn]] void fail_cuda(int code, const char* call, const char* file, int line);
[[noreturn]] void fail_cublas(int code, const char* call, const char* file, int line);
[[noreturn]] void fail_nccl(int code, void* comm, const char* call, const char* file, int line);

}  // namespace mt

#define MT_CHECK(cond, component, ...)               \
  do {                                               \
    if (!(cond)) ::mt::fail(component, __VA_ARGS__); \
  } while (0)

// MPI_SUCCESS is 0 in every MPI; the macro avoids including mpi.h here.
#define MT_MPI_CHECK(call)                                              \
  do {                                                                  \
    int mt_rc_ = (call);                                                \
    if (mt_rc_ != 0) ::mt::fail_mpi(mt_rc_, #call, __FILE__, __LINE__); \
  } while (0)
#define MT_CUDA_CHECK(call)                                              \
  do {                                                                   \
    int mt_rc_ = static_cast<int>(call);                                 \
    if (mt_rc_ != 0) ::mt::fail_cuda(mt_rc_, #call, __FILE__, __LINE__); \
  } while (0)
#define MT_CUBLAS_CHECK(call)                                              \
  do {                                                                     \
    int mt_rc_ = static_cast<int>(call);                                   \
    if (mt_rc_ != 0) ::mt::fail_cublas(mt_rc_, #call, __FILE__, __LINE__); \
  } while (0)
// comm: the ncclComm_t, for ncclGetLastError (may be nullptr).
#define MT_NCCL_CHECK(call, comm)                                                       \
  do {                                                                                  \
    int mt_rc_ = static_cast<int>(call);                                                \
    if (mt_rc_ != 0) ::mt::fail_nccl(mt_rc_, (void*)(comm), #call, __FILE__, __LINE__); \
  } while (0)
