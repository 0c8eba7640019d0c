"""A seeded fuzzer over chat templates that come with a model file: random Jinja compositions
(loops in loops, big and negative ranges, string and list repetition, doubling with `~` and
`+`, recursive macros, `join`/`list`/`batch`/`map` and the other filters, padding widths,
big integers, the sandbox's internals, huge literals, syntax errors) written into a tiny model's
`tokenizer.chat_template`.

Each is loaded as the model's template (`graftlm.load`: a template that runs past its limits
on a short chat refuses the model with a ModelFileError) and, when it loads, served over
/apply-template and /v1/chat/completions by a running server whose prompter is the loaded
model's (one server for all cases: the model files differ only in their template). Every
outcome is a refusal at load or an answer below 500 with a message; none takes long, none
quotes Python internals, and /health answers within a second throughout. More cases:
FUZZ_CASES=2000 (FUZZ_SEED=n)."""

from __future__ import annotations

import random
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from fuzz_helpers import SEED, HealthPoller, cases, clean, clean_message, memory_fence
from server_fixtures import SPEC, serving

import graftlm
from graftlm.errors import GraftError
from graftlm.server.app import build_state
from graftlm.server.state import ServerConfig, ServerState
from graftlm.tokenizer import chat as chat_module
from graftlm.tokenizer.templates import CHATML

N = cases(40)
WALL = 20.0  # seconds one case may take, load or request (the renderer's own clock: 2 s)

NUMBERS = [0, 1, 3, -1, -(10**9), 1000, 100_000, 10**6, 10**9, 1_500_000_000, 10**12, 2**63,
           10**30]  # fmt: skip
INTERNALS = [
    "''.__class__", "''.__class__.__mro__", "().__class__.__base__.__subclasses__()",
    "cycler.__init__.__globals__", "joiner.__init__.__globals__", "namespace.__init__",
    "lipsum.__globals__", "self", "self._TemplateReference__context", "range.__self__",
    "messages.__class__", "raise_exception.__globals__", "'{0.__class__}'.format(1)",
    "'{0.__globals__}'.format(raise_exception)", "loop", "cycler(1, 2).__class__",
    "joiner().__call__", "namespace(a=1).__dict__", "messages[0].__class__.__init__",
    "strftime_now.__globals__['os']", "(1).__class__.__subclasses__",
]  # fmt: skip
FILTERS = [
    "join", "join(E)", "list", "batch(N)", "batch(N, E)", "map('upper')", "map('string')",
    "string", "length", "sum", "sum(start=[])", "center(N)", "indent(N)", "format(E)",
    "replace('x', E)", "replace('', E)", "tojson", "tojson(indent=N)", "unique", "sort",
    "reverse", "first", "last", "int", "float", "wordwrap(N)", "truncate(N)", "slice(N)",
    "slice(N, E)", "attr('__class__')", "selectattr('role')", "map(attribute='__class__')",
    "items", "dictsort", "pprint", "e", "trim", "round(N)", "abs", "striptags", "urlize",
    "title", "wordcount", "xmlattr", "default(E)", "random", "min", "max", "groupby('role')",
]  # fmt: skip
METHODS = [
    "ljust(N)", "rjust(N)", "center(N)", "zfill(N)", "join(E)", "replace(E, E)",
    "replace('x', E)", "format(E)", "format(E, E)", "split(E)", "upper()", "expandtabs(N)",
    "strip()", "startswith(E)", "count(E)", "encode()", "splitlines()", "__len__()",
    "__class__", "items()", "keys()", "__getitem__(N)",
]  # fmt: skip
SNIPPETS = [  # whole statements, hostile by construction
    "{% for a in range(N) %}{% for b in range(N) %}x{% endfor %}{% endfor %}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "{% macro f(n) %}{{ f(n) ~ f(n) }}{% endmacro %}{{ f(1) }}",
    "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}x{% endmacro %}"
    "{{ f(N) }}",
    "{% set ns = namespace(s='xy') %}{% for i in range(N) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s|length }}",
    "{% set ns = namespace(s='xy') %}{% for i in range(N) %}{% set ns.s = ns.s + ns.s %}"
    "{% endfor %}{{ ns.s }}",
    "{% set ns = namespace(l=[1]) %}{% for i in range(N) %}{% set ns.l = ns.l + ns.l %}"
    "{% endfor %}{{ ns.l|length }}",
    "{% set ns = namespace(v=3) %}{% for i in range(N) %}{% set ns.v = ns.v * ns.v %}"
    "{% endfor %}{{ ns.v > 0 }}",
    "{% set ns = namespace(v=E) %}{% for i in range(N) %}{% set ns.v = ns.v|replace('x', "
    "'xx') %}{% endfor %}",
    "{% for i in range(N) %}{% if loop.index > 3 %}{% break %}{% endif %}{{ i }}{% endfor %}",
    "{% for m in messages %}{{ m.role }}: {{ m.content }}{% endfor %}",
    "{% filter upper %}S{% endfilter %}",
    "{% set x = E %}{{ x ~ x ~ x }}",
    "{{ raise_exception(E) }}",
    "{{ 'x' * N }}", "{{ ['x' * 1000000] * N }}", "{{ (['x' * 1000000] * N)|map('upper')|list }}",
    "{{ range(N)|join('x' * 1000000) }}", "{{ '%0Nd' % 1 }}", "{{ '{:>N}'.format(1) }}",
    "{{ '{0:{1}}'.format('x', N) }}", "{{ ((10**64)**64)**64 }}", "{{ [[1]]|tojson(indent=N) }}",
    "{{ ([[1]*1000000]*N)|sum(start=[])|length }}", "{{ ('x'*1000000)|replace('x', 'y'*N) }}",
    "{{ lipsum(N) }}", "{{ cycler(*range(N)).next() }}", "{{ namespace(**{'a': E}) }}",
]  # fmt: skip
SYNTAX_ERRORS = ["{% for %}", "{{ ", "{% endfor %}", "{% if %}", "}}", "{% set %}", "{{ ) }}",
                 "{% macro %}", "{{ 'x' |}}", "{% raw %}"]  # fmt: skip


