"""Generation evaluation (answers, ROUGE-L) and the MT-Bench judge, against fake judge servers on
127.0.0.1 (no network): judgments kept as they arrive, retries, resume, reference answers, and
the key's safety (no redirects, https only, checked before any model is loaded)."""

from __future__ import annotations

import json
import logging

import pytest

from deca_ds.data import SyntheticTask, build_word_tokenizer
from deca_ds.datasets import Record, alpaca_prompt, vocabulary
from deca_ds.evaluation import (
    generate_answers,
    judge_answers,
    judge_prompt,
    judge_url,
    load_references,
    parse_rating,
    read_questions,
    rouge_l,
    rouge_l_of_answers,
)
from deca_ds.models import tiny_llama
from helpers import JUDGE_KEY as KEY

WORDS = [f"w{i}" for i in range(20)]


# ---- ROUGE-L and answers ---------------------------------------------------------------------


def test_rouge_l_ignores_case_and_punctuation():
    assert rouge_l("The cat sat on the mat.", "the cat sat on the mat") == 1.0


def test_rouge_l_hand_computed():
    # LCS "the cat on the mat" = 5 of 6 tokens each way: P = R = F = 5/6
    assert rouge_l("the cat sat on the mat", "the cat is on the mat") == pytest.approx(5 / 6)
    # LCS "a c" = 2: P = 2/4, R = 2/3, F = 2PR/(P+R) = 4/7
    assert rouge_l("a b c d", "a c e") == pytest.approx(4 / 7)
    assert rouge_l("b a", "a b") == pytest.approx(0.5)
    assert rouge_l("x y", "z") == 0.0 and rouge_l("", "a") == 0.0 and rouge_l("a", "  ") == 0.0
    assert rouge_l("Hello, World!", "hello world") == 1.0


def test_generate_answers_multi_turn(tmp_path):
    questions = tmp_path / "questions.jsonl"
    questions.write_text(
        json.dumps({"question_id": 81, "category": "writing", "turns": ["Write about w1", "Now list w2"]}) + "\n"
        + json.dumps({"question_id": "v2", "text": "Explain w3"}) + "\n")
    words = vocabulary([Record(alpaca_prompt("Write about w1 Now list w2 Explain w3"), "")]) + WORDS
    tok = build_word_tokenizer(words)
    model = tiny_llama(len(tok), seed=0)
    out = tmp_path / "answers" / "model.jsonl"
    rows = generate_answers(model, tok, questions, out, max_new_tokens=4, batch_size=2)
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert written == rows
    assert [r["question_id"] for r in rows] == [81, "v2"]
    assert rows[0]["turns"] == ["Write about w1", "Now list w2"] and rows[1]["turns"] == ["Explain w3"]
    assert [len(r["answers"]) for r in rows] == [2, 1] and rows[0]["category"] == "writing"
    assert all(isinstance(a, str) and len(a.split()) <= 4 for r in rows for a in r["answers"])
    assert model.training  # the model's mode is restored


def test_rouge_of_answers_uses_references_only(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"question_id": 1, "turns": ["x", "y"], "reference": ["a c", "b"]}\n'
                    '{"question_id": 2, "text": "z", "reference": "d"}\n{"question_id": 3, "text": "w"}\n')
    questions = read_questions(path)
    assert [q.get("reference") for q in questions] == [["a c", "b"], ["d"], None]
    rows = [{"answers": ["a b c", "b"], "reference": ["a c", "b"]}, {"answers": ["e"], "reference": ["d"]},
            {"answers": ["w"]}]
    # LCS("a b c", "a c") = 2: P = 2/3, R = 1, F = 0.8; then 1.0 and 0.0
    assert rouge_l_of_answers(rows) == {"rouge_l": pytest.approx((0.8 + 1.0 + 0.0) / 3), "n": 3}
    assert rouge_l_of_answers([{"answers": ["w"]}]) is None
    path.write_text('{"question_id": 1, "turns": ["x"], "reference": ["a", "b"]}\n')
    with pytest.raises(ValueError, match="one string per turn"):
        read_questions(path)


