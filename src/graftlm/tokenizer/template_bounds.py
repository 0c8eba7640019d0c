"""Bounds on what one step of a chat template may make, checked before the step runs.

The renderer's clock stops a template between steps; it cannot stop a single step that runs in
C: `'x'.ljust(10**10)`, `range(100000)|join('x' * 1000000)` (10^11 characters), printing a list
of a million references to one long string, `sum` over shared lists, a padding width in a
format string, the product of two huge integers. Each such step is checked against the size its
result would have (`text_size`: characters of a value's text, counted only as far as the
bound), and a template that grows memory step by step is stopped by `MemoryWatch`."""

from __future__ import annotations

import functools
import re
import string
from collections.abc import Callable, Iterable
from typing import Any

from jinja2.utils import Namespace

MAX_BITS = 1 << 16  # bits of an integer a template may make with `*` or `**`
MAX_MEMORY = 512 << 20  # bytes a render may add to the process while it runs
_PAGE = 4096


class Bounded(Exception):
    """A step would pass its bound: the message says which (the renderer makes it a
    TemplateLimitError)."""


def text_size(value: Any, budget: int) -> int:
    """About how many characters `str(value)` has, counted only until past `budget` (a list
    of a million references to a long string is a terabyte of text, held in 8 MB)."""
    total = 0
    stack = [value]
    while stack and total <= budget:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v) + 2  # (the quotes of a repr)
        elif isinstance(v, (list, tuple, set, frozenset, dict)):
            total += 2 + 2 * len(v)
            if total <= budget:
                stack.extend(v.items() if isinstance(v, dict) else v)
        elif isinstance(v, Namespace):
            stack.append(object.__getattribute__(v, "_Namespace__attrs"))
            total += 12
        elif isinstance(v, int):
            total += v.bit_length() // 3 + 1
        else:
            total += 16
    return total


def check_text(value: Any, budget: int, what: str) -> None:
    if not isinstance(value, str) and text_size(value, budget) > budget:
        raise Bounded(f"{what} would make a text of more than {budget} characters")


def check_width(width: Any, budget: int, what: str, noun: str = "a width") -> None:
    if isinstance(width, int) and width > budget:
        raise Bounded(f"{what}: {noun} of {width}, past {budget}")


def check_ints(op: str, left: Any, right: Any) -> None:
    """`*` and `**` of integers bounded to MAX_BITS bits (a product of two million-bit
    numbers is seconds in C, uninterruptible)."""
    if not (isinstance(left, int) and isinstance(right, int)):
        return
    if op == "*":
        bits = left.bit_length() + right.bit_length()
    elif abs(left) > 1 and right > 0:
        bits = left.bit_length() * right
    else:
        return
    if bits > MAX_BITS:
        raise Bounded(f"an integer of about {bits} bits, past {MAX_BITS}")


def _replaced_size(s: str, old: Any, new: Any, count: Any, budget: int) -> None:
    if not (isinstance(old, str) and isinstance(new, str)) or len(new) <= len(old):
        return
    n = len(s) + 1 if old == "" else s.count(old)
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    size = len(s) + n * (len(new) - len(old))
    if size > max(budget, len(s)):
        raise Bounded(f"replace would make a text of {size} characters, past {budget}")


def _joined(items: Iterable[Any], sep: Any, budget: int) -> list[Any]:
    items = list(items)
    size = text_size(items, budget) + len(str(sep)) * max(len(items) - 1, 0)
    if size > budget:
        raise Bounded(f"join would make a text of more than {budget} characters")
    return items


_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def check_printf(fmt: str, args: Any, budget: int) -> None:
    """`fmt % args`: every width and precision, and the arguments' text, within budget."""
    specs = _PRINTF.findall(fmt)
    values = list(args.values()) if isinstance(args, dict) else (
        list(args) if isinstance(args, tuple) else [args])  # fmt: skip
    size = len(fmt) + len(specs) * max((text_size(v, budget) for v in values), default=0)
    for width, precision in specs:
        for n in (width, precision):
            if n == "*":
                size += max((v for v in values if isinstance(v, int)), default=0)
            elif n:
                size += int(n)
    if size > budget:
        raise Bounded(f"a %-format would make a text of more than {budget} characters")


def check_format(fmt: str, args: tuple[Any, ...], kwargs: dict[str, Any], budget: int) -> None:
    """`fmt.format(*args, **kwargs)`: each field's argument and width counted."""
    size, auto = 0, 0
    nested = [v for v in (*args, *kwargs.values()) if isinstance(v, int)]
    todo = [fmt]
    while todo:
        for literal, name, spec, _ in string.Formatter().parse(todo.pop()):
            size += len(literal)
            if name is None:
                continue
            key = re.split(r"[.\[]", name, maxsplit=1)[0]
            if key == "":
                key, auto = str(auto), auto + 1
            value = args[int(key)] if key.isdigit() and int(key) < len(args) else kwargs.get(key)
            size += text_size(value, budget)
            for n in re.findall(r"\d+", spec or ""):
                size += int(n)
            if spec and "{" in spec:
                size += max(nested, default=0)
                todo.append(spec)
            if size > budget:
                raise Bounded(f"a format would make a text of more than {budget} characters")


