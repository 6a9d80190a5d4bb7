"""Ray Serve against data parallelism on one machine (docs/scaling.md), in one run, on the embedded
model: aggregate throughput of 2 engine replicas on a local 2-node Ray cluster (one CPU a node;
Ray's HTTP proxy, the front deployment, the request router) against `ruvllm serve
--data-parallel-size 2`, and the time Ray's path adds to one request.

    COLUMNS=200 .venv/bin/python benchmarks/ray_serve.py --concurrency 32 --rounds 3

Load: serve_load.py's streaming clients (distinct prompts cut from the novel, EOS ignored). Overhead:
sequential one-token completions of an 8-token prompt, median latency on each server; the
difference is what Ray's proxy, the front replica and the handle call add per request.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx
from rich.console import Console
from rich.table import Table

from serve_load import _free_port, prompts, run_load, start_ruvllm


def start_ray(model: str | None, replicas: int) -> tuple[object, str]:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from ruvllm.config import EngineConfig
    from ruvllm.loader import default_model_path
    from ruvllm.ray_serve.app import RayServeConfig, application
    from ruvllm.server.config import ServerConfig

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(replicas - 1):
        cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    cfg = RayServeConfig(engine=EngineConfig(model=model or str(default_model_path()), num_threads=1),
                         server=ServerConfig(served_model_name="SmolLM2-135M-Instruct"), replicas=replicas)
    serve.run(application(cfg), name="ruvllm", route_prefix="/")
    return cluster, f"http://127.0.0.1:{port}"


def stop_ray(cluster: object) -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()  # type: ignore[attr-defined]


def one_token_latency(url: str, n: int) -> float:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "The weather in spring is", "max_tokens": 1,
            "temperature": 0}
    times = []
    with httpx.Client(timeout=60) as client:
        for i in range(n + 5):
            start = time.perf_counter()
            client.post(url + "/v1/completions", json={**body, "prompt": f"{body['prompt']} {i}"}).raise_for_status()
            if i >= 5:  # the first few warm up connections and caches
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--latency-requests", type=int, default=40)
    ap.add_argument("--model-path")
    args = ap.parse_args()
    console = Console()
    n = args.concurrency
    texts = prompts(n * args.rounds, args.prompt_len, args.model_path)
    results: dict[str, list[float]] = {"ray": [], "dp": []}
    latency: dict[str, float] = {}

    def measure(name: str, url: str) -> None:
        latency[name] = one_token_latency(url, args.latency_requests)
        for rnd in range(args.rounds):  # fresh prompts each round: no prefix-cache hits across rounds
            row = asyncio.run(run_load(url, "SmolLM2-135M-Instruct", texts[rnd * n:(rnd + 1) * n], n, args.gen_len))
            results[name].append(row["output_tok_s"])

    with console.status("Ray: a 2-node local cluster, 2 engine replicas"):
        cluster, url = start_ray(args.model_path, 2)
    try:
        with console.status("Ray: load"):
            measure("ray", url)
    finally:
        stop_ray(cluster)
    extra = ["--data-parallel-size", "2", "--threads-per-replica", "1"]
    with console.status("ruvllm serve --data-parallel-size 2"):
        proc, url = start_ruvllm(n, extra, args.model_path)
    try:
        with console.status("DP: load"):
            measure("dp", url)
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    table = Table(title=f"{n} streaming clients, {args.prompt_len}-token prompts, {args.gen_len} generated "
                        f"(EOS ignored), median of {args.rounds} rounds; one-token latency: median of "
                        f"{args.latency_requests} sequential requests")
    for col in ("setup", "output tok/s", "range", "vs DP = 2", "one-token request (ms)", "added per request (ms)"):
        table.add_column(col, justify="right")
    dp = statistics.median(results["dp"])
    for name, label in (("dp", "ruvllm serve --data-parallel-size 2 (one machine)"),
                        ("ray", "ruvllm ray-serve: 2 replicas on 2 local Ray nodes")):
        rs = results[name]
        med = statistics.median(rs)
        table.add_row(label, f"{med:.1f}", f"{min(rs):.1f}-{max(rs):.1f}", f"{med / dp:.2f}x",
                      f"{latency[name] * 1000:.1f}", "" if name == "dp" else
                      f"{(latency['ray'] - latency['dp']) * 1000:+.1f}")
    console.print(table)


if __name__ == "__main__":
    main()
