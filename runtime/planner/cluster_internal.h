// What the cluster files share (cluster.cpp: the spec and its YAML; time_model.cpp; calibrate.cpp): the collective
// kinds the files and the time model know. Internal to runtime/planner.
#pragma once
#include <string>
#include <vector>

namespace mt::cluster_detail {

// The kinds collective_seconds knows (comm_counters.h's kinds).
extern const std::vector<std::string> kKinds;
// The kinds the runtime also issues non-blocking: bandwidth_gbs_by_kind may hold "<kind>_async" for them.
extern const std::vector<std::string> kAsyncKinds;
// "all_reduce, all_gather, ...": for messages.
std::string kinds_list(const std::vector<std::string>& kinds = kKinds);
bool known_kind(const std::string& k);

}  // namespace mt::cluster_detail
