// The operator endpoint: a small HTTP/1.1 server of our own (poll() on one thread) that reads a Telemetry.
//
//   GET /metrics  Prometheus text format 0.0.4 (Telemetry::prometheus_text)
//   GET /healthz  200 while the loop's heartbeat is younger than the telemetry's timeout, else 503
//   GET /readyz   200 after setup finished and while the run is not stopping, else 503
//   GET /memory   asks the loop for a memory report (written after the current step; the telemetry lets
//                 the loop take at most one request per interval) and answers with the latest one already
//                 written (200, application/json), or 202 when there is none yet
//   GET /         the list of endpoints
//   (HEAD as GET without the body; any other method 405)
//
// Off unless log.http_port > 0; binds to log.http_host (127.0.0.1 by default: reachable from the pod or
// host only; 0.0.0.0 for a Kubernetes probe from the kubelet).
//
// Built for hostile clients, with every resource bounded: a request's line and headers must fit in
// max_request_bytes (else 414 / 431 and the connection closes) and arrive whole within read_timeout_s of
// the connection or of its previous response (a slowloris client dripping one byte at a time is cut
// off); a response must be taken within write_timeout_s; at most max_connections are open, and a new
// one past that closes the oldest, so silent connections cannot starve a probe; a connection reads
// nothing more while its response is unsent (pipelined requests are answered in order, and a client
// that never reads holds one response). All sockets are non-blocking and the destructor wakes the one
// thread at once: stopping never waits on a client. cpp-httplib (used before) could give none of these
// bounds in Debian's prebuilt 0.11 (docs/OPERATIONS.md, "The endpoint").
#pragma once

#include <memory>
#include <string>

namespace trainer {

class Telemetry;

struct HttpServerOptions {
  std::string host = "127.0.0.1";  ///< address to bind ("0.0.0.0" = all IPv4 interfaces; a name is resolved)
  int port = 0;                    ///< TCP port; 0 = a free port chosen by the system (see port())
  int max_connections = 32;        ///< open connections (>= 1); one more closes the oldest
  int max_request_bytes = 8192;    ///< request line plus headers (>= 256)
  int max_requests_per_connection = 100;  ///< then the connection closes (>= 1)
  double read_timeout_s = 2.0;     ///< a whole request head, from the connection or the first byte after a response (> 0)
  double write_timeout_s = 2.0;    ///< a whole response (> 0)
  double idle_timeout_s = 2.0;     ///< a kept-alive connection that sends nothing more is closed after this (> 0)
  std::string root = "/";          ///< where /proc and /sys are read for /metrics (tests use a fake tree)
};

/// Serves `telemetry` until destroyed. The Telemetry must outlive the server.
class HttpServer {
 public:
  /// Binds host:port now and starts serving on a background thread. Throws std::runtime_error naming
  /// host and port when the address cannot be bound (in use, not an address of this machine), and
  /// std::invalid_argument for bad options. The port is bound without SO_REUSEPORT: a second trainer on
  /// the same port fails instead of sharing it.
  HttpServer(Telemetry& telemetry, const std::string& host, int port);
  HttpServer(Telemetry& telemetry, HttpServerOptions options);
  /// Stops at once: wakes the server's thread, which closes every connection (answered or not) and ends;
  /// never waits for a client.
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  /// The bound port (the chosen one when constructed with port 0).
  int port() const;
  const std::string& host() const;
  /// "http://host:port".
  std::string url() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace trainer
