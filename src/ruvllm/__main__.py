"""`python -m ruvllm [PROMPT]`: stream a chat reply from the embedded default model to the terminal."""

from __future__ import annotations

import asyncio
import sys

from ruvllm.engine.async_engine import AsyncEngine
from ruvllm.engine.prompts import render_chat
from ruvllm.sampling_params import SamplingParams


async def _stream(engine: AsyncEngine, prompt: str) -> None:
    ids = render_chat(engine.tokenizer, [{"role": "user", "content": prompt}])
    printed = 0
    async for out in engine.generate(ids, SamplingParams(temperature=0.7, top_p=0.9, max_tokens=256, seed=0)):
        text = out.outputs[0].text
        sys.stdout.write(text[printed:])
        sys.stdout.flush()
        printed = len(text)
    sys.stdout.write("\n")


def main() -> None:
    prompt = " ".join(sys.argv[1:]) or "Explain in three sentences what a paged KV cache is."
    engine = AsyncEngine.launch()
    try:
        asyncio.run(_stream(engine, prompt))
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