class Gen:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def num(self) -> str:
        return str(self.rng.choice(NUMBERS))

    def fill(self, text: str, depth: int) -> str:
        """N: a number; E: an expression; S: a statement."""
        out = []
        for ch in text:
            if ch == "N" and out and not out[-1].isalpha():
                out.append(self.num())
            else:
                out.append(ch)
        text = "".join(out)
        while "(E" in text or " E" in text or "=E" in text:
            for hole in ("(E", " E", "=E"):
                text = text.replace(hole, hole[0] + self.expr(depth + 1), 1)
        return text.replace("S{%", self.stmt(depth + 1) + "{%", 1)

    def expr(self, depth: int = 0) -> str:
        r = self.rng.random()
        if depth > 3 or r < 0.3:
            return self.rng.choice(
                [
                    "'x'", "'ab'", "messages", "messages[0].content", "range(N)", "N", "[1, 2]",
                    "{'a': 1}", "bos_token", "namespace(a=1)", "joiner(',')", "cycler(1, 2)",
                    "'" + "y" * self.rng.choice([10, 1000, 100_000, 1_000_000]) + "'",
                    "10**N", "1.5e308", "-1", "add_generation_prompt", "undefined_name",
                    "strftime_now('%Y')", self.rng.choice(INTERNALS),
                ]
            ).replace("N", self.num())  # fmt: skip
        if r < 0.5:
            op = self.rng.choice(["*", "+", "~", "**", "%", "//", "*"])
            return f"({self.expr(depth + 1)} {op} {self.expr(depth + 1)})"
        if r < 0.75:
            return self.fill(f"({self.expr(depth + 1)})|{self.rng.choice(FILTERS)}", depth)
        if r < 0.9:
            return self.fill(f"({self.expr(depth + 1)}).{self.rng.choice(METHODS)}", depth)
        if r < 0.95:
            return f"({self.expr(depth + 1)})[{self.num()}:{self.num()}]"
        return f"({self.expr(depth + 1)} if {self.expr(depth + 1)} else {self.expr(depth + 1)})"

    def stmt(self, depth: int = 0) -> str:
        r = self.rng.random()
        if depth > 2 or r < 0.35:
            return "{{ " + self.expr(depth) + " }}"
        if r < 0.55:
            return self.fill(self.rng.choice(SNIPPETS), depth)
        if r < 0.7:
            body = self.stmt(depth + 1)
            return "{% for it in " + self.expr(depth) + " %}" + body + "{% endfor %}"
        if r < 0.8:
            return "{% if " + self.expr(depth) + " %}" + self.stmt(depth + 1) + "{% endif %}"
        if r < 0.9:
            return "{% set v = " + self.expr(depth) + " %}{{ v }}"
        return "{% set ns = namespace(v=1) %}{% set ns.v = " + self.expr(depth) + " %}{{ ns.v }}"

    def template(self) -> str:
        r = self.rng.random()
        body = "".join(self.stmt() for _ in range(self.rng.randint(1, 3)))
        if r < 0.25:  # a real template with something inserted
            at = self.rng.randrange(len(CHATML))
            return CHATML[:at] + body + CHATML[at:]
        if r < 0.35:  # a syntax error somewhere
            at = self.rng.randrange(len(body) + 1)
            return body[:at] + self.rng.choice(SYNTAX_ERRORS) + body[at:]
        return body


