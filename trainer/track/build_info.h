// What a tracked run records about where it ran: the commit the trainer was built from, the host.
#pragma once

#include <string>

namespace trainer::track {

/// The git commit this build is of (40 hex digits), or "unknown" for a build outside a git checkout.
std::string build_commit();

/// This machine's host name (a pod's name in Kubernetes); "" if the system gives none.
std::string host_name();

}  // namespace trainer::track
