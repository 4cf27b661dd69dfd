#include "trainer/observe/http.h"

// Only this file includes cpp-httplib (see third_party/deps.cmake for the defines Debian's build needs).
#include <httplib.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <stdexcept>
#include <thread>

#include "trainer/observe/telemetry.h"

namespace trainer {

struct HttpServer::Impl {
  Telemetry& telemetry;
  HttpServerOptions opt;
  httplib::Server server;
  std::thread thread;
  int port = 0;
  std::atomic<bool> finished{false};

  Impl(Telemetry& t, HttpServerOptions o) : telemetry(t), opt(std::move(o)) {}
};

namespace {

void split_seconds(double s, time_t& sec, time_t& usec) {
  sec = static_cast<time_t>(std::floor(s));
  usec = static_cast<time_t>(std::llround((s - std::floor(s)) * 1e6));
}

}  // namespace

HttpServer::HttpServer(Telemetry& telemetry, const std::string& host, int port)
    : HttpServer(telemetry, [&] {
        HttpServerOptions o;
        o.host = host;
        o.port = port;
        return o;
      }()) {}

HttpServer::HttpServer(Telemetry& telemetry, HttpServerOptions options)
    : impl_(std::make_unique<Impl>(telemetry, std::move(options))) {
  const HttpServerOptions& o = impl_->opt;
  if (o.port < 0 || o.port > 65535)
    throw std::invalid_argument("http: port must be in [0, 65535] (0 = any free port), got " + std::to_string(o.port));
  if (o.threads < 1) throw std::invalid_argument("http: threads must be >= 1, got " + std::to_string(o.threads));
  if (!(o.read_timeout_s > 0) || !(o.write_timeout_s > 0) || !(o.idle_timeout_s > 0))
    throw std::invalid_argument("http: read, write and idle timeouts must be > 0 seconds");

  httplib::Server& s = impl_->server;
  const int threads = o.threads;
  // A fixed, small pool: the endpoint must never compete with the training threads for CPUs.
  s.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  time_t sec, usec;
  split_seconds(o.read_timeout_s, sec, usec);
  s.set_read_timeout(sec, usec);
  split_seconds(o.write_timeout_s, sec, usec);
  s.set_write_timeout(sec, usec);
  s.set_keep_alive_timeout(static_cast<time_t>(std::max(1.0, std::ceil(o.idle_timeout_s))));
  s.set_keep_alive_max_count(100);
  s.set_payload_max_length(64 * 1024);  // requests carry no body worth reading
  // cpp-httplib sets SO_REUSEPORT by default, which lets a second process bind the same port and take
  // half the scrapes; SO_REUSEADDR alone still allows a quick restart over TIME_WAIT sockets.
  s.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });

  Telemetry& t = impl_->telemetry;
  const std::string root = o.root;
  s.Get("/metrics", [&t, root](const httplib::Request&, httplib::Response& res) {
    res.set_content(t.prometheus_text(root), "text/plain; version=0.0.4; charset=utf-8");
  });
  s.Get("/healthz", [&t](const httplib::Request&, httplib::Response& res) {
    std::string why;
    res.status = t.live(&why) ? 200 : 503;
    res.set_content(why + "\n", "text/plain; charset=utf-8");
  });
  s.Get("/readyz", [&t](const httplib::Request&, httplib::Response& res) {
    std::string why;
    res.status = t.ready(&why) ? 200 : 503;
    res.set_content(why + "\n", "text/plain; charset=utf-8");
  });
  s.Get("/memory", [&t](const httplib::Request&, httplib::Response& res) {
    // The report needs the device allocator's state, which belongs to the loop's thread: ask for a fresh
    // one and answer with the latest one written.
    t.request_memory_report();
    std::string report = t.memory_report();
    if (report.empty()) {
      res.status = 202;
      res.set_content("{\"status\": \"requested\", \"message\": \"no memory report yet; one is written after the "
                      "current step (memory_report_<step>.json in the run folder); ask again\"}\n",
                      "application/json");
    } else {
      res.set_content(report, "application/json");
    }
  });
  s.Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("trainer endpoints: /metrics /healthz /readyz /memory\n", "text/plain; charset=utf-8");
  });
  s.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown error";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    res.status = 500;
    res.set_content("internal error: " + what + "\n", "text/plain; charset=utf-8");
  });

  // Bound here, not on the thread, so a bad address fails the constructor with a message.
  if (o.port == 0) {
    impl_->port = s.bind_to_any_port(o.host);
    if (impl_->port <= 0)
      throw std::runtime_error("http: cannot bind " + o.host + " on any port (log.http_host: is it an address of "
                               "this machine?)");
  } else {
    if (!s.bind_to_port(o.host, o.port))
      throw std::runtime_error("http: cannot bind " + o.host + ":" + std::to_string(o.port) +
                               " (log.http_port / log.http_host: port in use by another process, or not an "
                               "address of this machine); choose another port or set log.http_port: 0");
    impl_->port = o.port;
  }
  impl_->thread = std::thread([impl = impl_.get()] {
    impl->server.listen_after_bind();
    impl->finished = true;
  });
  // stop() does nothing until the accept loop runs: wait for it, or a server destroyed right away
  // would never stop.
  while (!s.is_running() && !impl_->finished) std::this_thread::sleep_for(std::chrono::microseconds(200));
}

HttpServer::~HttpServer() {
  if (!impl_) return;
  impl_->server.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

int HttpServer::port() const { return impl_->port; }
const std::string& HttpServer::host() const { return impl_->opt.host; }
std::string HttpServer::url() const { return "http://" + impl_->opt.host + ":" + std::to_string(impl_->port); }

}  // namespace trainer
