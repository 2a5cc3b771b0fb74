"""lm-evaluation-harness in process (smollm2.harness, `smollm2 eval`): every kind of request lm-eval makes, on
local task files, gives the numbers lm-eval's own transformers model (`hf`) gets from transformers, and those
lm-eval gets from `smollm2 serve` through its local-completions model."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("lm_eval")

from smollm2 import Tokenizer, load  # noqa: E402
from smollm2.cli import main  # noqa: E402
from smollm2.errors import SmolError  # noqa: E402
from smollm2.harness import run_tasks, task_manager  # noqa: E402
from smollm2.server import create_app  # noqa: E402
from test_server import running  # noqa: E402

QUESTIONS = [("The capital of France is", [" Paris", " London", " Berlin"], 0, "Paris"),
             ("Two plus two equals", [" four", " five", " purple"], 0, "four"),
             ("The sun rises in the", [" east", " west", " basement"], 0, "east"),
             ("A baby cat is called a", [" kitten", " puppy", " calf"], 0, "kitten")]
TEXTS = ["The quick brown fox jumps over the lazy dog. " * 3, "Tokenizers split text into pieces.",
         "One two three four five six seven eight nine ten eleven twelve. " * 6]
SOURCE = """dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
"""
TASKS = {
    "smollm2_test_mc": """output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
target_delimiter: ""
metric_list:
  - metric: acc
""",
    "smollm2_test_rolling": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
""",
    "smollm2_test_gen": """output_type: generate_until
doc_to_text: "Q: {{question}}"
doc_to_target: "{{word}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tasks")
    questions = path / "questions.jsonl"
    questions.write_text("".join(json.dumps(dict(question=q, choices=c, answer=a, word=w)) + "\n"
                                 for q, c, a, w in QUESTIONS))
    texts = path / "texts.jsonl"
    texts.write_text("".join(json.dumps(dict(text=t)) + "\n" for t in TEXTS))
    for name, body in TASKS.items():
        data = texts if "rolling" in name else questions
        (path / f"{name}.yaml").write_text(f"task: {name}\n" + SOURCE.format(data=data) + body)
    return path


def responses(results) -> dict:
    """Per task, every request's raw response, in lm-eval's order."""
    return {task: [sample["resps"] for sample in sorted(samples, key=lambda s: s["doc_id"])]
            for task, samples in results["samples"].items()}


def largest_difference(a, b) -> float:
    """The largest difference between the numbers of two responses alike in shape; inf where anything else
    (a shape, a flag, a text) differs."""
    if isinstance(a, (list, tuple)):
        return max(map(largest_difference, a, b), default=0.0) if len(a) == len(b) else math.inf
    if isinstance(a, float):
        return abs(a - b)
    return 0.0 if a == b else math.inf


# fp32 on both sides, but other summation orders (our kernels, MKL's): the 135M model's logits differ from
# transformers' by up to 1e-3 (tests/test_model.py), its log-likelihoods here (of 1 to ~300 tokens) by up to 1e-4
LOGLIKELIHOOD_TOLERANCE = 2e-4


@pytest.mark.slow
def test_responses_equal_lm_evals_hf_model(model, hf_model, task_dir, tmp_path):
    """lm-eval's `hf` model, on transformers' own load of the embedded GGUF file, against ours in process on the
    same tasks: every log-likelihood within LOGLIKELIHOOD_TOLERANCE, the same greedy answers, the same scores."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    tokenizer = Tokenizer.from_pretrained()
    tokenizer.save_pretrained(tmp_path)
    theirs = simple_evaluate(model=HFLM(pretrained=hf_model, tokenizer=AutoTokenizer.from_pretrained(tmp_path),
                                        batch_size=4, device="cpu"),
                             tasks=list(TASKS), task_manager=task_manager(str(task_dir)), log_samples=True)
    ours = run_tasks(model, tokenizer, list(TASKS), include_path=str(task_dir), batch_size=4, log_samples=True)
    mine, reference = responses(ours), responses(theirs)
    for task in TASKS:
        worst = largest_difference(mine[task], reference[task])
        print(f"{task}: largest difference {worst:.1e}")
        assert worst <= LOGLIKELIHOOD_TOLERANCE, task
        numbers = {k: v for k, v in theirs["results"][task].items() if isinstance(v, float)}
        assert numbers and {k: ours["results"][task][k] for k in numbers} == pytest.approx(numbers, rel=1e-5), task


@pytest.mark.slow
def test_in_process_equals_lm_eval_through_the_server(tiny_dir, task_dir):
    from lm_eval import simple_evaluate

    model, tokenizer = load(tiny_dir), Tokenizer.from_pretrained(tiny_dir)
    ours = run_tasks(model, tokenizer, list(TASKS), include_path=str(task_dir), batch_size=3, log_samples=True)
    with running(create_app(model, tokenizer, model_name="tiny", kv_cache_dtype="fp32")) as url:
        served = simple_evaluate(
            model="local-completions", tasks=list(TASKS), task_manager=task_manager(str(task_dir)),
            model_args=dict(base_url=f"{url}/v1/completions", model="tiny", tokenizer_backend="huggingface",
                            tokenizer=str(tiny_dir), max_retries=1, num_concurrent=1, max_length=512))
    mine, theirs = responses(ours), responses(served)
    assert set(mine) == set(TASKS)
    for task in TASKS:
        assert largest_difference(mine[task], theirs[task]) <= 1e-4, task
        numbers = {k: v for k, v in served["results"][task].items() if isinstance(v, float)}
        assert numbers and {k: ours["results"][task][k] for k in numbers} == pytest.approx(numbers, rel=1e-4), task


def test_the_eval_command_and_its_errors(tiny_dir, task_dir, capsys):
    assert main(["eval", "--model", str(tiny_dir), "--tasks", "smollm2_test_mc", "--include-path", str(task_dir),
                 "--limit", "2", "--json"]) == 0
    assert 0 <= json.loads(capsys.readouterr().out.strip().splitlines()[-1])["smollm2_test_mc"]["acc,none"] <= 1
    for flags, message in ((["--tasks", "no_such_task", "--include-path", str(task_dir)], "no task 'no_such_task'"),
                           (["--tasks", "x", "--include-path", str(task_dir / "missing")], "no such directory"),
                           (["--tasks", ","], "at least one task")):
        assert main(["eval", "--model", str(tiny_dir), *flags]) == 1
        assert message in capsys.readouterr().err


def test_run_tasks_names_an_unknown_task(tiny_dir, task_dir):
    model, tokenizer = load(tiny_dir), Tokenizer.from_pretrained(tiny_dir)
    with pytest.raises(SmolError, match="no task 'nope'"):
        run_tasks(model, tokenizer, ["nope"], include_path=str(task_dir))
