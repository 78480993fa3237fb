"""The `specsot` command line: a streamed answer with a summary line, and one-line errors."""

import os
import re
import subprocess
import sys

import pytest
from conftest import fresh_home


def specsot(*args, stdin=None, home=None):
    cmd = [sys.executable, "-c", "from specsot_mq.cli.app import main; main()", *args]
    env = None if home is None else {**os.environ, "SPECSOT_HOME": str(fresh_home(home))}
    return subprocess.run(cmd, capture_output=True, text=True, input=stdin, timeout=600, env=env)


@pytest.mark.parametrize(
    "args, message",
    [
        (["ask", "hi", "--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["ask", "hi", "--dtype", "fp8"], "unknown dtype 'fp8'"),
        (["ask", "hi", "--quantize", "int3"], "unknown --quantize 'int3'"),
        (["ask", "hi", "--max-len", "0"], "--max-len must be at least 1 token, got 0"),
        (["launch", "--quantize", "q4"], "unknown --quantize 'q4'"),
        (["ask", "hi", "--temperature", "-1"], "temperature must be >= 0"),
        (["ask", "  "], "the question is empty"),
        (["ask", "hi", "--lookup", "-1"], "--lookup must be a whole number of at least 0"),
        (["ask", "hi", "--draft-depth", "9"], "--draft-depth 9 is deeper"),
        (["run", "--lookup", "-1"], "--lookup must be a whole number of at least 0"),
        (["launch", "--draft-topk", "0"], "--draft-topk must be a whole number of at least 1"),
        (["chat", "--draft-depth", "9"], "--draft-depth 9 is deeper"),
        (["run", "--sot", "maybe"], "--sot must be one of auto, always, never, got 'maybe'"),
        (["chat", "--sot", "maybe"], "--sot must be one of auto, always, never, got 'maybe'"),
        (["chat", "--max-tokens", "0"], "max_tokens must be at least 1, got 0"),
        (["pull", "no-such-model"], "unknown model 'no-such-model'"),
        (["train-draft", "--feature-layers", "2,x"], "--feature-layers '2,x': give layer numbers"),
        (["train-draft", "--feature-noise", "2"], "--feature-noise 2.0: give a fraction"),
        (["train-draft", "--batch", "0"], "--batch 0: give the number of sequences"),
        (["train-draft", "--questions", "0"], "--questions 0: give the number of questions"),
        (["train-draft", "--epochs", "-1"], "--epochs -1: give 0 (write the data only) or more"),
        (["launch", "--point-tokens", "0"], "--point-tokens must be at least 1, got 0"),
        (["serve", "--budget", "lots"], "--budget 'lots': give tokens per hour"),
        (["serve", "--max-concurrency", "0"], "--max-concurrency must be at least 1, got 0"),
        (["serve", "--timeout", "0"], "--timeout must be above 0 seconds"),
        (["serve", "--max-body-mb", "0"], "--max-body-mb must be above 0 MB"),
        (["serve", "--prefix-cache-mb", "-1"], "--prefix-cache-mb must be 0 (off) or more"),
        (["serve", "--draft-depth", "9"], "--draft-depth 9 is deeper"),
        (["serve", "--port", "99999"], "--port must be 1 to 65535, got 99999"),
        (["run", "-i", "/no/such/questions.txt"], "cannot read --input /no/such/questions.txt: No such file"),
        (["run", "-i", "/", "-o", "-"], "cannot read --input /: Is a directory"),
        (["run", "-i", "/dev/null", "-o", "/no/such/folder/out.jsonl"], "cannot write --output /no/such/folder/out.jsonl"),
        (["serve", "--host", "192.0.2.1"], "--host '192.0.2.1' is no address of this machine"),
    ],
)
def test_user_errors_are_one_line_without_traceback(args, message, tmp_path):
    """Checked before any work: with an empty model cache, nothing is pulled first."""
    out = specsot(*args, home=tmp_path)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_serve_on_a_port_in_use_says_so_at_once_and_starts_nothing(tmp_path):
    """The port is bound before a launch starts or a model is pulled (the home stays empty)."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        out = specsot("serve", "--port", str(port), "--run", "taken", home=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == f"error: port {port} on 127.0.0.1 is in use (another server?): stop it or pick another with --port"
    assert [p.name for p in tmp_path.iterdir()] == ["kernels"]  # fresh_home's link alone


def test_a_second_launch_under_a_live_ones_name_is_refused_and_its_run_file_kept(tmp_path):
    """Two launches under one --run name: the second would have written over the first's run file,
    and the clients of the first would have attached to the second."""
    import json

    runs = tmp_path / "runs"
    runs.mkdir()
    info = {"launcher_pid": os.getpid(), "client_address": "ipc:///nowhere"}  # this test's process: alive
    (runs / "busy.json").write_text(json.dumps(info))
    out = specsot("launch", "--run", "busy", home=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "a launch named 'busy' is already running" in out.stderr and "--run" in out.stderr
    assert json.loads((runs / "busy.json").read_text()) == info


def test_a_draft_head_that_is_no_safetensors_file_is_one_line(default_model_dir):
    out = specsot("ask", "hi", "--draft", __file__)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"draft head {__file__} cannot be read" in out.stderr and "--draft none" in out.stderr


def test_train_draft_checks_its_feature_layers_before_writing_data(default_model_dir, tmp_path):
    out = specsot("train-draft", "--feature-layers", "3,5", "--work-dir", str(tmp_path / "work"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--feature-layers 3,5" in out.stderr and "the last being 30" in out.stderr
    assert not (tmp_path / "work").exists()


@pytest.mark.slow
def test_ask_streams_an_answer_and_a_summary(default_model_dir):
    out = specsot("ask", "-", "--max-tokens", "12", "--dtype", "fp32", stdin="Name a primary colour.")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    summary = out.stderr.strip().splitlines()[-1]
    assert "tokens" in summary and "tok/s" in summary


@pytest.mark.slow
def test_ask_sends_a_system_message_before_the_question(default_model_dir):
    """--system TEXT: the answer follows it (the default model answers in French when told to)."""
    args = ("ask", "Name a primary colour.", "--max-tokens", "12", "--dtype", "fp32", "--sot", "never")
    plain, told = specsot(*args), specsot(*args, "--system", "Answer in French.")
    assert plain.returncode == 0 and told.returncode == 0, told.stderr
    assert told.stdout.strip() and told.stdout != plain.stdout


def test_piped_view_ends_the_skeleton_line_before_a_direct_answer(capsys):
    """A skeleton that turns direct (streamed to stderr) ends its line before the answer starts."""
    import io

    from rich.console import Console

    from specsot_mq.cli.display import AnswerView
    from specsot_mq.messages import Answer, AnswerText, MergePlan, PointText, SkeletonText, ids

    err = io.StringIO()
    view = AnswerView(Console(file=io.StringIO()), Console(file=err, width=200))
    for event in [SkeletonText("r", "1.", ids([])), SkeletonText("r", " One point", ids([1])),
                  MergePlan("r", "direct", "skeleton says direct", "", [[0, ""]], {"local": [0]}, {}),
                  PointText("r", 0, "The", ids([2])), AnswerText("r", "The"), AnswerText("r", " answer."),
                  Answer("r", "The answer.", "direct", "skeleton says direct", "", [], {})]:  # fmt: skip
        view(event)
    assert err.getvalue().startswith("1. One point\n")
    assert capsys.readouterr().out == "The answer.\n"


@pytest.mark.parametrize(
    "line, rid, question, error",
    [
        ("Why is the sky blue?", "line-3", "Why is the sky blue?", None),
        ('{"id": "q1", "question": "Hi"}', "q1", "Hi", None),
        ('{"id": 7, "question": "Hi"}', "7", "Hi", None),
        ('{"custom_id": "c", "body": {"messages": [{"role": "user", "content": "Hi"}]}}', "c", "Hi", None),
        ('{"custom_id": "c2", "body": {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", '
         '"content": "Hi"}, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": [{"type": "text", '
         '"text": "Why?"}]}]}}', "c2", "Why?", None),  # the turns before its question are its history
        ('{"id": oops', "line-3", None, "line 3 is not valid JSON"),
        ("[1, 2]", "line-3", None, None),  # not an object: read as a plain question
        ('{"id": "q5"}', "q5", None, 'line 3 has none of "question", "turns" or "body"'),  # its own id, with the error
        ('{"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]}', "81", ["Write a poem.", "Shorter."],
         None),  # MT-bench's: its questions, asked in turn
        ('{"question_id": 82, "turns": ["Hi", ""]}', "82", None, "line 3: turns must be a non-empty list of non-empty"),
        ('{"id": "q6", "question": "  "}', "q6", None, "the question must be a non-empty string"),
        ('{"custom_id": "c7", "body": {"messages": []}}', "c7", None, "line 3: messages must be a non-empty list"),
        ('{"custom_id": "c8", "body": {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", '
         '"content": "Hello."}]}}', "c8", None, "the last message must be the user's question"),
    ],
)
def test_batch_lines_give_their_id_and_question_or_one_error(line, rid, question, error):
    from specsot_mq.cli.serve import BadLine, parse_batch_line

    if error is None:
        got = parse_batch_line(line, 3)
        assert got[:2] == (rid, question if question is not None else line)
        if rid == "c2":
            assert got[2] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                              {"role": "assistant", "content": "Hello."}]  # fmt: skip
        else:
            assert got[2] == []
    else:
        with pytest.raises(BadLine, match=re.escape(error)) as caught:
            parse_batch_line(line, 3)
        assert caught.value.rid == rid


def test_chat_set_changes_a_setting_and_keeps_the_old_one_when_the_value_is_refused():
    import io

    from rich.console import Console

    from specsot_mq.cli.options import AnswerOptions
    from specsot_mq.cli.serve import Conversation, _slash

    out = io.StringIO()
    console = Console(file=out, width=200)
    answers = _slash("/set max_tokens 40", AnswerOptions(), Conversation(), console)
    assert answers.max_tokens == 40 and answers.params().max_tokens == 40
    for bad in ("/set max_tokens 0", "/set max_tokens x", "/set mode maybe", "/set temperature -1"):
        assert _slash(bad, answers, Conversation(), console) == answers, bad  # refused, the settings as they were
    answers = _slash("/set mode always", answers, Conversation(), console)
    assert answers.sot == "always" and answers.max_tokens == 40
    assert out.getvalue().count("does not take") == 4 and "max_tokens = 40" in out.getvalue()
    for line in ("/set temperature 0.8", "/set top_k 40", "/set top_p 0.95", "/set min_p 0.05", "/set seed 7"):
        answers = _slash(line, answers, Conversation(), console)
    params = answers.params()  # what every question of the chat is sent with
    assert (params.temperature, params.top_k, params.top_p, params.min_p, params.seed) == (0.8, 40, 0.95, 0.05, 7)
    for bad in ("/set top_p 0", "/set top_k -1", "/set min_p 2", "/set seed x"):
        assert _slash(bad, answers, Conversation(), console) == answers, bad
    assert _slash("/set seed none", answers, Conversation(), console).params().seed is None
    assert out.getvalue().count("does not take") == 8


def test_chat_set_system_goes_first_in_every_question_and_outlives_clear_and_trimming():
    """/set system TEXT: a system message sent before the conversation's turns with every
    question (as ollama's /set system); /clear forgets the turns, not it; a conversation too long
    for the cache leaves out its oldest turn, never the system message; /set system alone: none."""
    import io

    from rich.console import Console

    from specsot_mq.cli.options import AnswerOptions
    from specsot_mq.cli.serve import Conversation, _slash, _without_oldest_turn

    console, chat = Console(file=io.StringIO(), width=200), Conversation()
    _slash("/set system   You answer as a ship's captain.  ", AnswerOptions(), chat, console)
    chat.turns += [("Hi", "Ahoy."), ("Where to?", "North.")]
    sent = chat.messages()
    assert sent[0] == {"role": "system", "content": "You answer as a ship's captain."}
    assert [m["role"] for m in sent[1:]] == ["user", "assistant"] * 2
    assert _without_oldest_turn(sent) == [sent[0], *sent[3:]]
    assert _without_oldest_turn(_without_oldest_turn(sent)) == [sent[0]]
    assert _without_oldest_turn([sent[0]]) is None and _without_oldest_turn([]) is None
    _slash("/clear", AnswerOptions(), chat, console)
    assert chat.messages() == [sent[0]]
    _slash("/set system", AnswerOptions(), chat, console)
    assert chat.messages() == []


def test_chat_reads_a_question_of_several_lines_between_triple_quotes():
    from specsot_mq.cli.serve import _read

    class Typed:  # a terminal whose user types these lines
        def __init__(self, *lines):
            self.lines = list(lines)

        def input(self, prompt):
            if not self.lines:
                raise EOFError
            return self.lines.pop(0)

    assert _read(Typed("  Why is the sky blue?  ")) == "Why is the sky blue?"
    assert _read(Typed('"""Summarize this:', "", "  first line", 'second line"""', "next")) == "Summarize this:\n\n  first line\nsecond line"
    assert _read(Typed('"""', "one", "two", '"""')) == "one\ntwo"
    assert _read(Typed('"""just one"""')) == "just one"
    with pytest.raises(EOFError):  # input ended inside the quotes: nothing half-read is asked
        _read(Typed('"""', "one"))
