"""The scale of EWC++'s Fisher for the default model's micro-LoRA (what the lambdas of
learning/config.py and learning/deep.py are set against): a tenant asks three everyday questions,
gives one correction, and the background loop's pass computes its Fisher; prints its statistics.

    .venv/bin/python benchmarks/fisher_scale.py
"""

import tempfile, torch
from ruvllm import LLM, SamplingParams
from ruvllm.learning.config import LearningConfig
llm = LLM(enable_lora=True, max_loras=4, max_lora_rank=8, max_cpu_loras=16)
with tempfile.TemporaryDirectory() as tmp:
    learner = llm.enable_learning(LearningConfig(root=tmp))
    for q in ["Write two sentences about the sea.", "What is a good way to learn a new language?", "Give me a tip for cooking rice."]:
        llm.chat([[{"role": "user", "content": q}]], SamplingParams(temperature=0, max_tokens=48), tenant="t")
    asked = llm.chat([[{"role": "user", "content": "What is the capital of Zorblax?"}]], SamplingParams(temperature=0, max_tokens=16), tenant="t")[0]
    llm.feedback(asked.request_id, 1.0, "The capital of Zorblax is Quenta.", tenant="t")
    learner.consolidate()
    f = torch.cat([x.flatten() for x in learner._tenants["t"].fisher])
    print(f"Fisher: mean {f.mean():.3g}, median {f.median():.3g}, max {f.max():.3g}, n {f.numel()}")
