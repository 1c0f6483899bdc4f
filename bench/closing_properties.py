"""The structured-output closing properties with many more examples than the suite runs.

    .venv/bin/python bench/closing_properties.py --scale 20 --out closing-20x.json

Runs tests/test_closing.py's two random-walk properties (every ending the closer proposes
validates and the grammar accepts it; a walk under any budget from the minimum ends valid) and
tests/test_structured_budget.py's property on the embedded model (every answer validates under
any budget from the minimum), each with `--scale` times the suite's examples, exploring afresh
(no database). A failure prints Hypothesis's `@reproduce_failure` blob and the run goes on to the
next property. Prints a table and writes JSON (--out): examples, failures and seconds each.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from hypothesis import settings

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

import conftest  # noqa: E402  (the suite's Hypothesis profile: print_blob, bounded shrinking)
import test_closing  # noqa: E402
import test_structured_budget  # noqa: E402


def scale_examples(test: Callable, scale: int) -> int:
    """Give the property `scale` times its examples (Hypothesis reads its settings when it runs,
    and refuses a second @settings); the new count."""
    base = test._hypothesis_internal_use_settings
    test._hypothesis_internal_use_settings = settings(base, max_examples=base.max_examples * scale, database=None)
    return base.max_examples * scale


def run(name: str, test: Callable, scale: int, **fixtures: object) -> dict:
    examples = scale_examples(test, scale)
    started = time.perf_counter()
    try:
        test(**fixtures)
        failure = None
    except Exception:  # the property's own report, with its reproduce_failure blob
        failure = traceback.format_exc()
        print(failure, file=sys.stderr)
    seconds = time.perf_counter() - started
    print(f"{name:<76} {examples:>7} {'FAIL' if failure else 'ok':>5} {seconds:>8.1f}", flush=True)
    return {"property": name, "examples": examples, "failed": failure is not None, "seconds": round(seconds, 1),
            "failure": failure}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=20, help="times the suite's example counts")
    parser.add_argument("--only", choices=["walks", "model"], help="just the walks or just the model's property")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    print(f"{'property':<76} {'examples':>7} {'':>5} {'seconds':>8}")
    results = []
    if args.only != "model":
        compiler = test_closing.GrammarCompiler(str(conftest.EMBEDDED), 8192, [test_closing.EOS])
        for test in (test_closing.test_every_ending_the_closer_proposes_validates_and_the_grammar_accepts_it,
                     test_closing.test_a_walk_under_any_budget_from_the_minimum_ends_valid_and_within_it):
            results.append(run(test.__name__, test, args.scale, compiler=compiler))
    if args.only != "walks":
        llm = test_structured_budget.LLM(str(conftest.EMBEDDED), max_num_seqs=test_structured_budget.BATCH)
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Answer in JSON."}])
        test = test_structured_budget.test_every_answer_validates_under_any_budget_from_the_minimum
        # Each example is a batch of BATCH cases.
        result = run(test.__name__, test, args.scale, llm=llm, prompt=prompt)
        result["cases"] = result["examples"] * test_structured_budget.BATCH
        results.append(result)
    if args.out:
        args.out.write_text(json.dumps({"scale": args.scale, "date": time.strftime("%Y-%m-%d"),
                                        "results": results}, indent=2))
    sys.exit(1 if any(r["failed"] for r in results) else 0)


if __name__ == "__main__":
    main()