@pytest.mark.parametrize("text, problem", [
    ('{"question_id": 1, "text": "x"}\n\n{"question_id": 2, "text": "y"\n', r"q.jsonl:3: not JSON"),
    ('["not", "a", "question"]\n', r"q.jsonl:1: a question needs 'question_id'"),
    # answers, references and judgments are matched by the id: the second's judgment replaced the first's
    ('{"question_id": 7, "text": "x"}\n{"question_id": 7, "text": "y"}\n',
     r"q.jsonl:2: question_id 7 is also line 1's: give each question its own"),
    ('{"question_id": [1], "text": "x"}\n', r"q.jsonl:1: question_id must be an integer or a string, got \[1\]"),
    ("\n", r"q.jsonl: holds no questions"),  # was max() of an empty sequence when the answers were generated
])
def test_question_and_reference_files_name_the_bad_line(tmp_path, text, problem):
    path = tmp_path / "q.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=problem):
        read_questions(path)
    path.write_text('{"question_id": 1, "choices": [{"turns": ["r1"]}]}\n\n{"question_id": 2}\n')
    with pytest.raises(ValueError, match=r"q.jsonl:3: not a reference answer line \(KeyError"):
        load_references(path)
    path.write_text('{"question_id": 1, "choices": [{"turns": ["r1", "r2"]}]}\n{"question_id": 2, "reference": "r"}\n')
    assert load_references(path) == {1: ["r1", "r2"], 2: ["r"]}


def test_parse_rating():
    assert parse_rating("Fine.\nRating: [[8]]") == 8.0
    assert parse_rating("[[3]] then finally Rating: [[9.5]]") == 9.5
    assert parse_rating("Rating: 6") == 6.0
    assert parse_rating("no score") is None


# ---- against fake judge servers (helpers.Judge, conftest's `judges`) ----------------------------



