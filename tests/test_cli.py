"""The smollm2 command: the embedded model answers, and bad input is one line and a non-zero exit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import DATA

from smollm2 import Tokenizer, kernels, load
from smollm2.cli import main


def run(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "smollm2", *args], input=stdin, capture_output=True, text=True,
                          timeout=300)


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.mark.subprocess
def test_chat_answers_paris_from_the_embedded_model():
    result = run("chat", "-p", "What is the capital of France?", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.subprocess
def test_bad_model_is_one_line_and_exit_1(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 10)
    result = run("generate", "--model", str(broken), "hello")
    assert result.returncode == 1
    assert str(broken) in one_error_line(result.stderr)


@pytest.mark.parametrize("args, message", [
    (["generate", "--top-p", "1.5", "hi"], "top_p"),
    (["generate", "--temperature", "-1", "hi"], "temperature"),
    (["chat", "--model", "no/such/dir", "-p", "hi"], "no/such/dir"),
    (["perplexity", "no-such-file.txt"], "no-such-file.txt"),
])
def test_bad_flags_fail_before_loading(capsys, args, message):
    assert main(args) == 1
    assert message in one_error_line(capsys.readouterr().err)


def test_generate_streams_a_completion(tiny_dir, capsys):
    assert main(["generate", "--model", str(tiny_dir), "--max-new-tokens", "5", "--temperature", "0", "Hello"]) == 0
    assert capsys.readouterr().out.strip()


def test_generate_prints_logprobs(tiny_dir, capsys):
    from smollm2 import Tokenizer
    from smollm2.generation import stream

    args = ["generate", "--model", str(tiny_dir), "--max-new-tokens", "4", "--temperature", "0", "Hello"]
    assert main([*args, "--logprobs", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()[-4:]
    model, tokenizer = load(tiny_dir), Tokenizer.from_pretrained(tiny_dir)
    steps = [s for (s,) in stream(model, [tokenizer.encode("Hello")], 4, temperature=0, logprobs=2)]
    for line, step in zip(lines, steps, strict=True):
        token_id, token, logprob, top = line.split("\t")
        assert int(token_id) == step.token and token == repr(tokenizer.token_text(step.token))
        assert float(logprob) == pytest.approx(step.logprob.logprob, abs=1e-4)
        assert top.startswith("top: ") and top.count("  ") == 1


def test_prompt_longer_than_the_context_window(tiny_dir, capsys):
    assert main(["generate", "--model", str(tiny_dir), "word " * 600]) == 1
    assert "context window of 512" in one_error_line(capsys.readouterr().err)


def test_empty_prompt_and_message(tiny_dir, capsys):
    assert main(["generate", "--model", str(tiny_dir), ""]) == 1
    assert "empty" in one_error_line(capsys.readouterr().err)
    assert main(["chat", "--model", str(tiny_dir), "-p", "  "]) == 1
    assert "empty" in one_error_line(capsys.readouterr().err)


def test_interactive_chat_keeps_history(tiny_dir, monkeypatch, capsys):
    from smollm2 import cli

    seen = []
    real = Tokenizer.apply_chat_template
    monkeypatch.setattr(Tokenizer, "apply_chat_template", lambda self, m, **kw: seen.append(list(m)) or real(self, m))
    monkeypatch.setattr(sys, "stdin", __import__("io").StringIO("hello\nagain\n/reset\nfresh\n"))
    assert cli.main(["chat", "--model", str(tiny_dir), "--max-new-tokens", "3", "--temperature", "0"]) == 0
    assert [len(m) for m in seen] == [1, 3, 1]
    assert [m["role"] for m in seen[1]] == ["user", "assistant", "user"]


def test_perplexity_json(tiny_dir, capsys):
    assert main(["perplexity", "--model", str(tiny_dir), str(DATA / "english.txt"), "--context", "128",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] > 500 and result["perplexity"] > 1 and result["stride"] == 64


def test_perplexity_stride_below_the_context(tiny_dir, capsys):
    """A window moved by all of itself would leave its first token without a prediction."""
    argv = ["perplexity", "--model", str(tiny_dir), str(DATA / "english.txt"), "--context", "64"]
    assert main([*argv, "--stride", "64"]) == 1
    assert "--stride must be in [1, --context - 1 = 63], got 64" in one_error_line(capsys.readouterr().err)
    assert main([*argv, "--stride", "63", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stride"] == 63


def test_perplexity_equals_one_window_when_the_text_fits(model, english, tmp_path, capsys):
    import torch

    ids = Tokenizer.from_pretrained().encode(english)[:300]
    text = tmp_path / "short.txt"
    text.write_text(Tokenizer.from_pretrained().decode(ids))
    assert main(["perplexity", str(text), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    ids = Tokenizer.from_pretrained().encode(text.read_text())
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0, :-1]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).item()
    assert result["nll"] == pytest.approx(nll, rel=1e-5)


def test_perplexity_bad_files(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00abc")
    assert main(["perplexity", str(tmp_path / "binary.txt")]) == 1
    assert "not UTF-8" in one_error_line(capsys.readouterr().err)
    assert main(["perplexity", str(tmp_path / "empty.txt")]) == 1
    assert "empty" in one_error_line(capsys.readouterr().err)


@pytest.mark.subprocess
def test_bench_beside_transformers(tiny_dir, capsys):
    assert main(["bench", "--model", str(tiny_dir), "--prompt-tokens", "8", "--new-tokens", "4", "--repeats", "1",
                 "--compare", "transformers", "--compare", "torch", "--quantize", "int8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["system"] for r in result["results"]] == ["smollm2", "transformers", "smollm2 (torch)"]
    assert all(r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 for r in result["results"])
    assert result["weights_read"] == "int8"  # what our decoding read: the quantized weights
    assert main(["bench", "--batch-size", "0"]) == 1
    assert "--batch-size" in one_error_line(capsys.readouterr().err)
    assert main(["bench", "--model", str(tiny_dir / "missing")]) == 1  # found out in the system's own process
    assert "missing" in one_error_line(capsys.readouterr().err)


@pytest.mark.subprocess
@pytest.mark.skipif(kernels.compiled() is None, reason="no C compiler")
def test_bench_says_what_ran_each_operation(tiny_dir, capsys, monkeypatch, tmp_path):
    """Measured in smollm2's own process (SMOLLM2_KERNELS=auto), its choices come back with its speeds."""
    built = kernels.cache_dir() / f"kernels-{kernels.build_key()}.so"
    (tmp_path / "smollm2").mkdir()
    (tmp_path / "smollm2" / built.name).symlink_to(built)  # not built again: only the choices' file is new
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("SMOLLM2_KERNELS", "auto")
    args = ["bench", "--model", str(tiny_dir), "--prompt-tokens", "40", "--new-tokens", "4", "--repeats", "1"]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["kernels"] == "auto"
    # The prompt's kinds (33-64 rows); a decoding step's are the kernel's, never measured.
    assert {c["rows"] for c in result["kernel_choices"]} == {64}
    norm, = [c for c in result["kernel_choices"] if c["op"] == "rms_norm"]
    assert norm["winner"] in ("kernel", "torch")
    assert norm["text"].startswith("RMSNorm of 64, 33-64 rows, float32: ")
    assert list(tmp_path.glob("smollm2/choices-*.json"))
    assert main(args) == 0  # decided by the file this time
    assert norm["text"].split(":")[0] in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["generate", "--threads", "-1", "hi"], "--threads"),
    (["generate", "--threads", "2147483648", "hi"], "--threads"),
    (["chat", "--threads", "100000", "-p", "hi"], "--threads"),
    (["generate", "--seed", str(2**64), "hi"], "--seed"),
    (["generate", "--seed", "-1", "hi"], "--seed"),
    (["generate", "--logprobs", "21", "hi"], "--logprobs"),
    (["serve", "--port", "70000"], "--port"),
    (["train", "--seed", str(10**30), "--config", "tiny", "--data", "d", "--out", "o"], "--seed"),
])
def test_out_of_range_numbers_are_refused_before_anything_runs(capsys, args, message):
    with pytest.raises(SystemExit) as exit:
        main(args)
    assert exit.value.code == 2
    assert message in one_error_line(capsys.readouterr().err)


