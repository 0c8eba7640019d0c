"""Findings of the template fuzzer (tests/server/test_server_fuzz_templates.py), each a step
the renderer's clock could not stop because it runs in C, or an error that escaped as Python's
own: every one is now a ChatTemplateError (a refusal at load, a 400 in the server) found before
the step runs, in milliseconds and without the memory."""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator

import pytest

from graftlm.tokenizer.chat import ChatTemplateError, TemplateLimitError, render_chat

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(autouse=True)
def _fenced() -> Iterator[None]:
    """Each case bounded to 2 GiB more data than the process holds: a bound that fails is a
    MemoryError here, not a machine out of memory."""
    with open("/proc/self/status") as f:
        data = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (data + (2 << 30), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


@pytest.mark.parametrize(
    ("template", "words"),
    [
        ("{{ 'x'.ljust(1500000000) }}", ".ljust: a width of 1500000000"),
        ("{{ 'x'|center(1500000000) }}", "|center: a width"),
        ("{{ '%01500000000d' % 1 }}", "a %-format"),
        ("{{ '{:>1500000000}'.format(1) }}", "a format"),
        ("{{ '{0:{1}}'.format('x', 1500000000) }}", "a format"),
        ("{{ '%1500000000s'|format(1) }}", "a %-format"),
        ("{{ range(100000)|join('x' * 1000000) }}", "join"),
        ("{{ ['x' * 1000000] * 1000000 }}", "{{ value }}"),
        ("{{ ['x' * 1000000] * 1000000 ~ '' }}", "~"),
        ("{{ ('x' * 1000000)|replace('x', 'y' * 1000) }}", "replace"),
        ("{{ ('x' * 1000000).replace('x', 'y' * 1000) }}", "replace"),
        ("{{ [[1]]|tojson(indent=100000000) }}", "|tojson indent"),
        ("{{ ([[1] * 1000000] * 1000)|sum(start=[])|length }}", "|sum"),
        ("{{ ([1] * 1000000)|batch(1000000000, 0)|list|length }}", "|batch"),
        ("{{ 'a\tb'.expandtabs(1000000000) }}", ".expandtabs"),
        ("{{ 'a'|indent(1000000000) }}", "|indent"),
        ("{{ ((10**64)**64)**64 }}", "bits"),
        (
            "{% set ns = namespace(v=3) %}{% for i in range(40) %}{% set ns.v = ns.v * ns.v %}"
            "{% endfor %}{{ ns.v > 0 }}",
            "bits",
        ),  # fmt: skip
        ("{{ (['x' * 1000000] * 1000000)|map('upper')|list|length }}", "MiB of memory"),
    ],
)
def test_a_step_past_its_bound_is_refused_before_it_runs(template: str, words: str) -> None:
    # (the CPU time of all the process's threads, torch's and the native kernels' too: the
    # pauses of a loaded machine do not count)
    t0 = time.process_time()
    with pytest.raises(TemplateLimitError) as info:
        render_chat(template, CHAT)
    # (on a loaded machine the clock may stop a step-by-step growth before the memory does)
    assert words in str(info.value) or "MiB" in words and "ran past" in str(info.value)
    assert time.process_time() - t0 < 10


def test_what_a_filter_raises_is_a_template_error_without_python_internals() -> None:
    """`|dictsort` on a number raised AttributeError out of the renderer: at load it escaped
    `graftlm.load` as no GraftError, in the server a 500."""
    with pytest.raises(ChatTemplateError) as info:
        render_chat("{{ 1.5|dictsort }}", CHAT)
    assert "AttributeError" in str(info.value)
    assert "object has no attribute" not in str(info.value)


def test_templates_within_the_bounds_render_as_before() -> None:
    template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content|trim }}{% endfor %}"
        "{{ '%s-%d' % ('a', 3) }}{{ '{}:{:>5}'.format('a', 'b') }}{{ messages|tojson(indent=2) }}"
        "{{ ['a', 'b']|join(', ') }}{{ 'a\nb'|indent(4) }}{{ [[1], [2]]|sum(start=[]) }}"
        "{{ 'abc'.replace('b', 'xx') }}{{ 'x'|center(5) }}{{ 2**10 }}{{ 'x'.ljust(3) }}"
        "{{ messages[0]|string }}{{ 'ab'|wordwrap(1, wrapstring='|') }}"
    )
    assert render_chat(template, CHAT) == (
        'user: hia-3a:    b[\n  {\n    "role": "user",\n    "content": "hi"\n  }\n]a, ba\n'
        "    b[1, 2]axxc  x  1024x  {'role': 'user', 'content': 'hi'}a|b"
    )


def test_raise_exception_with_an_object_shows_no_address() -> None:
    """Found by the template fuzzer: `raise_exception(cycler(1, 2))` answered 400 with
    `<jinja2.utils.Cycler object at 0x7f...>`."""
    with pytest.raises(ChatTemplateError) as info:
        render_chat("{{ raise_exception(cycler(1, 2)) }}", CHAT)
    assert "0x" not in str(info.value) and "Cycler" in str(info.value)
    with pytest.raises(ChatTemplateError, match="^no tools here$"):
        render_chat("{{ raise_exception('no tools here') }}", CHAT)