def write_answers(path, rows=None):
    rows = rows or [{"question_id": 1, "turns": ["q1", "q2"], "answers": ["a1", "a2"]},
                    {"question_id": 2, "turns": ["q3"], "answers": ["a3"]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def judge(answers, j, **kw):
    return judge_answers(answers, endpoint_url=j.url, model="judge-model", api_key_env="JUDGE_KEY",
                         allow_http=True, backoff=0.01, **kw)


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_judge_against_fake_server(tmp_path, judges, caplog, capsys):
    j = judges(["Clear and correct. Rating: [[7]]", "Too short. Rating: [[4.5]]", "Good. Rating: [[7]]"])
    answers = write_answers(tmp_path / "answers.jsonl")
    caplog.set_level(logging.DEBUG)
    result = judge(answers, j)
    assert len(j.seen) == 3
    assert all(s["auth"] == f"Bearer {KEY}" and s["path"] == "/v1/chat/completions" for s in j.seen)
    first = j.seen[0]["body"]["messages"]
    assert j.seen[0]["body"]["model"] == "judge-model" and first[0]["content"] == "You are a helpful assistant."
    assert "[Question]\nq1\n\n[The Start of Assistant's Answer]\na1\n" in first[1]["content"]
    second = j.seen[1]["body"]["messages"]
    assert "answer to the second user question" in second[0]["content"]
    assert "### User:\nq1\n\n### Assistant A:\na1\n\n### User:\nq2\n\n### Assistant A:\na2" in second[1]["content"]
    assert result["n"] == 3 and result["n_unparsed"] == 0
    assert result["mean"] == pytest.approx((7 + 4.5 + 7) / 3) and result["per_turn"] == {1: 7.0, 2: 4.5}
    judgments = lines(tmp_path / "answers.judgments.jsonl")
    assert [(r["question_id"], r["turn"], r["score"], r["prompt"]) for r in judgments] == [
        (1, 1, 7.0, "single-v1"), (1, 2, 4.5, "single-v1-multi-turn"), (2, 1, 7.0, "single-v1")]
    captured = capsys.readouterr()
    for text in [*(p.read_text() for p in tmp_path.rglob("*") if p.is_file()), caplog.text, captured.out,
                 captured.err, json.dumps(result)]:
        assert KEY not in text


def test_judge_retries_transient_errors_with_backoff(tmp_path, judges):
    slept = []
    j = judges([503, 429, "Rating: [[6]]", 500, "Rating: [[8]]", "Rating: [[9]]"])
    result = judge(write_answers(tmp_path / "answers.jsonl"), j, sleep=slept.append)
    assert len(j.seen) == 6 and result["n"] == 3 and result["mean"] == pytest.approx((6 + 8 + 9) / 3)
    assert slept == pytest.approx([0.01, 0.02, 0.01])  # doubling per attempt of one request
    assert [line["score"] for line in lines(tmp_path / "answers.judgments.jsonl")] == [6.0, 8.0, 9.0]


def test_judge_gives_up_after_its_retries_and_keeps_what_it_has(tmp_path, judges):
    slept = []
    j = judges(["Rating: [[5]]", 502, 502, 502])
    with pytest.raises(ValueError, match="HTTP 502 for question 1 turn 2 after 3 attempts.*1 judgments are kept"):
        judge(write_answers(tmp_path / "answers.jsonl"), j, retries=2, sleep=slept.append)
    assert slept == pytest.approx([0.01, 0.02]) and len(j.seen) == 4
    assert [line["score"] for line in lines(tmp_path / "answers.judgments.jsonl")] == [5.0]


def test_judge_sends_through_the_given_opener(tmp_path, judges):
    import urllib.request

    from deca_ds.evaluation import safe_opener

    class Counting:
        def __init__(self):
            self.inner, self.urls = safe_opener(), []

        def open(self, request: urllib.request.Request, timeout: float):
            self.urls.append(request.full_url)
            return self.inner.open(request, timeout=timeout)

    j, opener = judges(), Counting()
    assert judge(write_answers(tmp_path / "answers.jsonl"), j, opener=opener)["n"] == 3
    assert opener.urls == [j.url + "/v1/chat/completions"] * 3 and len(j.seen) == 3


def test_judgments_are_kept_as_they_arrive_and_the_run_resumes(tmp_path, judges):
    answers = write_answers(tmp_path / "answers.jsonl")
    out = tmp_path / "answers.judgments.jsonl"
    failing = judges(["Rating: [[6]]", "Rating: [[8]]", 400])  # 400 is not transient: no retry
    with pytest.raises(ValueError, match="HTTP 400 for question 2 turn 1.*2 judgments are kept"):
        judge(answers, failing)
    assert [(r["question_id"], r["turn"], r["score"]) for r in lines(out)] == [(1, 1, 6.0), (1, 2, 8.0)]
    with open(out, "a") as f:
        f.write('{"question_id": 2, "tu')  # a line cut off by a crash
    working = judges(["Rating: [[3]]"])
    result = judge(answers, working)
    assert len(working.seen) == 1 and "q3" in working.seen[0]["body"]["messages"][1]["content"]
    assert [(r["question_id"], r["turn"], r["score"]) for r in lines(out)] == [(1, 1, 6.0), (1, 2, 8.0), (2, 1, 3.0)]
    assert result["n"] == 3 and result["mean"] == pytest.approx((6 + 8 + 3) / 3)
    judge(answers, working)
    assert len(working.seen) == 1  # everything judged: nothing sent
    write_answers(answers, [{"question_id": 1, "turns": ["q1", "q2"], "answers": ["a1", "a2, revised"]},
                            {"question_id": 2, "turns": ["q3"], "answers": ["a3"]}])
    result = judge(answers, judges(["Rating: [[10]]"]))  # a regenerated answer is judged again
    assert [(r["question_id"], r["turn"], r["score"]) for r in lines(out)][-1] == (1, 2, 10.0)
    assert result["n"] == 3 and result["mean"] == pytest.approx((6 + 10 + 3) / 3)
    with pytest.raises(ValueError, match="judged by 'judge-model', not 'other'"):
        judge_answers(answers, endpoint_url=working.url, model="other", api_key_env="JUDGE_KEY", allow_http=True)


def test_judge_gives_reference_answers_for_math_reasoning_coding(tmp_path, judges):
    rows = [{"question_id": 111, "category": "math", "turns": ["2+2?", "times 3?"], "answers": ["4", "12"]},
            {"question_id": 121, "category": "coding", "turns": ["sort?"], "answers": ["sorted()"]},
            {"question_id": 81, "category": "writing", "turns": ["poem"], "answers": ["roses"],
             "reference": ["not used"]}]
    answers = write_answers(tmp_path / "answers.jsonl", rows)
    refs = tmp_path / "gpt-4.jsonl"  # FastChat's reference_answer format
    refs.write_text(json.dumps({"question_id": 111, "choices": [{"index": 0, "turns": ["It is 4.", "It is 12."]}]})
                    + "\n" + json.dumps({"question_id": 121, "reference": "use sorted"}) + "\n")
    j = judges()
    judge(answers, j, references=refs)
    prompts = [s["body"]["messages"] for s in j.seen]
    assert "[The Start of Reference Answer]\nIt is 4.\n[The End of Reference Answer]" in prompts[0][1]["content"]
    assert "comparing the assistant's answer with the reference answer" in prompts[0][1]["content"]
    assert "### User:\n2+2?\n\n### Reference answer:\nIt is 4.\n\n### User:\ntimes 3?\n\n### Reference answer:\n" \
           "It is 12." in prompts[1][1]["content"]
    assert "correctness and helpfulness" in prompts[1][0]["content"]
    assert "[The Start of Reference Answer]\nuse sorted\n" in prompts[2][1]["content"]
    assert "Reference" not in prompts[3][1]["content"]  # writing: FastChat grades without a reference
    assert [r["prompt"] for r in lines(tmp_path / "answers.judgments.jsonl")] == [
        "single-math-v1", "single-math-v1-multi-turn", "single-math-v1", "single-v1"]
    other = judges()
    with pytest.raises(ValueError, match="question 111 .math. is graded against a reference"):
        judge(answers, other, out_path=tmp_path / "again.jsonl")
    assert other.seen == []  # refused before any request


def test_judge_prompt_first_turn_matches_fastchat_single_v1():
    name, system, text = judge_prompt(["Q"], ["A"], 0)
    assert name == "single-v1" and system == "You are a helpful assistant."
    assert text.startswith("[Instruction]\nPlease act as an impartial judge")
    assert text.endswith("[Question]\nQ\n\n[The Start of Assistant's Answer]\nA\n[The End of Assistant's Answer]")
    assert 'strictly following this format: "[[rating]]", for example: "Rating: [[5]]".' in text


RATE = ('After providing your explanation, you must rate the response on a scale of 1 to 10 by strictly following '
        'this format: "[[rating]]", for example: "Rating: [[5]]".\n\n')


def test_judge_prompt_second_turn_matches_fastchat_multi_turn():
    # the system prompts of FastChat's llm_judge/data/judge_prompts.jsonl, verbatim
    name, system, _ = judge_prompt(["Q1", "Q2"], ["A1", "A2"], 1)
    assert name == "single-v1-multi-turn" and system == (
        "Please act as an impartial judge and evaluate the quality of the response provided by an AI assistant to "
        "the user question displayed below. Your evaluation should consider factors such as the helpfulness, "
        "relevance, accuracy, depth, creativity, and level of detail of the response. You evaluation should focus "
        "on the assistant's answer to the second user question. Begin your evaluation by providing a short "
        "explanation. Be as objective as possible. " + RATE)
    name, system, text = judge_prompt(["Q1", "Q2"], ["A1", "A2"], 1, ["R1", "R2"])
    assert name == "single-math-v1-multi-turn" and system == (
        "Please act as an impartial judge and evaluate the quality of the response provided by an AI assistant to "
        "the user question. Your evaluation should consider correctness and helpfulness. You will be given a "
        "reference answer and the assistant's answer. You evaluation should focus on the assistant's answer to the "
        "second question. Begin your evaluation by comparing the assistant's answer with the reference answer. "
        "Identify and correct any mistakes. Be as objective as possible. " + RATE)
    assert text == (
        "<|The Start of Reference Answer|>\n\n### User:\nQ1\n\n### Reference answer:\nR1\n\n### User:\nQ2\n\n"
        "### Reference answer:\nR2\n\n<|The End of Reference Answer|>\n\n\n"
        "<|The Start of Assistant A's Conversation with User|>\n\n### User:\nQ1\n\n### Assistant A:\nA1\n\n"
        "### User:\nQ2\n\n### Assistant A:\nA2\n\n<|The End of Assistant A's Conversation with User|>")


# ---- the key's safety (issue 20) ---------------------------------------------------------------


def test_judge_refuses_a_redirect_and_never_sends_the_key_elsewhere(tmp_path, judges):
    elsewhere = judges()
    j = judges([(302, elsewhere.url + "/v1/chat/completions")])
    with pytest.raises(ValueError, match="redirect.*refused") as err:
        judge(write_answers(tmp_path / "answers.jsonl"), j)
    assert KEY not in str(err.value)
    assert len(j.seen) == 1 and elsewhere.seen == []


@pytest.mark.parametrize("url, allow, message", [
    ("http://judge.example.com", False, "plain http"),
    ("http://judge.example.com", True, "only to localhost"),
    ("http://127.0.0.1:9", False, "--judge-allow-http"),
    ("ftp://judge.example.com", False, "not an https URL"),
    ("https://user:pw@judge.example.com", False, "credentials in the URL"),
])
def test_judge_url_is_https_unless_http_to_localhost_is_allowed(url, allow, message, tmp_path, judges):
    with pytest.raises(ValueError, match=message):
        judge_answers(write_answers(tmp_path / "a.jsonl"), endpoint_url=url, model="m", api_key_env="JUDGE_KEY",
                      allow_http=allow)


def test_judge_url_forms():
    assert judge_url("https://api.openai.com") == "https://api.openai.com/v1/chat/completions"
    assert judge_url("https://h/v1/") == "https://h/v1/chat/completions"
    assert judge_url("https://h/x/chat/completions") == "https://h/x/chat/completions"
    assert judge_url("http://localhost:8000", allow_http=True) == "http://localhost:8000/v1/chat/completions"
    assert judge_url("http://[::1]:8000/v1", allow_http=True) == "http://[::1]:8000/v1/chat/completions"


def test_missing_key_sends_nothing(tmp_path, judges, monkeypatch):
    j = judges()
    monkeypatch.delenv("JUDGE_KEY")
    with pytest.raises(ValueError, match="environment variable JUDGE_KEY"):
        judge(write_answers(tmp_path / "answers.jsonl"), j)
    assert j.seen == []


def test_evaluate_checks_the_judge_before_loading_any_model(tmp_path, monkeypatch, capsys):
    from deca_ds import models
    from deca_ds.runtime import evaluate

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the judge's settings were checked")

    monkeypatch.setattr(models, "load_model", no_model)
    monkeypatch.delenv("JUDGE_KEY", raising=False)
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"question_id": 1, "text": "hi"}\n')
    base = ["--model", str(tmp_path / "model"), "--questions", str(questions), "--out", str(tmp_path / "e.json"),
            "--judge-key-env", "JUDGE_KEY"]
    for extra, message in ([["--judge-url", "https://judge.example.com"], "environment variable JUDGE_KEY"],
                           [["--judge-url", "http://judge.example.com"], "plain http"]):
        with pytest.raises(SystemExit) as code:
            evaluate.main([*base, *extra])
        assert code.value.code == 1 and message in capsys.readouterr().err
    assert not (tmp_path / "e.json").exists()


def test_deca_eval_writes_over_no_file_but_its_own(tmp_path, monkeypatch, capsys):
    """--out and the answers file: a file there that is not deca-eval's results or answers (a model's
    config.json, a questions file) is refused before any model is loaded, and left as it was; its
    own from an earlier evaluation, or an empty file, is replaced (the model is then loaded)."""
    from deca_ds import models
    from deca_ds.runtime import evaluate

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models, "load_model", no_model)
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"question_id": 1, "turns": ["hi"]}\n')
    config = tmp_path / "model" / "config.json"
    config.parent.mkdir()
    config.write_text('{"model_type": "llama"}')
    build_word_tokenizer(SyntheticTask().vocabulary()).save_pretrained(config.parent)  # read before the model
    refused = [(["--dataset", "synthetic", "--out", str(config)], f"--out {config} holds a file that is not "
                "deca-eval's results: it is left as it is"),
               (["--dataset", "synthetic", "--out", str(tmp_path)], f"--out {tmp_path} is a directory"),
               (["--questions", str(questions), "--out", str(tmp_path / "e.json"), "--answers", str(questions)],
                f"--answers {questions} holds a file that is not deca-eval's answers")]
    for argv, message in refused:
        with pytest.raises(SystemExit) as code:
            evaluate.main(["--model", str(tmp_path / "model"), *argv])
        assert code.value.code == 1 and message in capsys.readouterr().err
    assert config.read_text() == '{"model_type": "llama"}'
    assert questions.read_text() == '{"question_id": 1, "turns": ["hi"]}\n'
    earlier = tmp_path / "e.json"
    earlier.write_text(json.dumps({"model": "m", "working_dtype": "fp32", "classification": {}}))
    (tmp_path / "e.answers.jsonl").write_text(json.dumps({"question_id": 1, "turns": ["hi"], "answers": ["x"]}))
    (tmp_path / "empty.json").write_text("")
    for argv in (["--dataset", "synthetic", "--out", str(earlier)],
                 ["--questions", str(questions), "--out", str(earlier)],
                 ["--dataset", "synthetic", "--out", str(tmp_path / "empty.json")]):
        with pytest.raises(AssertionError, match="a model was loaded"):
            evaluate.main(["--model", str(tmp_path / "model"), *argv])