def _string(text: str) -> bytes:
    b = text.encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, value: str) -> bytes:
    return _string(key) + struct.pack("<I", 8) + _string(value)  # 8: GGUF's string type


def with_template(model: bytes, template: str) -> bytes:
    """The tiny model's bytes with `tokenizer.chat_template` added to its header, and a padding
    field so that the data keeps its 32-byte alignment."""
    entry = _kv("tokenizer.chat_template", template)
    pad = -(len(entry) + len(_kv("x.pad", ""))) % 32
    entry += _kv("x.pad", " " * pad)
    n_tensors, n_kv = struct.unpack("<QQ", model[8:24])
    return model[:8] + struct.pack("<QQ", n_tensors, n_kv + 2) + entry + model[24:]


def test_with_template_writes_a_model_that_serves(
    tiny_files: dict[str, Path], tmp_path: Path
) -> None:
    p = tmp_path / "t.gguf"
    p.write_bytes(with_template(tiny_files["model"].read_bytes(), "[{{ messages[0].content }}]"))
    model = graftlm.load(str(p), ctx_size=64)
    assert model.chat_template == "[{{ messages[0].content }}]"
    assert model.apply_chat_template([{"role": "user", "content": "hi"}]) == "[hi]"
    model.generate("hi", max_tokens=2, temperature=0)


@pytest.fixture(scope="module")
def served(tiny_files: dict[str, Path]) -> Iterator[tuple[str, ServerState]]:
    model = graftlm.load(tiny_files["model"], ctx_size=SPEC.n_ctx, n_seq=2)
    state = build_state(model, ServerConfig(model_name="tiny"), parallel=1)
    with serving(state) as url:
        yield url, state


def _timed(fn: Callable[[], object], what: object) -> object:
    t0 = time.perf_counter()
    out = fn()
    assert time.perf_counter() - t0 < WALL, (what, f"{time.perf_counter() - t0:.1f} s")
    return out


def test_fuzzed_templates_load_or_are_refused_and_serve_below_500(
    served: tuple[str, ServerState],
    tiny_files: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, state = served
    rng = random.Random(SEED)
    gen = Gen(rng)
    base = tiny_files["model"].read_bytes()
    original = state.service.prompter
    http = httpx.Client(base_url=url, timeout=WALL * 3)
    outcomes: dict[str, int] = {}
    ask = {"messages": [{"role": "user", "content": "hi"}]}
    chat = {**ask, "max_tokens": 1, "temperature": 0}
    # the renderer's clock cut to 0.5 s: a case that spins costs that, not 2 s a render (what
    # is tested is that every step stops, not the clock's value)
    monkeypatch.setattr(chat_module, "MAX_SECONDS", 0.5)
    try:
        with memory_fence(), HealthPoller(url) as health:
            for i in range(N):
                template = gen.template()
                what = (i, template[:400])
                p = tmp_path / f"t{i}.gguf"
                p.write_bytes(with_template(base, template))
                try:
                    model = _timed(lambda p=p: graftlm.load(str(p), ctx_size=64), what)
                except GraftError as exc:
                    clean_message(str(exc), what)
                    outcomes["refused at load"] = outcomes.get("refused at load", 0) + 1
                    continue
                finally:
                    p.unlink()
                assert isinstance(model, graftlm.Model)
                state.service.prompter = model.prompter  # the server now renders this template
                for path, body in (("/apply-template", ask), ("/v1/chat/completions", chat)):
                    r = _timed(lambda path=path, body=body: http.post(path, json=body), what)
                    assert isinstance(r, httpx.Response)
                    clean(r, what)
                    key = f"{path} {r.status_code}"
                    outcomes[key] = outcomes.get(key, 0) + 1
                state.service.prompter = original
        health.check()
    finally:
        state.service.prompter = original
    print(f"\n{N} templates: {dict(sorted(outcomes.items()))}")
    assert outcomes.get("refused at load", 0) > 0 and outcomes.get("/apply-template 200", 0) > 0
    assert outcomes.get("/apply-template 400", 0) > 0
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
