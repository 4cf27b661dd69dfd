// The operator endpoint: a small HTTP server (cpp-httplib) on its own threads that reads a Telemetry.
//
//   GET /metrics  Prometheus text format 0.0.4 (Telemetry::prometheus_text)
//   GET /healthz  200 while the loop's heartbeat is younger than the telemetry's timeout, else 503
//   GET /readyz   200 after setup finished and while the run is not stopping, else 503
//   GET /memory   asks the loop for a memory report (written after the current step) and answers with
//                 the latest one already written (200, application/json), or 202 when there is none yet
//   GET /         the list of endpoints
//
// Off unless log.http_port > 0; binds to log.http_host (127.0.0.1 by default: reachable from the pod or
// host only; 0.0.0.0 for a Kubernetes probe from the kubelet). A slow or silent client holds one of the
// server's threads for at most the read timeout, never the training loop, which only writes into the
// Telemetry.
#pragma once

#include <memory>
#include <string>

namespace trainer {

class Telemetry;

struct HttpServerOptions {
  std::string host = "127.0.0.1";  ///< address to bind ("0.0.0.0" = all IPv4 interfaces)
  int port = 0;                    ///< TCP port; 0 = a free port chosen by the system (see port())
  int threads = 2;                 ///< request threads (>= 1); each silent client holds one until a timeout
  double read_timeout_s = 2.0;     ///< per read of a request (> 0)
  double write_timeout_s = 2.0;    ///< per write of a response (> 0)
  double idle_timeout_s = 2.0;     ///< a connection that sends nothing is closed after this (> 0)
  std::string root = "/";          ///< where /proc and /sys are read for /metrics (tests use a fake tree)
};

/// Serves `telemetry` until destroyed. The Telemetry must outlive the server.
class HttpServer {
 public:
  /// Binds host:port now and starts serving on a background thread. Throws std::runtime_error naming
  /// host and port when the address cannot be bound (in use, not an address of this machine), and
  /// std::invalid_argument for bad options. Unlike cpp-httplib's default, the port is bound without
  /// SO_REUSEPORT: a second trainer on the same port fails instead of sharing it.
  HttpServer(Telemetry& telemetry, const std::string& host, int port);
  HttpServer(Telemetry& telemetry, HttpServerOptions options);
  /// Stops accepting, finishes or drops the open connections (at most about the idle timeout) and
  /// joins the threads.
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