def test_deca_eval_refuses_examples_longer_than_the_models_context(tmp_path, monkeypatch, capsys):
    """From the model's config, before its weights load (minutes for an 8B model): an export's, and
    a checkpoint's run's model (the built-in tiny Llama's)."""
    from deca_ds import models
    from deca_ds.runtime import evaluate

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models, "load_model", no_model)
    monkeypatch.setattr(models, "tiny_llama", no_model)
    models.tiny_config(64).save_pretrained(tmp_path / "m")  # 128 positions
    build_word_tokenizer(SyntheticTask().vocabulary()).save_pretrained(tmp_path / "m")
    run = tmp_path / "run"
    run.mkdir()
    (run / "run_config.json").write_text(json.dumps({"options": {"model": "tiny", "dataset": "synthetic"}}))
    for argv in (["--model", str(tmp_path / "m"), "--dataset", "synthetic"], ["--run", str(run), "--checkpoint", "1"]):
        with pytest.raises(SystemExit) as code:
            evaluate.main([*argv, "--max-seq-len", "129", "--out", str(tmp_path / "e.json")])
        assert code.value.code == 1 and "--max-seq-len 129 is longer than the model's context (max_position_" \
            "embeddings 128): give --max-seq-len 128 or less" in capsys.readouterr().err
        assert not (tmp_path / "e.json").exists()


