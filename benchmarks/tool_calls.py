"""Tool calling on the default model through `ruvllm serve` and the `openai` client: 30 prompts that
each need one of 3 tools. With tool_choice "required": how many calls parse and validate against
the tool's schema, and how many pick the right tool; with "auto": how many answer with a call at
all, and with the right tool. (A 135M model is weak at choosing: reported, not tuned to.)

    .venv/bin/python benchmarks/tool_calls.py
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from pathlib import Path

import jsonschema
import openai
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from witness_load import start_server  # noqa: E402

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "convert_currency", "description": "Convert an amount of money from one currency to another.",
        "parameters": {"type": "object", "properties": {"amount": {"type": "number"}, "from": {"type": "string"},
                                                        "to": {"type": "string"}},
                       "required": ["amount", "from", "to"]}}},
    {"type": "function", "function": {
        "name": "send_email", "description": "Send an email to someone.",
        "parameters": {"type": "object", "properties": {"to": {"type": "string"}, "subject": {"type": "string"},
                                                        "body": {"type": "string"}},
                       "required": ["to", "subject", "body"]}}},
]
PROMPTS = {
    "get_weather": ["What's the weather like in Paris?", "Is it raining in London right now?",
                    "How hot is it in Cairo today?", "Tell me the weather in Tokyo.", "Will I need a coat in Oslo?",
                    "What is the temperature in New York?", "Is it sunny in Madrid?", "Weather in Sydney please.",
                    "How windy is it in Chicago?", "Check the weather for Berlin."],
    "convert_currency": ["Convert 100 dollars to euros.", "How many yen is 50 pounds?",
                         "What is 20 euros in dollars?", "Change 1000 rupees into dollars.",
                         "How much is 75 francs in euros?", "Convert 5 bitcoin to dollars.",
                         "I have 300 pesos, how many dollars is that?", "Exchange 60 dollars for pounds.",
                         "What are 10 euros in yen?", "Convert 250 dollars into Canadian dollars."],
    "send_email": ["Email Bob that the meeting moved to 3pm.", "Send an email to alice@example.com saying hello.",
                   "Write to my boss that I am sick today.", "Email the team: the release is done.",
                   "Send mom an email wishing her happy birthday.", "Email carol@example.com the report is ready.",
                   "Let Dave know by email that lunch is cancelled.", "Send an email to support about my refund.",
                   "Email Erin: see you tomorrow.", "Send a thank-you email to Frank."],
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def run(client: openai.OpenAI, choice: str) -> dict[str, int]:
    counts = {"calls": 0, "valid": 0, "right tool": 0, "prompts": 0}
    for want, prompts in PROMPTS.items():
        for prompt in prompts:
            counts["prompts"] += 1
            out = client.chat.completions.create(model="SmolLM2-135M-Instruct", tools=TOOLS, tool_choice=choice,
                                                 messages=[{"role": "user", "content": prompt}], max_tokens=256,
                                                 temperature=0)
            calls = out.choices[0].message.tool_calls or []
            if not calls:
                continue
            counts["calls"] += 1
            try:
                for c in calls:
                    jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
                counts["valid"] += 1
            except (ValueError, KeyError, jsonschema.ValidationError):
                pass
            counts["right tool"] += calls[0].function.name == want
    return counts


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_server(Path(tmp) / "w.sqlite3")
        try:
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            results = {choice: run(client, choice) for choice in ("required", "auto")}
        finally:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=60)
    table = Table(title="Tool calling: default model, 30 prompts needing one of 3 tools, greedy")
    for col in ("tool_choice", "answered with a call", "calls parse and validate", "right tool"):
        table.add_column(col, justify="right")
    for choice, c in results.items():
        n = c["prompts"]
        table.add_row(choice, f"{c['calls']}/{n}", f"{c['valid']}/{c['calls']}", f"{c['right tool']}/{n}")
    Console().print(table)


if __name__ == "__main__":
    main()
