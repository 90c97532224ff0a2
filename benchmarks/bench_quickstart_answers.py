"""Do the README's quick-start questions get right answers at the default sampling? (issue 24, item 1)

`make chat` runs `run chat --profile 24gb` on the embedded SmolLM2-135M-Instruct. This asks the
quick start's two questions in that order in one conversation, as the README shows them, through
the same path (`open_session` under the 24gb profile, `ChatSession.send` with chat's default
system prompt from the template and every reply sampled with the same seed, as `chat --seed`
does), once per seed 1..N, at three settings in the same run:

- defaults: what a user gets with no sampling flag (the session's GenerationDefaults, which
  `tierlm show smollm2` prints with where each comes from);
- card: the model card's temperature 0.2 and top-p 0.9, with the other defaults;
- old defaults: temperature 0.7, top-p 0.9, top-k 40, no repetition penalty (before issue 24).

An answer is correct when:
- "What is the capital of France?": its first sentence says Paris is the capital (names Paris
  and the word capital, or is "Paris..."), and no later sentence names another capital of France
  ("The capital of France is indeed Londre" after "... Paris, France." is wrong);
- "Name three colours": it names at least three distinct colours (basic and common colour
  words, below).

It reports correct answers per question and setting, and each reply's first line (`--json`:
every reply in full). Run from the
repo root: `.venv/bin/python benchmarks/bench_quickstart_answers.py [--seeds 10] [--json]`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import time

QUESTIONS = ("What is the capital of France?", "Name three colours")
COLOURS = frozenset("red orange yellow green blue indigo violet purple pink brown black white grey cyan magenta "
                    "turquoise gold silver beige maroon navy".split())  # fmt: skip
OLD_DEFAULTS = dict(temperature=0.7, top_p=0.9, top_k=40, min_p=0.0, repetition_penalty=1.0, repeat_last_n=64)
CARD = dict(temperature=0.2, top_p=0.9)  # SmolLM2-135M-Instruct's model card


def first_sentence(reply: str) -> str:
    return re.split(r"(?<=[.!?])\s|\n", reply.strip(), maxsplit=1)[0]


def correct(question: str, reply: str) -> bool:
    if question == QUESTIONS[0]:
        first = first_sentence(reply).lower()
        says = "paris" in first and ("capital" in first or first.startswith("paris"))
        named = re.findall(r"[Cc]apital of France is (?:indeed |actually |also )?([A-Z][^\s.,;:!?]*)", reply)
        return says and all(city == "Paris" for city in named)
    words = {"grey" if word == "gray" else word for word in re.findall(r"[a-z]+", reply.lower())}
    return len(words & COLOURS) >= 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10, help="seeds 1..N per question and setting")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="as chat's default")
    parser.add_argument("--profile", default="24gb", help="as `make chat`")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()

    from tierlm.config import GenerationDefaults
    from tierlm.profile import load_profile
    from tierlm.runtime.chat import ChatSession
    from tierlm.runtime.sampling import resolve_sampling
    from tierlm.runtime.session import open_session

    started = time.time()
    results = []
    with open_session(None, load_profile(args.profile)) as session:
        defaults = session.generation_defaults
        settings = {"defaults": defaults, "card": defaults.overridden(CARD, "card"),
                    "old defaults": GenerationDefaults(**OLD_DEFAULTS)}  # fmt: skip
        for setting, chosen in settings.items():
            for seed in range(1, args.seeds + 1):
                params = resolve_sampling(chosen, max_new_tokens=args.max_new_tokens, seed=seed)
                session.engine.reset()
                chat = ChatSession(session.engine)
                for question in QUESTIONS:
                    reply = chat.send(question, params).text()
                    results.append(dict(setting=setting, question=question, seed=seed, reply=reply,
                                        correct=correct(question, reply)))  # fmt: skip
                    if not args.json:
                        mark = "ok " if results[-1]["correct"] else "BAD"
                        opening = reply.strip().splitlines()[0] if reply.strip() else ""
                        print(f"{mark} {setting:12} seed {seed:2} {question[:14]:14} {opening[:90]!r}", flush=True)
        shown = {name: {"temperature": d.temperature, "top_p": d.top_p, "top_k": d.top_k, "min_p": d.min_p,
                        "repeat_penalty": d.repetition_penalty, "repeat_last_n": d.repeat_last_n}
                 for name, d in settings.items()}  # fmt: skip
    summary = {setting: {q: sum(r["correct"] for r in results if r["setting"] == setting and r["question"] == q)
                         for q in QUESTIONS} for setting in settings}  # fmt: skip
    report = dict(machine=platform.processor() or platform.machine(), cpus=os.cpu_count(),
                  load_average=os.getloadavg(), seconds=round(time.time() - started), seeds=args.seeds,
                  settings=shown, correct=summary, results=results)  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"\ncorrect answers of {args.seeds} seeds ({report['seconds']} s, load average "
          f"{' '.join(f'{x:.2f}' for x in report['load_average'])}):")
    for setting, counts in summary.items():
        print(f"  {setting:12} " + "  ".join(f"{q!r}: {n}/{args.seeds}" for q, n in counts.items())
              + f"   ({', '.join(f'{k} {v:g}' for k, v in shown[setting].items())})")


if __name__ == "__main__":
    main()
