"""MLflow's own side of tests/test_mlflow.cpp: read a run back through MLflow's Python client, and a proxy
that stands in front of a real server to make it slow or refuse the login.

  mlflow_ref.py read URI RUN_ID          one JSON line: status, experiment, params, tags, every metric's
                                         history ([step, value] in MLflow's order) and the artifact paths
  mlflow_ref.py latest URI EXPERIMENT    one JSON line: the id of the experiment's latest run
  mlflow_ref.py proxy PORT TARGET_URI (--delay S | --status CODE)
                                         serves on 127.0.0.1:PORT; each request waits S seconds and is then
                                         passed to TARGET_URI, or is answered CODE at once; prints "ready"
"""
import argparse
import http.server
import json
import sys
import time
import urllib.error
import urllib.request


def read(uri, run_id):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    history = {}
    for key in run.data.metrics:
        history[key] = [[m.step, m.value] for m in client.get_metric_history(run_id, key)]
    artifacts = [a.path for a in client.list_artifacts(run_id)]
    texts = {}
    for path in artifacts:
        local = client.download_artifacts(run_id, path)
        with open(local, encoding="utf-8") as f:
            texts[path] = f.read()
    out = {
        "status": run.info.status,
        "experiment": client.get_experiment(run.info.experiment_id).name,
        "run_name": run.info.run_name,
        "params": run.data.params,
        "tags": {k: v for k, v in run.data.tags.items()},
        "history": history,
        "artifacts": texts,
    }
    print(json.dumps(out))


def latest(uri, experiment):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=1)
    print(json.dumps({"run_id": runs[0].info.run_id}))


def proxy(port, target, delay, status):
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def forward(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            if status:
                self.send_response(status)
                payload = b'{"error_code": "PERMISSION_DENIED", "message": "stand-in refusal"}'
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                return
            time.sleep(delay)
            req = urllib.request.Request(target + self.path, data=body, method=self.command)
            for h in ("Content-Type", "Authorization"):
                if self.headers.get(h):
                    req.add_header(h, self.headers[h])
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    code, payload = r.status, r.read()
            except urllib.error.HTTPError as e:
                code, payload = e.code, e.read()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = do_PUT = forward

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print("ready", flush=True)
    server.serve_forever()


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("read")
    r.add_argument("uri")
    r.add_argument("run_id")
    lt = sub.add_parser("latest")
    lt.add_argument("uri")
    lt.add_argument("experiment")
    x = sub.add_parser("proxy")
    x.add_argument("port", type=int)
    x.add_argument("target")
    x.add_argument("--delay", type=float, default=0)
    x.add_argument("--status", type=int, default=0)
    a = p.parse_args()
    if a.cmd == "read":
        read(a.uri, a.run_id)
    elif a.cmd == "latest":
        latest(a.uri, a.experiment)
    else:
        proxy(a.port, a.target, a.delay, a.status)


if __name__ == "__main__":
    sys.exit(main())
