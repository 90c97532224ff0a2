"""Bounds on one chat-template render: its time, the size of any value it builds, and the total.

A chat template comes from the checkpoint and is untrusted code. Jinja's sandbox keeps it away
from Python's internals, but not from looping for minutes or building gigabyte strings (its one
bound is range()'s 100000 items; transformers adds none). So templates compile in
`bounded_environment`, which spends from a `RenderBudget` set for each render:

- time: every for-loop iteration (the code generator routes each loop's iterable through a
  filter), call, macro call, operator (+ * ** %), `~` join, filter and `{{ }}` output checks
  the deadline, so a runaway template stops within one step of it;
- size: what can turn a small input into a large value ('x' * 10**9, 2 ** 10**9, join, center,
  format widths, replace, printing a list of a million references to one long string) is
  estimated before it is built and refused over `max_chars` characters (or list items), so the
  memory is never allocated; integers are held to MAX_INT_BITS;
- total: every value built is charged against WORK_FACTOR x `max_chars`, and the prompt itself
  may not exceed `max_chars`.

Errors are TierlmError naming the bound. Nothing is shared between renders: the budget in use
is kept per thread on the environment.
"""

from __future__ import annotations

import json
import math
import re
import string
import threading
import time
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from typing import Any

from jinja2 import nodes, pass_context
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

from tierlm.errors import TierlmError

DEFAULT_SECONDS = 2.0
# Characters in one rendered prompt (and in any one value a template builds); the largest
# contexts (1M tokens, ~4 characters each) fit. ChatTemplate raises it for larger conversations.
DEFAULT_MAX_CHARS = 4 << 20
WORK_FACTOR = 16  # all values built, as a multiple of max_chars: templates copy messages a few times
MAX_INT_BITS = 1 << 14  # ~4900 decimal digits; a prompt needs no larger number
LOOP_FILTER = "tierlm_loop_budget"
CONCAT_FILTER = "tierlm_concat_budget"
_HINT = "the model's chat template is broken or hostile; fix chat_template (tokenizer_config.json or chat_template.jinja)"
# printf conversions: (width, precision), each digits or "*".
_PRINTF = re.compile(r"%(?:\([^)]*\))?[#0 +-]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")
# Filters that turn their input into text (str(value)), so a large container becomes large text.
_STRINGIFYING = frozenset({
    "string", "pprint", "e", "escape", "forceescape", "safe", "upper", "lower", "title", "capitalize",
    "trim", "striptags", "urlize", "wordcount", "center", "indent", "wordwrap", "truncate", "replace",
    "format", "urlencode",
})  # fmt: skip


class RenderBudget:
    """What one render may spend: `seconds` of time and `max_chars` characters per value and output."""

    def __init__(self, seconds: float = DEFAULT_SECONDS, max_chars: int = DEFAULT_MAX_CHARS):
        self.seconds = seconds
        self.max_chars = max_chars
        self._deadline = time.monotonic() + seconds
        self._work_left = WORK_FACTOR * max_chars

    def tick(self) -> None:
        """One step of template work: past the deadline, the render stops."""
        if time.monotonic() > self._deadline:
            raise TierlmError(f"the chat template ran for more than {self.seconds:g} s and was stopped", _HINT)

    def allow(self, size: int | float, what: str) -> None:
        """Refuse to build `what` of `size` characters (or items) over the limit, before it is built."""
        if size > self.max_chars:
            shown = f"{size:,}" if size < 1e15 else f"{size:.3g}"
            raise TierlmError(
                f"the chat template tried to build {what} of {shown} characters or items, over the "
                f"limit of {self.max_chars:,}", _HINT)

    def charge(self, value: Any) -> Any:
        """Count a value just built against the total; returns it."""
        self.tick()
        if isinstance(value, (str, list, tuple, dict)):
            self.allow(len(value), "a value")
            self._work_left -= len(value)
            if self._work_left < 0:
                raise TierlmError(f"the chat template built more than {WORK_FACTOR * self.max_chars:,} "
                                  "characters of text in all", _HINT)
        return value

    def collect(self, chunks: Iterable[str]) -> str:
        """The rendered prompt from a template's output chunks, refused once over `max_chars`."""
        out, size = [], 0
        for chunk in chunks:
            size += len(chunk)
            self.allow(size, "a prompt")
            out.append(chunk)
        return "".join(out)


