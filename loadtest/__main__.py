"""``python -m loadtest``: a bounded headless Locust run, its reports, and a summary with the server's metrics.

Runs ``locust --headless`` on ``loadtest/locustfile.py`` in a subprocess (Locust's gevent stays out of this
process), which writes Locust's ``report.html`` and ``locust_*.csv`` and the final ``locust_summary.json`` to the
output directory; then scrapes Triton's metrics, waits for the server to go idle, prints the summary and saves
it as ``summary.json``. Arguments it does not know are passed to Locust (e.g. ``HttpStreamUser`` to run one
protocol only, ``--loglevel DEBUG``).

``--soak`` (``make soak``: 30 minutes at saturation, both protocols, 20% of users cancelling) also samples the
resident memory of the local tritonserver and of its backend stubs every ``--memory-interval`` seconds
(``loadtest.memory``) and fails the run when a process grew by more than ``--max-rss-drift-mib`` after the
warm-up.

Exit status: 0 when streams completed without failures and the server was idle and ready afterwards (and, in
a soak, memory did not drift past the bound), else 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import requests

from loadtest.memory import MemorySampler, find_server
from loadtest.report import format_summary
from loadtest.server_metrics import idle_gauges, run_deltas, scrape, wait_for_idle
from loadtest.workload import DEFAULT_WORKLOAD, load_workload

LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
REPO_ROOT = LOCUSTFILE.parent.parent
CSV_PREFIX = "locust"
RUN_TIME = re.compile(r"\d+|(?=\d)(\d+h)?(\d+m)?(\d+s)?")  # Locust's time spans: 20, 20s, 3m, 2h, 1h20m
STATS_FILE = "locust_summary.json"  # written by the locustfile when Locust quits: final, unlike its CSV files


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__.split("\n\n")[0],
                                     epilog="Unknown arguments are passed to Locust.", allow_abbrev=False)
    parser.add_argument("--host", default="http://localhost:8000", help="Triton's HTTP endpoint")
    parser.add_argument("--grpc-host", default="localhost:8001", help="Triton's gRPC endpoint, host:port")
    parser.add_argument("--metrics-url", default="http://localhost:8002/metrics", help="Triton's metrics")
    parser.add_argument("-u", "--users", type=int, default=8, help="concurrent users (half HTTP, half gRPC)")
    parser.add_argument("-r", "--spawn-rate", type=float, default=2.0, help="users started per second")
    parser.add_argument("-t", "--run-time", default="60s", help="how long users start new streams (Locust "
                        "syntax: 30s, 2m)")
    parser.add_argument("--stop-timeout", type=int, default=120,
                        help="seconds streams in flight at the end may take to finish")
    parser.add_argument("--cancel-share", type=float, default=0.2, help="fraction of users that cancel")
    parser.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD, help="JSONL of {prompt, max_tokens}")
    parser.add_argument("--max-output-tokens", type=int, default=0,
                        help="cap each request's max_tokens (0: as in the workload)")
    parser.add_argument("--output-dir", type=Path, default=Path("results/loadtest"), help="where reports go")
    parser.add_argument("--idle-timeout", type=float, default=15.0,
                        help="seconds to wait after the run for running/waiting/KV use to reach 0")
    soak = parser.add_argument_group("soak")
    soak.add_argument("--soak", action="store_true", help="sample the server's and stubs' memory (the server "
                      "must run on this machine) and check its drift")
    soak.add_argument("--memory-interval", type=float, default=30.0, help="seconds between memory samples")
    soak.add_argument("--memory-warmup", type=float, default=60.0,
                      help="drift is measured from the first sample this many seconds into the run")
    soak.add_argument("--max-rss-drift-mib", type=float, default=256.0,
                      help="a process growing more than this after the warm-up fails the soak")
    args, passthrough = parser.parse_known_args(argv)
    for bad, message in ((args.users < 1, "--users must be at least 1"),
                         (not args.spawn_rate > 0, "--spawn-rate must be positive"),
                         (not 0 <= args.cancel_share <= 1, "--cancel-share is a fraction, from 0 to 1"),
                         (args.max_output_tokens < 0, "--max-output-tokens must be 0 (off) or positive"),
                         (args.stop_timeout < 0 or not 0 <= args.idle_timeout < math.inf,
                          "timeouts must be finite and not negative"),
                         (not 0 < args.memory_interval < math.inf,
                          "--memory-interval must be positive and finite"),
                         (not 0 <= args.memory_warmup < math.inf, "--memory-warmup must be finite and not negative"),
                         (not 0 <= args.max_rss_drift_mib < math.inf,
                          "--max-rss-drift-mib must be finite and not negative")):
        if bad:
            parser.error(message)
    # Checked here, not by Locust's parser: importing locust monkey-patches this process (gevent).
    if not RUN_TIME.fullmatch(args.run_time):
        parser.error(f"--run-time {args.run_time!r}: not a time span (20, 20s, 3m, 2h, 1h20m)")
    try:
        load_workload(args.workload)
    except (OSError, ValueError) as exc:
        parser.error(f"--workload {args.workload}: {exc}")
    return args, passthrough


def locust_command(args: argparse.Namespace, passthrough: list[str]) -> list[str]:
    return [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
            "--users", str(args.users), "--spawn-rate", str(args.spawn_rate), "--run-time", args.run_time,
            "--stop-timeout", str(args.stop_timeout), "--host", args.host, "--grpc-host", args.grpc_host,
            "--workload", str(args.workload), "--max-output-tokens", str(args.max_output_tokens),
            "--cancel-share", str(args.cancel_share), "--summary-json", str(args.output_dir / STATS_FILE),
            "--csv", str(args.output_dir / CSV_PREFIX),
            "--html", str(args.output_dir / "report.html"), *passthrough]


def main(argv: list[str] | None = None) -> int:
    args, passthrough = parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / STATS_FILE).unlink(missing_ok=True)
    before = _try_scrape(args.metrics_url)

    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": python_path}  # the locustfile imports client/ and loadtest/
    command = locust_command(args, passthrough)
    print("+", " ".join(command), flush=True)
    sampler = None
    if args.soak and (server_process := find_server(args.host)) is not None:
        sampler = MemorySampler(server_process, args.memory_interval)
        sampler.start()
    start = time.monotonic()
    locust_status = subprocess.run(command, env=env).returncode
    elapsed = time.monotonic() - start

    stats_file = args.output_dir / STATS_FILE
    stats = json.loads(stats_file.read_text()) if stats_file.exists() else {
        "protocols": {}, "failure_messages": [], "exceptions": []}
    server = None
    if before is not None:
        try:
            idle, after, waited = wait_for_idle(args.metrics_url, args.idle_timeout)
            server = {"deltas": run_deltas(before, after), "gauges_after": idle_gauges(after), "idle": idle,
                      "idle_wait_s": waited, "ready": _is_ready(args.host)}
        except requests.RequestException as exc:
            print(f"error: cannot read {args.metrics_url} after the run ({exc}): did the server stop?",
                  file=sys.stderr)
    result = {"users": args.users, "run_time": args.run_time, "cancel_share": args.cancel_share,
              "output_dir": str(args.output_dir), "elapsed_s": elapsed, "locust_exit_status": locust_status,
              "locust": stats, "server": server}
    if args.soak:
        if sampler is not None:
            sampler.stop()  # after the wait for idle: the last sample is of the idle server
        result["memory"] = None if sampler is None else {
            **sampler.summary(args.memory_warmup), "max_drift_mib": args.max_rss_drift_mib}
    result["problems"] = problems(result)
    result["ok"] = not result["problems"]
    (args.output_dir / "summary.json").write_text(json.dumps(result, indent=2))
    print(format_summary(result), flush=True)
    return 0 if result["ok"] else 1


def problems(result: dict) -> list[str]:
    """What makes the run a failure, in words (empty: it passed)."""
    found = []
    if result["locust_exit_status"] not in (0, 1):  # 1: some request failed or a user raised, counted below
        found.append(f"locust exited with status {result['locust_exit_status']}")
    if result["locust"]["exceptions"]:
        found.append(f"exceptions raised in Locust users ({len(result['locust']['exceptions'])} kinds)")
    protocols = result["locust"]["protocols"].values()
    if sum(p["failures"] for p in protocols):
        found.append(f"{sum(p['failures'] for p in protocols)} failed streams")
    if not sum(p["completed"] for p in protocols):
        found.append("no stream completed")
    if "memory" in result:
        memory = result["memory"]
        if memory is None:
            found.append("no local tritonserver found to sample memory from")
        else:
            for name, process in memory["processes"].items():
                if process["drift_mib"] > memory["max_drift_mib"]:
                    found.append(f"{name} grew {process['drift_mib']:.0f} MiB after the warm-up "
                                 f"(bound {memory['max_drift_mib']:.0f} MiB)")
    server = result["server"]
    if server is None:
        found.append("server metrics not reachable")
    else:
        if not server["idle"]:
            found.append("server not idle after the run")
        if not server["ready"]:
            found.append("server not ready after the run")
    return found


def _try_scrape(metrics_url: str):
    try:
        return scrape(metrics_url)
    except requests.RequestException as exc:
        print(f"warning: cannot read {metrics_url} ({exc}); no server summary", file=sys.stderr)
        return None


def _is_ready(http_url: str) -> bool:
    try:
        return requests.get(f"{http_url.rstrip('/')}/v2/health/ready", timeout=5).status_code == 200
    except requests.RequestException:
        return False


if __name__ == "__main__":
    sys.exit(main())
