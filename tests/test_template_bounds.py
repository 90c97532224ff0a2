"""Runaway chat templates stop quickly with an error naming the bound; normal ones render as before.

Each runaway pattern would, unbounded, loop for minutes or allocate gigabytes (jinja2's sandbox
bounds only range() to 100000 items). The time-bound cases run with a short limit so the suite
stays fast; the size-bound cases must fail before they allocate, so they finish at once.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.tiers import quick
from tierlm.errors import TierlmError
from tierlm.runtime.chat_template import ChatTemplate, compile_template

USER = {"role": "user", "content": "hi"}
TIME = "ran for more than"
SIZE = "over the limit of"

# (name, template, text the error must contain)
RUNAWAYS = [
    # time: nothing grows, but the work never ends
    ("nested-loops", "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", TIME),
    ("nested-loops-output", "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}x{% endfor %}",
     TIME),
    ("loop-over-string", "{% set s = 'x' * 4000000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}", TIME),
    ("exponential-macro", "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
     TIME),
    ("filtered-loop", "{% for a in range(100000) %}{% for b in range(100000) if b %}{% endfor %}{% endfor %}", TIME),
    ("recursive-loop", "{% for x in [[0, 0]] recursive %}{% for y in range(100000) %}{% endfor %}"
     "{{ loop([x, x]) }}{% endfor %}", TIME),
    ("runaway-recursion", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deeply"),
    # size: a small template asks for a huge value
    ("str-times-big", "{{ 'x' * 10**9 }}", "a repeated sequence of 1,000,000,000"),
    ("str-times-literal", "{{ 'x' * 1000000000 }}", "a repeated sequence"),
    ("list-times-big", "{{ ['x'] * 10**9 }}", "a repeated sequence"),
    ("power", "{{ 2 ** 100000000 }}", "an integer of about"),  # jinja's ** is left-associative
    ("squaring", "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
     "an integer of about"),
    ("doubling-plus", "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
     "{% endfor %}", "a concatenation"),
    ("doubling-tilde", "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
     "{% endfor %}", "a ~ join"),
    ("doubling-block-set", "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set block %}{{ ns.s }}"
     "{{ ns.s }}{% endset %}{% set ns.s = block %}{% endfor %}", SIZE),
    ("join-separator", "{{ range(100000)|join('x' * 1000) }}", "|join's result"),
    ("join-references", "{{ (['y' * 1000000] * 1000)|join }}", "|join's result"),
    ("str-join-method", "{{ ('x' * 1000).join(range(100000)) }}", "str.join's result"),
    ("center-filter", "{{ 'x'|center(10**9) }}", "|center's result"),
    ("center-method", "{{ 'x'.center(10**9) }}", "str.center's result"),
    ("ljust", "{{ 'x'.ljust(1000000000) }}", "str.ljust's result"),
    ("zfill", "{{ '1'.zfill(1000000000) }}", "str.zfill's result"),
    ("expandtabs", "{{ ('\t' * 100000).expandtabs(100000) }}", "str.expandtabs's result"),
    ("format-width", "{{ '{:>1000000000}'.format(1) }}", "str.format's result"),
    ("format-nested-width", "{{ '{:{}}'.format('x', 1000000000) }}", "str.format's result"),
    ("format-precision", "{{ '{:.1000000000f}'.format(1.5) }}", "str.format's result"),
    ("printf-width", "{{ '%01000000000d' % 1 }}", "a %-formatted string"),
    ("printf-star", "{{ '%*d' % (1000000000, 1) }}", "a %-formatted string"),
    ("format-filter", "{{ '%01000000000d'|format(1) }}", "|format's result"),
    ("replace-filter", "{{ ('x' * 1000000)|replace('x', 'y' * 1000) }}", "|replace's result"),
    ("replace-empty", "{{ ('x' * 1000000).replace('', 'y' * 1000) }}", "str.replace's result"),
    ("indent", "{{ ('\n' * 1000000)|indent(10000, true, true) }}", "|indent's result"),
    ("wordwrap", "{{ ('x ' * 100000)|wordwrap(1, wrapstring='z' * 10000) }}", "|wordwrap's result"),
    ("print-references", "{{ ['y' * 1000000] * 100000 }}", SIZE),
    ("string-references", "{{ (['y' * 1000000] * 100000)|string }}", "|string's input"),
    ("upper-references", "{{ (['y' * 1000000] * 100000)|upper }}", "|upper's input"),
    ("tojson-references", "{{ (['y' * 1000000] * 100000)|tojson }}", "|tojson's result"),
    ("tojson-indent", "{{ ([[[[1]]]] * 100000)|tojson(indent=100000) }}", "|tojson's result"),
    ("tilde-references", "{{ 'a' ~ (['y' * 1000000] * 100000) }}", "a ~ join"),
    ("namespace-references", "{% set ns = namespace(l=['y' * 1000000] * 100000) %}{{ ns }}", SIZE),
    ("batch-fill", "{{ [1]|batch(10**9, 0)|list|length }}", "|batch's lists"),
    ("slice-count", "{{ []|slice(10**8)|list|length }}", "|slice's lists"),
    ("sum-lists", "{{ ([['x'] * 1000000] * 1000)|sum(start=[])|length }}", "|sum's result"),
    ("many-values", "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
     "{% set ns.l = ns.l + [('y' * 1000000) ~ i] %}{% endfor %}", "characters of text in all"),
    ("lipsum", "{{ lipsum(10**6) }}", "'lipsum' is undefined"),
    ("huge-literal", "{{ " + "9" * 5000 + " }}", "cannot be compiled"),
]


# Each runaway stopped by the time bound takes its 0.3 s: `make test-fast` runs one of those.
QUICK_TIMED = ("nested-loops",)


@pytest.mark.parametrize("source, needle", quick([c[1:] for c in RUNAWAYS], ids=[c[0] for c in RUNAWAYS],
                                                 fast=[c[1:] for c in RUNAWAYS if c[2] != TIME or c[0] in QUICK_TIMED]))
def test_runaway_template_stops_quickly_with_a_clear_error(source, needle):
    template = ChatTemplate(source, time_limit_s=0.3)
    started = time.perf_counter()
    with pytest.raises(TierlmError) as err:
        template.render([USER])
    elapsed = time.perf_counter() - started
    text = str(err.value)
    assert needle in text and "\n" not in text, text
    assert elapsed < (1.5 if needle == TIME else 1.0), f"{elapsed:.2f} s"


def test_time_bound_names_its_limit_and_defaults_to_two_seconds():
    template = ChatTemplate("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}")
    assert template.time_limit_s == 2.0
    with pytest.raises(TierlmError, match=r"ran for more than 0\.2 s and was stopped"):
        ChatTemplate(template.source, time_limit_s=0.2).render([USER])


def test_prompt_size_bound_counts_literal_output():
    template = ChatTemplate("{% for i in range(1000) %}0123456789{% endfor %}", max_chars=5000)
    with pytest.raises(TierlmError, match="a prompt of .* over the limit of 5,000"):
        template.render([USER])
    assert len(ChatTemplate(template.source, max_chars=10_000).render([USER])) == 10_000


def test_large_conversation_raises_the_size_bound_with_it():
    """A 10 MB message exceeds the default 4 Mi characters; its own text is allowed twice."""
    template = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m['content'] + '!' }}{% endfor %}")
    text = template.render([{"role": "user", "content": "z" * 10_000_000}])
    assert len(text) == 10_000_000 + len("<user>!")


def test_rendering_outside_chat_template_fails_closed():
    with pytest.raises(TierlmError, match="outside ChatTemplate.render"):
        compile_template("{{ 'a' + 'b' }}").render(messages=[USER])


def test_budgets_are_per_render_and_per_thread():
    slow = ChatTemplate("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
                        time_limit_s=0.3)
    quick = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", time_limit_s=0.3)
    errors, outputs = [], []

    def run_slow():
        try:
            slow.render([USER])
        except TierlmError as err:
            errors.append(str(err))

    thread = threading.Thread(target=run_slow)
    thread.start()
    for _ in range(50):  # the slow render's budget does not leak into these
        outputs.append(quick.render([USER]))
    thread.join()
    assert errors and TIME in errors[0] and set(outputs) == {"hi"}
    assert quick.render([USER]) == "hi"  # a finished budget is not reused


# ----------------------------------------------------------------------------- normal templates


FEATURES = r"""{%- macro show(m, sep='|') -%}{{ m.role ~ ':' ~ m.content }}{{ sep }}{%- endmacro -%}
{%- macro wrap() -%}[{{ caller() }}]{%- endmacro -%}
{%- set ns = namespace(n=0, text='') -%}
{%- for m in messages if m.role != 'system' -%}
  {{ loop.index }}/{{ loop.length }}{{ '.' if loop.last else ',' }}{{ show(m) }}
  {%- set ns.n = ns.n + m.content|length -%}{%- set ns.text = ns.text ~ m.role[0] -%}
{%- else -%}none
{%- endfor -%}
{%- for x in [[1, [2]], [3]] recursive -%}{% if x is iterable %}({{ loop(x) }}){% else %}{{ x }}{% endif %}
{%- endfor -%}
{%- call wrap() %}{{ ns.n }} {{ ns.text }}{% endcall -%}
{%- set block %}{{ 'a' * 3 }}{{ '%s-%05.1f' % ('p', 2.5) }}{{ '{:>4}|{}'.format(7, 'q') }}{% endset -%}
{{ block|upper }} {{ messages|map(attribute='role')|join(',') }} {{ range(3)|list|sum }} {{ 2 ** 10 }}
{{ 'x'|center(7) }}|{{ 'a b'|replace(' ', '_') }}|{{ [1, 2, 3, 4]|batch(3, 0)|list }}|{{ 'ab'|indent(2, true) }}
{{ {'k': [1, {'z': 'é<>'}]}|tojson(indent=2) }} {{ tools|tojson }} {{ [1, 'two', none, 2.5] }}
{%- if add_generation_prompt %}{{ '\n<|assistant|>' }}{% endif -%}
"""


def _plain_render(source: str, **variables) -> str:
    """The same template in jinja2's unbounded sandbox, configured as compile_template does."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda v, indent=None, **kw: json.dumps(v, ensure_ascii=False, indent=indent, **kw)
    env.globals["namespace"] = jinja2.utils.Namespace
    return env.from_string(source).render(**variables)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_bounded_rendering_matches_jinjas_own_output(add_generation_prompt):
    from tests.test_chat_template import QWEN25_TEMPLATE, WEATHER_TOOL

    messages = [{"role": "system", "content": "be brief"}]
    for i in range(300):
        messages += [{"role": "user", "content": f"question {i} <é>"}, {"role": "assistant", "content": f"a{i}"}]
    variables = dict(messages=messages, tools=[WEATHER_TOOL], documents=None,
                     add_generation_prompt=add_generation_prompt)
    for source in (FEATURES, QWEN25_TEMPLATE):
        expected = _plain_render(source, **variables)
        assert ChatTemplate(source).render(messages, add_generation_prompt, tools=[WEATHER_TOOL]) == expected