def text_size(value: Any, limit: float = math.inf) -> int:
    """About how many characters str(value) has (containers as their repr), counted only until
    the count passes `limit`, so a list of a million references costs little to measure."""
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        total += 2  # quotes, brackets, separators
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, bool) or item is None:
            total += 3
        elif isinstance(item, int):
            total += item.bit_length() // 3 + 1  # decimal digits <= bits * 0.302
        elif isinstance(item, float):
            total += 22
        elif isinstance(item, Mapping):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        elif isinstance(item, Namespace):
            stack.append(dict(item._Namespace__attrs))  # noqa: SLF001 - its repr prints these
        else:
            total += 64
    return total


def printf_size(fmt: str, args: Any, limit: float) -> float:
    """A bound on len(fmt % args): the format, the values as text, and every width and precision."""
    values = list(args.values()) if isinstance(args, Mapping) else list(args) if isinstance(args, tuple) else [args]
    size = len(fmt) + sum(text_size(v, limit) for v in values)
    widest = max((v for v in values if isinstance(v, int)), default=0)
    for width, precision in _PRINTF.findall(fmt):
        size += sum(widest if part == "*" else _digits_value(part) for part in (width, precision) if part)
    return size


def format_size(fmt: str, args: tuple, kwargs: Mapping[str, Any], limit: float) -> float:
    """A bound on len(fmt.format(*args, **kwargs)), widths in format specs included."""
    values = [*args, *kwargs.values()]
    size = len(fmt) + sum(text_size(v, limit) for v in values)
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return size  # str.format will refuse it too
    widest = max((v for v in values if isinstance(v, int)), default=0)
    for _, _, spec, _ in fields:
        if spec:
            size += sum(_digits_value(n) for n in re.findall(r"\d+", spec)) + (widest if "{" in spec else 0)
    return size


def replace_size(text: str, old: Any, new: Any, count: Any = -1) -> float:
    """A bound on len(text.replace(old, new, count))."""
    old, new = str(old), str(new)
    hits = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * max(len(new) - len(old), 0)


def join_size(separator: str, items: list, limit: float) -> float:
    """A bound on len(separator.join(map(str, items))), counted until it passes `limit`."""
    size = len(separator) * max(len(items) - 1, 0)
    for item in items:
        if size > limit:
            break
        size += len(item) if isinstance(item, str) else text_size(item, limit)
    return size


def _digits_value(digits: str) -> float:
    """A width written in a format string; absurdly long ones count as infinite (int() would refuse)."""
    return int(digits) if len(digits) < 12 else math.inf


def bounded_environment(filters: Mapping[str, Any], globals: Mapping[str, Any], **options) -> "BoundedEnvironment":
    """An ImmutableSandboxedEnvironment (with `options`, and `filters`/`globals` added) whose
    templates spend from the RenderBudget that `env.spending(budget)` sets for the current thread."""
    return BoundedEnvironment(extra_filters=filters, extra_globals=globals, **options)


class _RouteThroughBudget(NodeTransformer):
    """Loops iterate through LOOP_FILTER and `~` joins through CONCAT_FILTER, where the budget looks."""

    def __init__(self, environment):
        self.environment = environment

    def visit_For(self, node):
        node = self.generic_visit(node)
        node.iter = self._filter(node.iter, LOOP_FILTER)
        return node

    def visit_Concat(self, node):
        node = self.generic_visit(node)
        return self._filter(nodes.List(node.nodes, lineno=node.lineno), CONCAT_FILTER)

    def _filter(self, arg, name):
        return nodes.Filter(arg, name, [], [], None, None, lineno=arg.lineno).set_environment(self.environment)


