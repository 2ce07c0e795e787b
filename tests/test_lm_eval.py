"""lm-eval's ``local-completions`` model against ``batchspec serve``: a multiple-choice log-likelihood task and a
greedy ``generate_until`` task, both from local files, whose log-likelihoods equal the model's own forward and whose
answers equal batch-size-1 greedy decoding."""

from __future__ import annotations

import json
import socket

import servekit
import tiny
import torch

MC = [  # question, choices (some of several tokens), the right one
    ("w5 w17 w33 w8", ["w4", "w61", "w15 w53", "w12 w9"], 2),  # w15 w53: the greedy continuation
    ("w70 w3 w3 w41 w22 w19", ["w30 w31 w32", "w88"], 1),
    ("w9", ["w10", "w11", "w12", "w13"], 2),
    ("w44 w45 w46", ["w50 w51", "w52 w53 w54 w55"], 1),
]
GEN = ["w5 w17 w33 w8", "w70 w3 w3 w41", "w9 w10 w11 w12 w13 w14 w15"]
STOP = "w7"  # ends an answer at the first word that begins so (also w70..w79): a stop string inside tokens
MAX_GEN = 8

MC_TASK = """
task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""

GEN_TASK = """
task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{prompt}}}}"
generation_kwargs:
  until: ["{stop}"]
  max_gen_toks: {max_gen}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


def _tasks(tmp_path):
    """The two tasks' YAML and JSON-lines data in ``tmp_path/tasks``."""
    d = tmp_path / "tasks"
    d.mkdir()
    (d / "mc.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "label": y}) + "\n"
                                        for q, c, y in MC))
    (d / "gen.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in GEN))
    (d / "tiny_mc.yaml").write_text(MC_TASK.format(data=d / "mc.jsonl"))
    (d / "tiny_gen.yaml").write_text(GEN_TASK.format(data=d / "gen.jsonl", stop=STOP, max_gen=MAX_GEN))
    return d


def _loglikelihood(ids: list[int], n: int) -> tuple[float, bool]:
    """The log-likelihood of the last ``n`` of ``ids`` given the rest, from HF's forward of the tiny target, and
    whether each of them is the model's greedy choice."""
    with torch.no_grad():
        logits = tiny.target()(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits[-n - 1 : -1], -1)
    cont = torch.tensor(ids[-n:])
    return lp[torch.arange(n), cont].sum().item(), bool((lp.argmax(-1) == cont).all())


def _answer(tok, prompt: str) -> str:
    """HF's greedy decoding at batch size 1 of ``prompt``, as text cut before the stop string."""
    ids = tok(prompt)["input_ids"]
    text = tok.decode(tiny.oracle(tiny.target(), ids, MAX_GEN))
    return text.split(STOP)[0]


def _check(out, tok) -> None:
    """Each log-likelihood and greedy flag lm-eval received equals HF's forward; each answer HF's greedy decoding."""
    samples = {s["doc_id"]: s for s in out["samples"]["tiny_mc"]}
    assert sorted(samples) == list(range(len(MC)))
    greedy_seen = False
    for i, (question, choices, _) in enumerate(MC):
        got = [r[0] for r in samples[i]["resps"]]
        assert len(got) == len(choices)
        for (ll, greedy), choice in zip(got, choices):
            ids = tok(f"{question} {choice}")["input_ids"]
            want_ll, want_greedy = _loglikelihood(ids, len(tok(choice)["input_ids"]))
            assert abs(ll - want_ll) <= 1e-5 and greedy == want_greedy, (i, choice, ll, want_ll)
            greedy_seen |= greedy
    assert greedy_seen  # the greedy continuation among the choices: lm-eval read the alternatives right
    answers = {s["doc_id"]: s["resps"][0][0] for s in out["samples"]["tiny_gen"]}
    assert answers == {i: _answer(tok, p) for i, p in enumerate(GEN)}


def test_lm_eval_local_completions(tmp_path, monkeypatch):
    """lm-eval's tasks over ``batchspec serve``, its requests one prompt each and in batches of 4 (a list of prompts),
    as token ids and as text (lm-eval decodes its tokens; the server tokenises them back)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    connect = socket.socket.connect

    def loopback_only(sock, address):  # the server is the only place this test may reach
        assert sock.family not in (socket.AF_INET, socket.AF_INET6) or address[0] in ("127.0.0.1", "::1"), address
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", loopback_only)
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # the data sets' cache, not the user's
    model = servekit.model_dir(tmp_path)
    tasks = TaskManager(include_path=str(_tasks(tmp_path)), include_defaults=False)
    proc, url = servekit.serve_command(["--target", str(model), "--batch-size", "4", "--served-model-name", "tiny",
                                        "--log-level", "warning"])
    try:
        for batch, as_ids in ((1, True), (4, True), (4, False)):
            out = lm_eval.simple_evaluate(
                model="local-completions", tasks=["tiny_mc", "tiny_gen"], task_manager=tasks,
                model_args={"base_url": f"{url}/v1/completions", "model": "tiny", "tokenizer": str(model),
                            "tokenizer_backend": "huggingface", "tokenized_requests": as_ids, "max_retries": 1,
                            "batch_size": batch},
                log_samples=True, bootstrap_iters=0)
            assert out is not None
            _check(out, servekit.tokenizer())
    finally:
        log = servekit.stop(proc)
    assert "Traceback" not in log, log