def test_an_output_directory_that_is_a_file(tmp_path, capsys):
    (tmp_path / "file").write_text("mine")
    for args in (["finetune", "--data", "d"], ["train", "--config", "tiny", "--data", "d"], ["prepare", "f"]):
        for out in ("file", "file/run"):
            with pytest.raises(SystemExit) as exit:
                main([*args, "--out", str(tmp_path / out)])
            assert exit.value.code == 2
            assert f"{tmp_path / 'file'} exists and is not a directory" in one_error_line(capsys.readouterr().err)
    assert (tmp_path / "file").read_text() == "mine"


def test_text_that_is_not_utf8(tiny_dir, capsys):
    prompt = "caf\udce9"  # b"caf\xe9" (Latin-1) as Python decodes a command-line argument that is not UTF-8
    assert main(["generate", "--model", str(tiny_dir), prompt]) == 1
    assert "the prompt is not valid UTF-8 text" in one_error_line(capsys.readouterr().err)
    assert main(["chat", "--model", str(tiny_dir), "-p", prompt]) == 1
    assert "--prompt is not valid UTF-8 text" in one_error_line(capsys.readouterr().err)
    assert main(["chat", "--model", str(tiny_dir), "--system", prompt, "-p", "hi"]) == 1
    assert "--system is not valid UTF-8 text" in one_error_line(capsys.readouterr().err)