def test_deca_eval_of_a_generation_task_asks_for_questions_before_loading(tmp_path, monkeypatch, capsys):
    from deca_ds import models
    from deca_ds.runtime import evaluate

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models, "load_model", no_model)
    for data in (["--dataset", "alpaca"], ["--dataset", "files", "--data-files", "train=a.jsonl",
                                          "--response-column", "output"]):
        with pytest.raises(SystemExit) as code:
            evaluate.main(["--model", str(tmp_path / "m"), *data, "--out", str(tmp_path / "e.json")])
        assert code.value.code == 1 and "a generation task; deca-eval scores its model's answers to --questions" \
            in capsys.readouterr().err


def test_deca_eval_takes_the_runs_data_options_and_the_command_line_wins(tmp_path):
    """--run: deca-train's data options, working dtype and attention from run_config.json, converted
    and checked as a run file's; the command line over them; the whole test split unless told; never
    the run's trust_remote_code."""
    from deca_ds.runtime import evaluate

    run = tmp_path / "run"
    (run / "consensus").mkdir(parents=True)
    saved = {"dataset": "files", "data_files": ["train=a.jsonl", "test=b.jsonl"], "max_seq_len": 48,
             "label_names": ["no", "yes"], "seed": 3, "eval_limit": 100, "trust_remote_code": True, "lr": 1e-3,
             "working_dtype": "bf16"}
    (run / "run_config.json").write_text(json.dumps({"options": saved, "attn_implementation": "eager"}))

    def resolve(*argv):
        return evaluate.resolve(evaluate.build_parser().parse_args([*argv, "--out", "e.json"]))

    model, dtype, opts, attention = resolve("--run", str(run))
    assert (model, dtype, attention) == (str(run / "consensus"), "bf16", "eager")
    assert (opts.dataset, opts.data_files, opts.max_seq_len, opts.label_names, opts.seed) == (
        "files", ["train=a.jsonl", "test=b.jsonl"], 48, ["no", "yes"], 3)
    assert opts.eval_limit == 0 and opts.trust_remote_code is False
    model, dtype, opts, attention = resolve("--run", str(run), "--model", "other", "--max-seq-len", "16",
                                            "--eval-limit", "8", "--working-dtype", "fp32")
    assert (model, dtype, attention, opts.model, opts.max_seq_len, opts.eval_limit, opts.seed) == (
        "other", "fp32", None, "other", 16, 8, 3)  # another model: its own (the default) attention
    # no task named: generation only, in the device's dtype
    assert resolve("--model", "m", "--questions", "q.jsonl") == ("m", None, None, None)
    assert resolve("--model", "m", "--dataset", "synthetic")[2].max_seq_len == 64  # deca-train's default

    for problem, message in (({"max_seq_len": "long"}, r"run_config.json: max_seq_len: expected an integer"),
                             ({"dataset": "files", "data_files": None}, "--dataset files needs --data-files")):
        (run / "run_config.json").write_text(json.dumps({"options": {**saved, **problem}}))
        with pytest.raises(ValueError, match=message):
            resolve("--run", str(run))
    # a synthetic run saved with data options it did not read (before they were refused): left out
    (run / "run_config.json").write_text(json.dumps({"options": {**saved, "dataset": "synthetic"}}))
    _, _, opts, attention = resolve("--run", str(run))
    assert (opts.dataset, opts.data_files, opts.label_names, opts.max_seq_len) == ("synthetic", None, None, 48)
    assert attention is None  # a run that recorded none: transformers' default
    (run / "consensus").rmdir()
    with pytest.raises(ValueError, match=r"exported no consensus/ \(run with --no-export, stopped by --time-limit, "
                                         r"or not finished\): give --model"):
        resolve("--run", str(run))
    (run / "checkpoints" / "step_00000004").mkdir(parents=True)  # stopped by its --time-limit, say
    with pytest.raises(ValueError, match=r"not finished\): --checkpoint latest scores x̄ of its newest checkpoint, "
                                         r"or give --model"):
        resolve("--run", str(run))
    with pytest.raises(ValueError, match="no run_config.json there"):
        resolve("--run", str(tmp_path))
    with pytest.raises(ValueError, match="give --model .* or --run"):
        resolve("--dataset", "synthetic")
    # --checkpoint: x̄ of the run's checkpoints, its test set encoded by the run's model's tokenizer
    (run / "run_config.json").write_text(json.dumps({"options": {**saved, "model": "base"}}))
    model, _, opts, _ = resolve("--run", str(run), "--checkpoint", "latest")
    assert (model, opts.model) == (str(run / "checkpoints"), "base")
    with pytest.raises(ValueError, match="give --model or --checkpoint, not both"):
        resolve("--run", str(run), "--checkpoint", "3", "--model", "m")
    with pytest.raises(ValueError, match="--checkpoint takes the checkpoints of a run: give --run"):
        resolve("--model", "m", "--checkpoint", "3")
    with pytest.raises(ValueError, match="--client N takes client N's model of a checkpoint"):
        resolve("--run", str(run), "--client", "1")
    for bad in ("0", "last"):
        with pytest.raises(SystemExit):
            resolve("--run", str(run), "--checkpoint", bad)