class _BudgetedCodeGenerator(CodeGenerator):
    def visit_Template(self, node, frame=None):
        _RouteThroughBudget(self.environment).visit(node)
        super().visit_Template(node, frame)


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox whose every step spends from the current thread's RenderBudget (module doc)."""

    # Intercepted operators are also never folded at compile time, where 'x' * 10**9 would run.
    intercepted_binops = frozenset({"+", "*", "**", "%"})
    code_generator_class = _BudgetedCodeGenerator

    def __init__(self, extra_filters: Mapping[str, Any] | None = None, extra_globals: Mapping[str, Any] | None = None,
                 **kwargs):  # fmt: skip
        super().__init__(**kwargs)
        self._local = threading.local()
        self.globals.pop("lipsum", None)  # lorem ipsum of any length, and no use in a prompt
        self.globals.update(extra_globals or {})
        self.filters.update(extra_filters or {})
        for name, func in list(self.filters.items()):
            self.filters[name] = self._guarded(name, func)
        self.filters[LOOP_FILTER] = self._loop
        self.filters[CONCAT_FILTER] = self._concat
        self.finalize = self._finalize

    @contextmanager
    def spending(self, budget: RenderBudget):
        """Renders in this thread spend from `budget` until the block ends."""
        self._local.budget = budget
        try:
            yield budget
        finally:
            self._local.budget = None

    def budget(self) -> RenderBudget:
        budget = getattr(self._local, "budget", None)
        if budget is None:
            raise TierlmError("a chat template was rendered outside ChatTemplate.render, which bounds it")
        return budget

    def call_binop(self, context, operator, left, right):
        budget = self.budget()
        budget.tick()
        _check_binop(budget, operator, left, right)
        return budget.charge(self.binop_table[operator](left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
        budget = __self.budget()
        budget.tick()
        args = _check_str_method(budget, __obj, args, kwargs)
        return budget.charge(super().call(__context, __obj, *args, **kwargs))

    @pass_context
    def _finalize(self, context, value):
        budget = self.budget()
        if not isinstance(value, str):
            budget.allow(text_size(value, budget.max_chars), "text")
            budget.tick()
            return value
        return budget.charge(value)

    @pass_context
    def _loop(self, context, iterable):
        budget = self.budget()
        for item in iterable:
            budget.tick()
            yield item

    @pass_context
    def _concat(self, context, parts):
        budget = self.budget()
        budget.allow(join_size("", parts, budget.max_chars), "a ~ join")
        return budget.charge("".join(map(str, parts)))

    def _guarded(self, name, func):
        """`func` with its result's size estimated first where it can outgrow its input."""

        @pass_context
        def guarded(context, value, *args, **kwargs):
            budget = self.budget()
            budget.tick()
            if name in _STRINGIFYING and not isinstance(value, str):
                budget.allow(text_size(value, budget.max_chars), f"the text of |{name}'s input")
            value = _check_filter(budget, name, value, args, kwargs)
            return budget.charge(context.call(func, value, *args, **kwargs))

        return guarded


def _check_binop(budget: RenderBudget, operator: str, left: Any, right: Any) -> None:
    sequences = (str, list, tuple)
    if operator == "*":
        seq, times = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(seq, sequences) and isinstance(times, int):
            budget.allow(len(seq) * max(times, 0), "a repeated sequence")
        elif isinstance(left, int) and isinstance(right, int):
            _allow_bits(left.bit_length() + right.bit_length())
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        _allow_bits(left.bit_length() * right)
    elif operator == "+" and isinstance(left, sequences) and isinstance(right, sequences):
        budget.allow(len(left) + len(right), "a concatenation")
    elif operator == "%" and isinstance(left, str):
        budget.allow(printf_size(left, right, budget.max_chars), "a %-formatted string")


def _allow_bits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise TierlmError(f"the chat template tried to compute an integer of about {bits:,} bits, over the "
                          f"limit of {MAX_INT_BITS:,}", _HINT)


def _check_str_method(budget: RenderBudget, obj: Any, args: tuple, kwargs: dict) -> tuple:
    """Estimate a str method's result before it runs; returns the arguments to call it with."""
    method = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format in its own function
    text = getattr(method, "__self__", None)
    if not isinstance(text, str):
        return args
    name, limit = getattr(method, "__name__", ""), budget.max_chars
    first = args[0] if args else None
    if name in ("center", "ljust", "rjust", "zfill") and isinstance(first, int):
        budget.allow(max(first, len(text)), f"str.{name}'s result")
    elif name == "expandtabs":
        tab = first if isinstance(first, int) else kwargs.get("tabsize", 8)
        budget.allow(len(text) * max(tab if isinstance(tab, int) else 8, 1), "str.expandtabs's result")
    elif name == "replace" and len(args) >= 2:
        budget.allow(replace_size(text, *args[:3]), "str.replace's result")
    elif name == "join" and args:
        items = list(first)  # a generator is read once here and passed on as a list
        budget.allow(join_size(text, items, limit), "str.join's result")
        return (items, *args[1:])
    elif name == "format":
        budget.allow(format_size(text, args, kwargs, limit), "str.format's result")
    elif name == "format_map" and isinstance(first, Mapping):
        budget.allow(format_size(text, (), first, limit), "str.format_map's result")
    return args


def _check_filter(budget: RenderBudget, name: str, value: Any, args: tuple, kwargs: dict) -> Any:
    """Estimate a filter's result before it runs where it can outgrow its input; returns the
    value to pass on (an iterable that had to be read becomes a list)."""
    limit = budget.max_chars

    def option(index: int, key: str, default: Any = None) -> Any:
        return args[index] if len(args) > index else kwargs.get(key, default)

    if name == "join" and option(1, "attribute") is None and not isinstance(value, str):
        value = list(value)
        budget.allow(join_size(str(option(0, "d", "")), value, limit), "|join's result")
    elif name == "center" and isinstance(option(0, "width", 80), int):
        budget.allow(max(option(0, "width", 80), len(str(value))), "|center's result")
    elif name == "indent":
        width = option(0, "width", 4)
        pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        text = str(value)
        budget.allow(len(text) + (text.count("\n") + 1) * pad, "|indent's result")
    elif name == "wordwrap":
        text, width, wrap = str(value), option(0, "width", 79), option(3, "wrapstring") or "\n"
        breaks = 2 * (len(text) // max(width, 1) + 1) if isinstance(width, int) else len(text)
        budget.allow(len(text) + breaks * len(str(wrap)), "|wordwrap's result")
    elif name == "replace" and len(args) >= 2:
        budget.allow(replace_size(str(value), *args[:3]), "|replace's result")
    elif name == "format":
        budget.allow(printf_size(str(value), kwargs or tuple(args), limit), "|format's result")
    elif name in ("batch", "slice") and isinstance(option(0, "linecount" if name == "batch" else "slices"), int):
        # batch fills its last row to `linecount` items; slice makes `slices` lists (~64 bytes each).
        count = option(0, "linecount" if name == "batch" else "slices")
        budget.allow(count * (1 if name == "batch" else 64), f"|{name}'s lists")
    elif name == "sum" and option(0, "attribute") is None and not isinstance(value, str):
        value = list(value)
        budget.allow(sum(len(v) for v in value if isinstance(v, (str, list, tuple))), "|sum's result")
    elif name == "tojson":
        names = ("ensure_ascii", "indent", "separators", "sort_keys")  # chat_template._tojson's parameters
        _allow_json(budget, value, {**dict(zip(names, args)), **kwargs})
    return value


def _allow_json(budget: RenderBudget, value: Any, options: dict) -> None:
    """Encode `value` as tojson will, counting the text without keeping it (indent can multiply it)."""
    options = {"ensure_ascii": False, **options}
    size = 0
    try:
        for chunk in json.JSONEncoder(**options).iterencode(value):
            size += len(chunk)
            budget.allow(size, "|tojson's result")
    except (TypeError, ValueError):
        return  # tojson itself will report what it cannot encode
