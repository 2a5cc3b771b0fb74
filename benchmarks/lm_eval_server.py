"""lm-evaluation-harness against `smollm2 serve`: its log-likelihoods, asked over HTTP, against the library's.

    .venv/bin/pip install "lm-eval[api]"  # not a project dependency (it brings datasets, pandas, pyarrow, ...)
    .venv/bin/python benchmarks/lm_eval_server.py [--model SRC]

Serves the model (default: the embedded one) on a free local port and runs lm-eval's `local-completions` model
on a small multiple-choice task written here as a local task file (nothing is downloaded). lm-eval scores each
choice by asking /v1/completions for the echoed prompt's log-probabilities (`echo`, `logprobs`); the same
(context, continuation) pairs, tokenized as lm-eval tokenizes them, are then scored in-process by
smollm2.evaluate.loglikelihoods. Prints the task's accuracy and the largest difference, and exits non-zero
if any differs by more than 1e-4.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from serving import Serving

QUESTIONS = [
    ("The capital of France is", [" Paris", " London", " Berlin"], 0),
    ("Water freezes at a temperature of zero degrees", [" Celsius", " Kelvin", " miles"], 0),
    ("The opposite of hot is", [" cold", " blue", " seven"], 0),
    ("Two plus two equals", [" four", " five", " purple"], 0),
    ("The sun rises in the", [" east", " west", " basement"], 0),
    ("A baby cat is called a", [" kitten", " puppy", " calf"], 0),
    ("The largest ocean on Earth is the", [" Pacific", " Atlantic", " Arctic"], 0),
    ("Monday comes before", [" Tuesday", " Sunday", " Friday"], 0),
]

TASK = """task: smollm2_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint: HF directory, hub id or GGUF (default: embedded)")
    args = parser.parse_args()

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    from smollm2 import Tokenizer, load
    from smollm2.evaluate import loglikelihoods
    from smollm2.server import create_app

    model, tokenizer = load(args.model), Tokenizer.from_pretrained(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokenizer.save_pretrained(tmp / "tokenizer")  # lm-eval's own tokenizer: transformers' load of ours
        data = tmp / "questions.jsonl"
        data.write_text("".join(json.dumps(dict(question=q, choices=c, answer=a)) + "\n" for q, c, a in QUESTIONS))
        (tmp / "tasks").mkdir()
        (tmp / "tasks" / "smollm2_tiny_mc.yaml").write_text(TASK.format(data=data))

        with Serving(create_app(model, tokenizer, model_name="smollm2", kv_cache_dtype="fp32")) as url:
            results = simple_evaluate(
                model="local-completions", tasks=["smollm2_tiny_mc"], log_samples=True,
                task_manager=TaskManager(include_path=str(tmp / "tasks")),
                model_args=dict(base_url=f"{url}/v1/completions", model="smollm2",
                                tokenizer_backend="huggingface", tokenizer=str(tmp / "tokenizer"), max_retries=1,
                                num_concurrent=1))
        hf = AutoTokenizer.from_pretrained(tmp / "tokenizer")

    # lm-eval's pairs, tokenized as it does: the whole text, split where the context's own tokens end.
    pairs, served = [], []
    for sample in results["samples"]["smollm2_tiny_mc"]:
        for (context, continuation), response in zip(sample["arguments"], sample["resps"]):
            whole, head = hf(context + continuation)["input_ids"], hf(context)["input_ids"]
            pairs.append((head, whole[len(head):]))
            served.append(response[0][0])
    ours = [logprob for logprob, _ in loglikelihoods(model, pairs)]
    worst = max(abs(a - b) for a, b in zip(served, ours))
    accuracy = results["results"]["smollm2_tiny_mc"]["acc,none"]
    print(f"lm-eval local-completions against smollm2 serve: {len(pairs)} log-likelihoods, accuracy {accuracy:.3f}; "
          f"largest difference from smollm2.evaluate: {worst:.2e}")
    sys.exit(0 if worst <= 1e-4 else 1)


if __name__ == "__main__":
    main()
