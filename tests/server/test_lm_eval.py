"""lm-evaluation-harness against the server, as the README runs it: `local-completions` with
`tokenizer_backend=remote` on SmolLM2, two small tasks written here (a multiple-choice one scored
by log-likelihood, a generate_until one), their data a local JSON-lines file: nothing leaves the
machine. Each answer lm-eval records is checked against graftlm's own in-process model."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

lm_eval = pytest.importorskip(
    "lm_eval", reason="lm-eval is not installed (the `test` extra pins lm-eval[api]==0.4.13)"
)

import graftlm  # noqa: E402
from graftlm.server.app import ServerThread, build_state, create_app  # noqa: E402
from graftlm.server.state import ServerConfig  # noqa: E402

pytestmark = pytest.mark.real

MC = [  # (question, choices, index of the answer): easy enough for a 135M model
    ("The capital of France is", ["Paris", "bicycle", "seven"], 0),
    ("One, two, three, four,", ["purple", "five", "Tuesday"], 1),
    ("Monday, Tuesday,", ["Wednesday", "carrot", "ninety"], 0),
    ("The opposite of hot is", ["table", "running", "cold"], 2),
]
GEN = [("The capital of France is", "Paris"), ("1, 2, 3, 4,", "5")]
UNTIL = ["\n", ".", ","]  # lm-eval adds the model's end-of-sequence text: four stops, OpenAI's most
MAX_GEN = 6

_DATASET = """\
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data}}}
  cache_dir: {cache}
test_split: test
"""  # both tasks' data: a JSON-lines file
MC_YAML = (
    "task: graftlm_mc\n"
    + _DATASET
    + """\
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""
)
GEN_YAML = (
    "task: graftlm_gen\n"
    + _DATASET
    + """\
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: {until}
  max_gen_toks: {max_gen}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    regexes_to_ignore: [" "]
"""
)


@pytest.fixture(scope="module")
def smol() -> Iterator[tuple[str, Counter[str], graftlm.Model]]:
    """The server on 127.0.0.1 (its URL), the paths it was asked for, and a reference model."""
    try:
        model = graftlm.load(None, ctx_size=1024, n_seq=2)
        ref = graftlm.load(None, ctx_size=1024, n_seq=1)
    except graftlm.ModelFileError as exc:
        pytest.skip(str(exc))
    state = build_state(model, ServerConfig(model_name="smollm2"), parallel=1)
    app = create_app(state)
    seen: Counter[str] = Counter()

    @app.middleware("http")
    async def count(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
        seen[request.url.path] += 1
        return await call_next(request)

    srv = ServerThread(app).start()
    try:
        yield srv.url, seen, ref
    finally:
        srv.stop()
        state.service.close()


def _tasks(d: Path) -> Path:
    """Both tasks' YAML and data under d; the folder lm-eval's TaskManager includes."""
    cache = d / "hf-cache"
    mc, gen = d / "mc.jsonl", d / "gen.jsonl"
    mc_rows = [{"question": q, "choices": c, "answer": a} for q, c, a in MC]
    mc.write_text("".join(json.dumps(row) + "\n" for row in mc_rows))
    gen.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GEN))
    (d / "graftlm_mc.yaml").write_text(MC_YAML.format(data=mc, cache=cache))
    (d / "graftlm_gen.yaml").write_text(
        GEN_YAML.format(data=gen, cache=cache, until=json.dumps(UNTIL), max_gen=MAX_GEN)
    )
    return d


def _loglikelihood(ref: graftlm.Model, context: str, continuation: str) -> float:
    """log p(continuation | context) as lm-eval asks for it (the whole text tokenized, the
    context's tokens cut off the front), from the model in-process."""
    whole = ref.tokenize(context + continuation, add_special=False, parse_special=True)
    n = len(ref.tokenize(context, add_special=False, parse_special=True))
    return sum(step["logprob"] for step in ref.logprobs(whole, top=0)[n - 1 :])


