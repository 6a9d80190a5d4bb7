"""Completion ids name one completion for good (feedback, the learned store and the witness log
outlive the process): OpenAI-shaped, random, and unique across processes (issue 33: sequential ids
restarted at 0, and a restarted server's witness log held 193 duplicates)."""

from __future__ import annotations

import re
import subprocess
import sys

PRINT_IDS = ("from ruvllm.server.generation import Admission\n"
             "print('\\n'.join(Admission.next_id(k) for k in ('chatcmpl-', 'msg_') for _ in range(5000)))")


def test_ids_are_random_openai_shaped_and_unique_across_processes() -> None:
    runs = [subprocess.run([sys.executable, "-c", PRINT_IDS], capture_output=True, text=True, check=True).stdout.split()
            for _ in range(2)]
    ids = runs[0] + runs[1]
    assert len(ids) == 20_000 and len(set(ids)) == 20_000
    # 128 random bits after each dialect's own prefix (OpenAI's chatcmpl-, Anthropic's msg_)
    assert all(re.fullmatch(r"(chatcmpl-|msg_)[0-9a-f]{32}", i) for i in ids)