# the filters that write their value as text
_TEXT_FILTERS = ("string", "pprint", "e", "escape", "forceescape", "safe", "trim", "upper",
                 "lower", "title", "capitalize", "center", "indent", "format", "replace",
                 "striptags", "truncate", "wordwrap", "wordcount", "urlize", "urlencode",
                 "tojson", "xmlattr")  # fmt: skip


def _filter_check(name: str, budget: Callable[[], int]) -> Callable[..., Any]:
    def check(value: Any, *args: Any, **kwargs: Any) -> Any:
        limit = budget()
        if name in _TEXT_FILTERS:
            check_text(value, limit, f"|{name}")
        if name == "center":
            check_width(args[0] if args else kwargs.get("width"), limit, "|center")
        elif name == "indent":
            width = args[0] if args else kwargs.get("width", 4)
            lines = str(value).count("\n") + 1
            size = (len(width) if isinstance(width, str) else width) * lines
            check_width(size, limit, "|indent", "a text")
        elif name in ("batch", "slice"):
            count = args[0] if args else kwargs.get("linecount", kwargs.get("slices"))
            check_width(count, limit, f"|{name}", "a count")
        elif name == "format":
            check_printf(str(value), kwargs or args, limit)
        elif name == "replace":
            old, new, count = (list(args) + [kwargs.get("old"), kwargs.get("new"), None])[:3]
            _replaced_size(
                str(value), old, new, count if count is not None else kwargs.get("count"), limit
            )
        elif name == "join":
            sep = args[0] if args else kwargs.get("d", "")
            return _joined(value, sep, limit)
        elif name == "sum":
            start = args[1] if len(args) > 1 else kwargs.get("start", 0)
            if isinstance(start, (str, list, tuple)):
                items = list(value)
                size = len(start) + sum(len(x) if hasattr(x, "__len__") else 1 for x in items)
                check_width(size, limit, "|sum", "a size")
                return items
        elif name == "tojson":
            indent = args[1] if len(args) > 1 else kwargs.get("indent")
            check_width(len(indent) if isinstance(indent, str) else indent, 64, "|tojson indent")
        elif name == "wordwrap":
            wrap = kwargs.get("wrapstring") or (args[2] if len(args) > 2 else None)
            width = args[0] if args else kwargs.get("width", 79)
            if isinstance(wrap, str) and isinstance(width, int):
                lines = len(str(value)) // max(width, 1) + 1
                check_width(len(wrap) * lines, limit, "|wordwrap")
        return value

    return check


def bounded_filters(filters: dict[str, Callable[..., Any]], budget: Callable[[], int]) -> None:
    """Wrap the environment's filters with the checks above (their value's text, their widths
    and counts), in place; `budget()` is the render's bound on a text."""
    for name, inner in list(filters.items()):
        filters[name] = _wrap(inner, _filter_check(name, budget))


def _wrap(inner: Callable[..., Any], check: Callable[..., Any]) -> Callable[..., Any]:
    from jinja2.utils import _PassArg

    skip = 1 if _PassArg.from_obj(inner) is not None else 0  # the context Jinja passes first

    @functools.wraps(inner)  # (keeps Jinja's pass_context marks)
    def run(*args: Any, **kwargs: Any) -> Any:
        if len(args) > skip:
            args = (*args[:skip], check(*args[skip:], **kwargs), *args[skip + 1 :])
        return inner(*args, **kwargs)

    return run


def check_call(obj: Any, args: tuple[Any, ...], budget: int) -> None:
    """A method of a string called from a template: its widths and the size it would make."""
    owner = getattr(obj, "__self__", None)
    if not isinstance(owner, str):
        return
    name = getattr(obj, "__name__", "")
    if name in ("ljust", "rjust", "center", "zfill") and args:
        check_width(args[0], budget, f".{name}")
    elif name == "expandtabs":
        size = args[0] * owner.count("\t") if args and isinstance(args[0], int) else 0
        check_width(size, budget, ".expandtabs", "a text")
    elif name == "join" and args:
        _joined(args[0], owner, budget)
    elif name == "replace" and len(args) >= 2:
        _replaced_size(owner, args[0], args[1], args[2] if len(args) > 2 else None, budget)


class MemoryWatch:
    """The process's resident memory, read every few milliseconds of a render: a template that
    builds a big value step by step (each step within its bounds) is stopped at MAX_MEMORY
    more than when it started. (Resident memory is the process's, so another request's growth
    in the same milliseconds counts too; MAX_MEMORY is far above what a render needs.)"""

    def __init__(self) -> None:
        self.start = self.resident()

    @staticmethod
    def resident() -> int:
        try:
            with open("/proc/self/statm", "rb") as f:
                return int(f.read().split()[1]) * _PAGE
        except (OSError, ValueError, IndexError):
            return 0  # (no /proc: the clock alone)

    def check(self) -> None:
        if self.start and self.resident() - self.start > MAX_MEMORY:
            raise Bounded(f"the render took more than {MAX_MEMORY >> 20} MiB of memory")
