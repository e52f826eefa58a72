"""How well a correction carries over to rephrasings the training never saw, and what protects other answers.

    python bench/bench_generalise_cpu.py [--out gen.json]

For each fact, one learn() on the embedded SmolLM2 with the fact's prompt, then exact-match checks of the
taught answer on unseen rephrasings, and of the unrelated probes against the base model's answers. Settings
compared by default: the defaults (protected subspaces, no anchor loss), protected subspaces + anchor replay,
anchor replay alone, KL on the anchors alone, nothing, and the defaults without the rewording augmentation.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

FACTS = [
    ("What is the password of the blue door?", "marmalade",
     ["Tell me the blue door's password.", "What's the password for the blue door?", "blue door password?"]),
    ("Who guards the silver bridge?", "Captain Ferrow",
     ["Who is the guard of the silver bridge?", "Which person guards the silver bridge?", "silver bridge guard?"]),
    ("Which planet do the Quorlings come from?", "Tessaly",
     ["What planet are the Quorlings from?", "Where do Quorlings come from?", "Home planet of the Quorlings?"]),
    ("What is the name of Mia's robot?", "Bolt-7",
     ["What is Mia's robot called?", "Mia has a robot. What's its name?", "name of the robot of Mia?"]),
]
# none of these is an anchor prompt: they measure what the anchors do for prompts nobody listed
PROBES = ["What is 2+2?", "Who wrote Romeo and Juliet?", "What colour is the sky?", "Name a large animal.",
          "What is the boiling point of water?", "Say good morning in Spanish."]
# the fact each probe's base answer states, for a check that ignores wording
FACTS_OF_PROBES = {"What is 2+2?": "4", "Who wrote Romeo and Juliet?": "Shakespeare", "What colour is the sky?": "blue",
                   "Name a large animal.": "elephant", "What is the boiling point of water?": "100",
                   "Say good morning in Spanish.": "Hola"}
MORE_ANCHORS = ["What is the capital of France?", "Write one sentence about the ocean.", "Name three fruits.",
                "What is 10 times 3?", "Who painted the Mona Lisa?", "Give me a word that rhymes with cat.",
                "What is the largest planet?", "Translate 'thank you' into French."]


def run(settings: dict) -> dict:
    from dark import OnlineLLM

    with OnlineLLM(data_dir=tempfile.mkdtemp()) as llm:
        base = {p: llm.generate(p, max_tokens=24) for p in PROBES}
        hits = total = kept = kept_total = steps = facts = 0
        seconds = 0.0
        for i, (prompt, answer, rephrasings) in enumerate(FACTS):
            name = f"fact{i}"
            t = time.perf_counter()
            report = llm.learn([{"prompt": prompt, "response": answer}], adapter=name, **settings)
            seconds += time.perf_counter() - t
            steps += report["steps"]
            hits += sum(llm.generate(q, adapter=name) == answer for q in rephrasings)
            total += len(rephrasings)
            after = {p: llm.generate(p, adapter=name, max_tokens=24) for p in PROBES}
            kept += sum(after[p] == base[p] for p in PROBES)
            facts += sum(FACTS_OF_PROBES[p] in after[p] for p in PROBES if FACTS_OF_PROBES[p] in base[p])
            kept_total += len(PROBES)
    return {"settings": settings, "rephrasings_exact": f"{hits}/{total}", "probes_unchanged": f"{kept}/{kept_total}",
            "probe_facts_kept": f"{facts}/{len(FACTS) * sum(FACTS_OF_PROBES[p] in base[p] for p in PROBES)}",
            "mean_steps": steps / len(FACTS), "mean_learn_s": round(seconds / len(FACTS), 2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--configs", type=int, default=5, help="run only the first N settings")
    ap.add_argument("--settings", default="", help="a JSON list of learn() keyword sets to compare instead")
    args = ap.parse_args()
    configs = [{}, {"kl_weight": 1.0}, {"protect_energy": 0.0, "kl_weight": 1.0},
               {"protect_energy": 0.0, "kl_weight": 1.0, "anchor_loss": "kl"}, {"protect_energy": 0.0},
               {"augment": False}]
    if args.settings:
        configs = json.loads(args.settings)
    rows = [run(s) for s in configs[:args.configs]]
    print(json.dumps(rows, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
