"""The summary of a load-test run: Locust's statistics per protocol, next to the server's view of the run.

Percentiles are Locust's: it keeps response times rounded (whole ms below 100 ms, 2 significant digits above).
"""

from __future__ import annotations

from loadtest.server_metrics import FINISH_REASONS

PROTOCOLS = ("http", "grpc")
LATENCIES = ("TTFT", "ITL", "TPOT", "e2e")  # ms
PERCENTILES = (50, 90, 99)


def summarize_locust(stats, exceptions: dict | None = None) -> dict:
    """From Locust's ``RequestStats``: per protocol, the completed, failed and cancelled streams and the mean
    and percentiles (ms; tokens/s for ``tokens/s``) of each measure; the failure messages; and the exceptions
    that users raised (Locust's ``runner.exceptions``)."""
    protocols: dict = {}
    for protocol in PROTOCOLS:
        entries = {name: e for (name, method), e in stats.entries.items() if method == protocol and e.num_requests}
        if not entries:
            continue
        e2e, cancelled = entries.get("e2e"), entries.get("cancelled")
        failures = e2e.num_failures if e2e else 0
        protocols[protocol] = {
            "completed": (e2e.num_requests if e2e else 0) - failures, "failures": failures,
            "cancelled": cancelled.num_requests if cancelled else 0,
            **{name: None if name not in entries else {
                "mean": entries[name].avg_response_time,
                **{f"p{p}": entries[name].get_response_time_percentile(p / 100) for p in PERCENTILES}}
               for name in (*LATENCIES, "tokens/s")}}
    failures = [{"type": e.method, "name": e.name, "error": str(e.error), "occurrences": e.occurrences}
                for e in stats.errors.values()]
    raised = [{"count": e["count"], "message": e["msg"]} for e in (exceptions or {}).values()]
    return {"protocols": protocols, "failure_messages": failures, "exceptions": raised}


def format_summary(result: dict) -> str:
    """The human-readable summary of ``python -m loadtest``'s result dictionary."""
    locust, server = result["locust"], result["server"]
    lines = [f"== Load test: {result['users']} users, {result['run_time']}, cancel share {result['cancel_share']} "
             f"(reports in {result['output_dir']})", "",
             f"{'':6}{'done':>6}{'failed':>8}{'cancel':>8}   " + "   ".join(
                 f"{name + ' p50/p90/p99 ms':<26}" for name in ("TTFT", "ITL")) + f"{'TPOT p50':>10}{'e2e p50':>10}"
             f"{'tok/s p50':>11}"]
    for protocol in PROTOCOLS:
        entry = locust["protocols"].get(protocol)
        if entry is None:
            continue
        lines.append(f"{protocol:<6}{entry['completed']:>6}{entry['failures']:>8}{entry['cancelled']:>8}   "
                     + "   ".join(f"{_percentiles(entry[name]):<26}" for name in ("TTFT", "ITL"))
                     + f"{_p50(entry['TPOT']):>10}{_p50(entry['e2e']):>10}{_p50(entry['tokens/s']):>11}")
    for failure in locust["failure_messages"][:5]:
        lines.append(f"  failure x{failure['occurrences']} [{failure['type']} {failure['name']}]: {failure['error']}")
    for exception in locust["exceptions"][:5]:
        lines.append(f"  exception x{exception['count']}: {exception['message']}")

    lines += ["", "Server metrics: not reachable"] if server is None else _server_lines(result)
    if "memory" in result:
        lines += _memory_lines(result["memory"])
    lines += ["", "PASS" if result["ok"] else f"FAIL: {'; '.join(result['problems'])}"]
    return "\n".join(lines)


def _server_lines(result: dict) -> list[str]:
    server = result["server"]
    d, gauges = server["deltas"], server["gauges_after"]
    return ["", "Server (Triton /metrics, change over the run):",
            f"  requests: {d['triton_success']:.0f} succeeded, {d['triton_failure']:.0f} failed (Triton); finished "
            + ", ".join(f"{r} {d['finished_' + r]:.0f}" for r in FINISH_REASONS),
            f"  tokens: {d['prompt_tokens']:.0f} prompt, {d['generation_tokens']:.0f} generated "
            f"({d['generation_tokens'] / result['elapsed_s']:.1f}/s over {result['elapsed_s']:.0f} s); "
            f"preemptions {d['preemptions']:.0f}; prefix cache hits {_share(d)}",
            f"  mean server-side TTFT {_ms(d['mean_ttft_s'])}, TPOT {_ms(d['mean_tpot_s'])}, "
            f"e2e {_ms(d['mean_e2e_s'])}",
            f"  after the run: running {gauges['llm_num_requests_running']:.0f}, waiting "
            f"{gauges['llm_num_requests_waiting']:.0f}, KV blocks used {gauges['llm_kv_cache_blocks_used']:.0f} "
            f"(usage {gauges['llm_kv_cache_usage_ratio']:.3f}) -> "
            + (f"idle after {server['idle_wait_s']:.1f} s" if server["idle"] else
               f"NOT idle after {server['idle_wait_s']:.1f} s"),
            f"  server ready: {server['ready']}"]


def _memory_lines(memory: dict | None) -> list[str]:
    if memory is None:
        return ["", "Memory: no local tritonserver found"]
    lines = ["", f"Memory (RSS MiB, every {memory['interval_s']:.0f} s; drift = end - first sample after "
                 f"{memory['warmup_s']:.0f} s, bound {memory['max_drift_mib']:.0f}):",
             f"  {'process':<22}{'start':>8}{'warm':>8}{'end':>8}{'max':>8}{'drift':>8}"]
    for name, p in memory["processes"].items():
        lines.append(f"  {name:<22}{p['start_mib']:>8.0f}{p['warm_mib']:>8.0f}{p['end_mib']:>8.0f}"
                     f"{p['max_mib']:>8.0f}{p['drift_mib']:>+8.0f}")
    return lines


def _percentiles(stat: dict | None) -> str:
    if stat is None:
        return "-"
    return "/".join(f"{stat[f'p{p}']:.0f}" for p in PERCENTILES)


def _p50(stat: dict | None) -> str:
    return "-" if stat is None else f"{stat['p50']:.0f}"


def _share(deltas: dict) -> str:
    queries = deltas.get("prefix_cache_queries", 0)
    return f"{deltas['prefix_cache_hits'] / queries:.0%} of prompt tokens" if queries else "-"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"
