"""How looked-up chains fare by match length, at every position of plain greedy answers.

    python scripts/measure_lookup.py 20      # prompts per bench file

For each position of each answer (the context: the prompt and the answer so far), the chain
of 4 that context_lookup.look_up finds, by how many context tokens its source matched: the
share of positions with such a match, the tokens of the chain the answer goes on with, and
how often all of them. docs/benchmarks.md (fifth session) quotes its figures.
"""
import sys
from collections import defaultdict

import torch

from gumiho_core.benchmark import read_prompts
from gumiho_core.context_lookup import look_up
from gumiho_core.drafter import common_prefix_length
from gumiho_core.generate import run_to_end
from gumiho_core.loading import load_engine
from gumiho_core.settings import GenerationSettings

FILES = ("mt_bench", "humaneval", "gsm8k")


def main(limit: int) -> None:
    engine, _ = load_engine(None, need_heads=False)
    settings = GenerationSettings(max_new_tokens=256, speculative=False)
    for name in FILES:
        by_match = defaultdict(lambda: [0, 0, 0])  # positions, tokens accepted, chains accepted whole
        positions = 0
        for prompt in read_prompts(f"../shared/bench/{name}.jsonl", limit):
            ids = engine.target.chat_prompt([{"role": "user", "content": prompt}])
            full = torch.tensor(ids + run_to_end(engine, ids, settings).token_ids)
            for end in range(len(ids) + 1, len(full)):  # the context ends with the root
                positions += 1
                found = look_up(full[:end], 4)
                if found.tokens:
                    n = common_prefix_length(found.tokens, full[end : end + 4].tolist())
                    counts = by_match[found.match]
                    counts[0], counts[1], counts[2] = counts[0] + 1, counts[1] + n, counts[2] + (n == len(found.tokens))
        print(name, f"{positions} positions:", ", ".join(
            f"{match}-token match {c[0] / positions:.0%} of positions, {c[1] / c[0]:.2f} accepted, {c[2] / c[0]:.0%} whole"
            for match, c in sorted(by_match.items())))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