def test_lm_eval_local_completions_with_the_remote_tokenizer(
    smol: tuple[str, Counter[str], graftlm.Model],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The README's command in-process: lm-eval tokenizes through /tokenize (and detokenizes
    through /detokenize when it sends text), scores through /v1/completions (echo, logprobs), and
    every log-likelihood and generation it records is the in-process model's own."""
    url, seen, ref = smol
    import datasets.config
    import huggingface_hub.constants
    from lm_eval.tasks import TaskManager

    # offline as HF_HUB_OFFLINE=1 would have made it at import: any reach for the Hub raises
    for module, name in [
        (datasets.config, "HF_HUB_OFFLINE"),
        (datasets.config, "HF_DATASETS_OFFLINE"),
        (huggingface_hub.constants, "HF_HUB_OFFLINE"),
    ]:
        monkeypatch.setattr(module, name, True)

    tasks = TaskManager(include_path=str(_tasks(tmp_path)), include_defaults=False)
    model_args = (
        f"model=smollm2,base_url={url}/v1/completions,tokenizer_backend=remote,"
        "num_concurrent=1,max_retries=1,timeout=120"
    )
    run = {"model": "local-completions", "task_manager": tasks, "bootstrap_iters": 0}
    out = lm_eval.simple_evaluate(**run, model_args=model_args, tasks=["graftlm_mc", "graftlm_gen"])
    assert out is not None
    # the remote tokenizer's calls reached the server: tokenizer_info, and tokenize for each text
    assert seen["/tokenizer_info"] >= 1 and seen["/tokenize"] >= len(MC) + len(GEN), seen
    n_choices = sum(len(c) for _, c, _ in MC)
    assert seen["/v1/completions"] == n_choices + len(GEN), seen

    # multiple choice: each choice's log-likelihood is the model's, and acc follows from them
    right, mc_lls = 0, []
    samples = sorted(out["samples"]["graftlm_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(MC)
    for sample, (question, choices, answer) in zip(samples, MC, strict=True):
        got = [resp[0][0] for resp in sample["resps"]]
        want = [_loglikelihood(ref, question, " " + c) for c in choices]
        assert [tuple(a) for a in sample["arguments"]] == [(question, " " + c) for c in choices]
        assert got == pytest.approx(want, abs=1e-3), (question, got, want)
        mc_lls.append(want)
        right += max(range(len(want)), key=want.__getitem__) == answer
    acc = out["results"]["graftlm_mc"]["acc,none"]
    # each answer is the likeliest by over 12 nats: a scoring path that mixed up the tokens or
    # their offsets would guess (1/3)
    assert acc == right / len(MC) == 1.0, (acc, right)

    # generate_until: the greedy text up to the first stop, the model's own
    samples = sorted(out["samples"]["graftlm_gen"], key=lambda s: s["doc_id"])
    assert len(samples) == len(GEN)
    for sample, (question, _) in zip(samples, GEN, strict=True):
        ids = ref.tokenize(question, add_special=False, parse_special=True)
        want = ref.generate(ids, max_tokens=MAX_GEN, temperature=0.0, stop=UNTIL)
        assert sample["resps"][0][0] == want, (question, sample["resps"], want)
    assert out["results"]["graftlm_gen"]["exact_match,none"] == 1.0  # " Paris", " 5"

    # tokenized_requests=False: lm-eval turns its tokens back into text through /detokenize
    # (vLLM's `prompt` field) and sends the text; the log-likelihoods are the same
    seen.clear()
    text = lm_eval.simple_evaluate(
        **run, model_args=model_args + ",tokenized_requests=False", tasks=["graftlm_mc"], limit=1
    )
    assert text is not None
    (sample,) = text["samples"]["graftlm_mc"]
    got = [resp[0][0] for resp in sample["resps"]]
    assert got == pytest.approx(mc_lls[0], abs=1e-3), (got, mc_lls[0])
    assert seen["/detokenize"] == len(MC[0][1]), seen
