"""Runs the benchmark's workload on vLLM, inside vLLM's own virtual environment (see ``vllm_system.py``).

``python vllm_worker.py SETTINGS.json``: builds one vLLM ``LLMEngine`` (settings: model directory, dtype,
batching limits), prints ``@@ready``, then for each line read from stdin (``IN.json OUT.json``) runs that
workload, its prefix cache emptied first, and prints ``@@done``. IN holds, per request, the prompt token ids, the output length and the
arrival offset (s), and ``concurrency`` (null, or the requests in flight at most: a closed loop); OUT gets, per
request, when it was added and the time of each output token (s from the run's start), and its first 16
output token ids. The engine is stepped here as vLLM's offline ``LLM.generate`` steps it, with
requests added at their arrival times, so per-token times are observed as our in-process engine's are.
Imports nothing of this project: vLLM's environment has none of it.
"""

from __future__ import annotations

import json
import sys
import time


def run(engine, params, requests: list[dict], concurrency: int | None = None) -> dict:
    from vllm.inputs import TokensPrompt

    requests = sorted(requests, key=lambda r: r["arrival"])
    times: dict[str, list[float]] = {str(r["index"]): [] for r in requests}
    tokens: dict[str, list[int]] = {str(r["index"]): [] for r in requests}
    added: dict[str, float] = {}
    limit = concurrency or len(requests)
    start = time.perf_counter()
    pending = in_flight = 0
    while pending < len(requests) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending < len(requests) and requests[pending]["arrival"] <= now and in_flight < limit:
            r = requests[pending]
            engine.add_request(str(r["index"]), TokensPrompt(prompt_token_ids=r["prompt_ids"]), params(r["output_len"]))
            added[str(r["index"])] = time.perf_counter() - start
            pending += 1
            in_flight += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(requests[pending]["arrival"] - now, 0.05)))
            continue
        for out in engine.step():
            ids = out.outputs[0].token_ids
            stamp = time.perf_counter() - start
            times[out.request_id] += [stamp] * len(ids)
            tokens[out.request_id] += list(ids)
            in_flight -= out.finished
    return {"token_times": times, "added": added, "first_tokens": {k: v[:16] for k, v in tokens.items()}}


def main(settings_path: str) -> None:
    settings = json.loads(open(settings_path).read())
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    began = time.perf_counter()
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=settings["model"], dtype=settings["dtype"], max_num_seqs=settings["max_num_seqs"],
        max_num_batched_tokens=settings["max_num_batched_tokens"], max_model_len=settings["max_model_len"],
        seed=0))

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    run(engine, params, [{"index": -1, "prompt_ids": [1, 2, 3, 4], "output_len": 4, "arrival": 0.0}])  # warm-up
    print(f"@@ready {time.perf_counter() - began:.1f}", flush=True)
    for line in sys.stdin:
        in_path, out_path = line.split()
        spec = json.loads(open(in_path).read())
        if not engine.reset_prefix_cache():  # every run starts with nothing cached, as ours does
            raise RuntimeError("vLLM did not reset its prefix cache before a run")
        result = run(engine, params, spec["requests"], spec.get("concurrency"))
        with open(out_path, "w") as f:
            json.dump(result, f)
        print("@@done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