def test_serve_says_where_it_cannot_listen(tiny_dir, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert main(["serve", "--model", str(tiny_dir), "--port", port]) == 1
        assert f"--port {port}: cannot listen there: Address already in use" in one_error_line(capsys.readouterr().err)
    assert main(["serve", "--model", str(tiny_dir), "--host", "no-such-host.invalid"]) == 1
    assert "--host no-such-host.invalid --port 8000: cannot listen there" in one_error_line(capsys.readouterr().err)


def test_a_vanishing_temperature_decodes_greedily(tiny_dir, capsys):
    answers = []
    for temperature in ("0", "1e-45", "5e-324"):
        assert main(["generate", "--model", str(tiny_dir), "--max-new-tokens", "8", "--temperature", temperature,
                     "The capital of France is"]) == 0
        answers.append(capsys.readouterr().out)
    assert answers[0].strip() and answers[1] == answers[2] == answers[0]


def test_a_trainer_state_replaced_by_a_pickle(tiny_dir, tmp_path, capsys):
    import pickle

    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                              {"role": "assistant", "content": "Hello."}]}) + "\n")
    args = ["finetune", "--model", str(tiny_dir), "--data", str(chats), "--out", str(tmp_path / "run"),
            "--seq-len", "64", "--batch-size", "1", "--save-every", "1", "--eval-every", "100"]
    assert main([*args, "--steps", "1"]) == 0
    (trainer,) = (tmp_path / "run" / "checkpoints").glob("step-*/trainer.pt")
    trainer.write_bytes(pickle.dumps(print))  # what unpickling would run
    capsys.readouterr()
    assert main([*args, "--steps", "2", "--resume"]) == 1
    assert f"{trainer}: not a trainer state" in one_error_line(capsys.readouterr().err)


def test_json_schema_answers_fit_it(model, tmp_path, capsys):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
              "required": ["city", "population"]}
    path = tmp_path / "city.json"
    path.write_text(json.dumps(schema))
    assert main(["chat", "--json-schema", str(path), "--temperature", "0", "-p", "Tell me about Paris."]) == 0
    value = json.loads(capsys.readouterr().out)
    assert set(value) == {"city", "population"} and isinstance(value["population"], int)
    assert main(["generate", "--json", "--temperature", "0", "--max-new-tokens", "64", "A JSON object:"]) == 0
    assert isinstance(json.loads(capsys.readouterr().out), dict)


@pytest.mark.parametrize("text, message", [(None, "cannot read"), ("{not json", "is not JSON"),
                                           ('{"type": "lizard"}', "unknown type 'lizard'")])
def test_bad_json_schema_files(tiny_dir, tmp_path, capsys, text, message):
    path = tmp_path / "schema.json"
    if text is not None:
        path.write_text(text)
    assert main(["generate", "--model", str(tiny_dir), "--json-schema", str(path), "hi"]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert message in line and (text is not None or str(path) in line)


class _Payload:  # what a hostile checkpoint would have unpickling run
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os
        return os.system, (f"touch {self.marker}",)


def test_sharded_checkpoint_metadata_that_is_code_is_refused(tiny_dir, tmp_path, capsys):
    import pickle

    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                              {"role": "assistant", "content": "Hello."}]}) + "\n")
    args = ["finetune", "--model", str(tiny_dir), "--data", str(chats), "--out", str(tmp_path / "run"), "--fsdp",
            "--seq-len", "64", "--batch-size", "1", "--save-every", "1", "--eval-every", "100"]
    assert main([*args, "--steps", "1"]) == 0
    (metadata,) = (tmp_path / "run" / "checkpoints").glob("step-*/.metadata")
    marker = tmp_path / "ran"
    metadata.write_bytes(pickle.dumps(_Payload(marker)))
    capsys.readouterr()
    assert main([*args, "--steps", "2", "--resume"]) == 1
    assert "not checkpoint metadata" in one_error_line(capsys.readouterr().err)
    assert not marker.exists()
