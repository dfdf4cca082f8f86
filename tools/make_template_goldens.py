#!/usr/bin/env python3
"""Writes the chat-template goldens under tests/data/chat/ that vireo's jinja engine must match byte
for byte.

The oracle is Python jinja2 as transformers configures it:
  * real templates (../shared/data/tokenizers/*/tokenizer_config.json.gz) are rendered with
    tokenizer.apply_chat_template(tokenize=False), the tokenizer loaded from a decompressed copy;
  * the GLM-5-style template (tests/data/chat/glm5_template.jinja) has no tokenizer, so it goes
    through the same path apply_chat_template takes (drop null keys, special tokens + kwargs,
    transformers' render_jinja_template), which this script checks against apply_chat_template on
    the real templates first;
  * engine unit cases (small inline templates) are rendered with transformers' own compiled jinja2
    environment (_compile_jinja_template: ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
    loopcontrols, its tojson/raise_exception/namespace).

Deterministic: no clocks, no randomness. Run with the project venv:
  /work/pyenv/bin/python tools/make_template_goldens.py [--shared DIR]
"""
import argparse
import copy
import gzip
import json
import os
import pathlib
import shutil
import sys
import tempfile

import transformers
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import _compile_jinja_template, render_jinja_template

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "chat"
SPECIAL_TOKEN_NAMES = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"]

# --- conversations -------------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "top_k": {"type": "integer"}}},
    },
}

SYS = {"role": "system", "content": "You are a helpful assistant."}
U1 = {"role": "user", "content": "What is the capital of France?"}
A1 = {"role": "assistant", "content": "The capital of France is Paris."}
U2 = {"role": "user", "content": "And of Germany?"}
A2 = {"role": "assistant", "content": "Berlin."}

TOOL_CALL_DICT = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}
    ],
}
TOOL_CALL_TWO = {
    "role": "assistant",
    "content": "Let me check both.",
    "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"type": "function", "function": {"name": "search", "arguments": {"query": "Paris events", "top_k": 3}}},
    ],
}
TOOL_CALL_NONE_CONTENT = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
    ],
}
TOOL_CALL_STRING_ARGS = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
    ],
}
TOOL_RESULT = {"role": "tool", "content": "{\"temperature\": 21, \"condition\": \"sunny\"}"}
TOOL_RESULT2 = {"role": "tool", "content": "Top result: Fête de la Musique"}
A_AFTER_TOOL = {"role": "assistant", "content": "It is 21 °C and sunny in Paris."}

CONVERSATIONS = [
    ("system_user", [SYS, U1], {}),
    ("user_only", [U1], {}),
    ("multi_turn", [SYS, U1, A1, U2], {}),
    ("multi_turn_no_system", [U1, A1, U2, A2], {}),
    ("ends_with_assistant", [SYS, U1, A1], {}),
    ("unicode", [{"role": "system", "content": "Réponds en français. 日本語もOK 🙂"},
                 {"role": "user", "content": "  Grüße aus Zürich — ça va? \u3000 \n"}], {}),
    ("whitespace", [{"role": "user", "content": "\n\n  indented line\n\ttabbed\n\n"},
                    {"role": "assistant", "content": "\n  answer  \n"},
                    {"role": "user", "content": "ok"}], {}),
    ("quotes_and_braces", [{"role": "user", "content": "He said \"{{ not a tag }}\" and {% nor this %} \\n"}], {}),
    ("reasoning_content", [U1, {"role": "assistant", "content": "Paris.", "reasoning_content": "The user asks about France.\nParis is the capital."}, U2], {}),
    ("reasoning_last_turn", [U1, {"role": "assistant", "content": "Paris.", "reasoning_content": "Easy question."}], {}),
    ("inline_think", [U1, {"role": "assistant", "content": "<think>\nrecall geography\n</think>\n\nParis."}, U2], {}),
    ("enable_thinking_false", [SYS, U1], {"enable_thinking": False}),
    ("enable_thinking_true", [SYS, U1], {"enable_thinking": True}),
    ("tools_defined", [SYS, U1], {"tools": [WEATHER_TOOL, SEARCH_TOOL]}),
    ("tools_no_system", [U1], {"tools": [WEATHER_TOOL]}),
    ("tool_call_roundtrip", [SYS, {"role": "user", "content": "Weather in Paris?"}, TOOL_CALL_DICT, TOOL_RESULT, A_AFTER_TOOL],
     {"tools": [WEATHER_TOOL]}),
    ("tool_call_pending", [{"role": "user", "content": "Weather in Paris?"}, TOOL_CALL_DICT, TOOL_RESULT],
     {"tools": [WEATHER_TOOL]}),
    ("two_tool_calls", [{"role": "user", "content": "Weather and events in Paris?"}, TOOL_CALL_TWO, TOOL_RESULT, TOOL_RESULT2],
     {"tools": [WEATHER_TOOL, SEARCH_TOOL]}),
    ("tool_call_string_args", [{"role": "user", "content": "Weather in Paris?"}, TOOL_CALL_STRING_ARGS, TOOL_RESULT, A_AFTER_TOOL],
     {"tools": [WEATHER_TOOL]}),
    ("tool_call_null_content", [{"role": "user", "content": "Weather in Paris?"}, TOOL_CALL_NONE_CONTENT, TOOL_RESULT],
     {"tools": [WEATHER_TOOL]}),
    ("content_parts", [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                       {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}]}], {}),
    ("roles_not_alternating", [U1, U2], {}),
    ("empty_conversation", [], {}),
]

# --- engine unit cases ---------------------------------------------------------------------------

UNIT_CASES = [
    # text, whitespace control, trim_blocks / lstrip_blocks
    ("text_only", "hello world", {}),
    ("trailing_newline_dropped", "hello\n", {}),
    ("two_trailing_newlines", "hello\n\n", {}),
    ("crlf_normalized", "a\r\nb\rc", {}),
    ("print_var", "Hi {{ name }}!", {"name": "Ann"}),
    ("print_undefined", "[{{ nothing }}]", {}),
    ("print_none_bool_float", "{{ none }} {{ true }} {{ 1.5 }} {{ 3.0 }} {{ 1e20 }} {{ 0.0001 }} {{ 1e-5 }} {{ 10 / 4 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 2 ** 10 }}", {}),
    ("print_list_dict", "{{ [1, 'a', none, true] }} {{ {'k': 'v', 'n': [1.5]} }} {{ ('x',) }} {{ \"it's\" }}", {}),
    ("minus_strips", "a  \n  {%- if true -%}  \n  b  \n  {%- endif -%}  \n  c", {}),
    ("trim_blocks", "{% if true %}\nyes\n{% endif %}\nafter", {}),
    ("lstrip_blocks", "line\n    {% if true %}\n    indented\n    {% endif %}\ndone", {}),
    ("lstrip_not_for_vars", "x\n    {{ 'v' }}\n", {}),
    ("plus_disables_lstrip", "x\n    {%+ if true %}y{% endif %}", {}),
    ("plus_disables_trim", "{% if true +%}\ny{% endif %}", {}),
    ("comment", "a {# comment #} b\n  {# own line #}\nc", {}),
    ("comment_minus", "a   {#- c -#}   b", {}),
    ("var_minus", "a   {{- 'x' -}}   b", {}),
    ("raw_block", "{% raw %}{{ not evaluated }}{% endraw %}", {}),
    ("lstrip_after_text_tag_same_line", "abc {% if true %}x{% endif %}", {}),
    ("lstrip_after_var_line", "{{ 'a' }}\n  {% if true %}b{% endif %}", {}),
    ("whitespace_only_template", "   \n   ", {}),
    # if / elif / else
    ("if_elif_else", "{% for x in [1, 2, 3] %}{% if x == 1 %}one{% elif x == 2 %}two{% else %}many{% endif %},{% endfor %}", {}),
    ("if_undefined", "{% if missing %}y{% else %}n{% endif %}", {}),
    ("inline_if", "{{ 'a' if flag else 'b' }}{{ 'c' if not flag }}", {"flag": False}),
    # for
    ("for_loop_vars", "{% for x in items %}{{ loop.index }}/{{ loop.index0 }}/{{ loop.revindex }}/{{ loop.revindex0 }}/{{ loop.first }}/{{ loop.last }}/{{ loop.length }};{% endfor %}", {"items": ["a", "b", "c"]}),
    ("for_else", "{% for x in [] %}x{% else %}empty{% endfor %}", {}),
    ("for_filter", "{% for x in range(10) if x % 3 == 0 %}{{ x }}{{ ',' if not loop.last }}{% endfor %}", {}),
    ("for_dict", "{% for k in d %}{{ k }}{% endfor %}|{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}", {"d": {"b": 1, "a": 2}}),
    ("for_string", "{% for c in 'héllo' %}[{{ c }}]{% endfor %}", {}),
    ("for_prev_next", "{% for x in [1,2,3] %}{{ loop.previtem|default('-') }}{{ x }}{{ loop.nextitem|default('-') }} {% endfor %}", {}),
    ("for_cycle", "{% for x in range(4) %}{{ loop.cycle('odd', 'even') }} {% endfor %}", {}),
    ("for_break_continue", "{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 5 %}{% break %}{% endif %}{{ x }}{% endfor %}", {}),
    ("nested_loops", "{% for a in [1,2] %}{% for b in ['x','y'] %}{{ a }}{{ b }}{{ loop.index }} {% endfor %}{{ loop.index }}|{% endfor %}", {}),
    ("loop_scope", "{% set x = 1 %}{% for i in [1,2] %}{{ x }}{% set x = 5 %}{{ x }}{% endfor %}{{ x }}", {}),
    ("for_undefined_iter", "{% for x in missing %}x{% else %}none{% endfor %}", {}),
    ("for_tuple_unpack", "{% for a, b in [[1, 2], [3, 4]] %}{{ a + b }} {% endfor %}", {}),
    # set / namespace
    ("set_simple", "{% set a = 'x' ~ 1 %}{% set b, c = 1, 2 %}{{ a }}{{ b }}{{ c }}", {}),
    ("set_block", "{% set block %}  inner {{ 1 + 1 }}  {% endset %}[{{ block }}]", {}),
    ("set_block_filter", "{% set block | upper | trim %}  inner  {% endset %}[{{ block }}]", {}),
    ("namespace", "{% set ns = namespace(count=0, found=false) %}{% for x in [1, 2, 3] %}{% set ns.count = ns.count + x %}{% endfor %}{{ ns.count }} {{ ns.found }}", {}),
    ("set_in_if_visible", "{% if true %}{% set v = 'in' %}{% endif %}{{ v }}", {}),
    ("override_add_generation_prompt", "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{{ add_generation_prompt }}", {}),
    # macros
    ("macro_basic", "{% macro greet(name, punct='!') %}Hello {{ name }}{{ punct }}{% endmacro %}{{ greet('Ann') }} {{ greet('Bob', punct='?') }} {{ greet(name='Cy', punct='.') }}", {}),
    ("macro_missing_arg", "{% macro m(a, b) %}[{{ a }}|{{ b }}]{% endmacro %}{{ m(1) }}", {}),
    ("macro_varargs_kwargs", "{% macro m(a) %}{{ a }}{{ varargs }}{{ kwargs }}{% endmacro %}{{ m(1, 2, 3, x=4) }}", {}),
    ("macro_recursion", "{% macro fact(n) %}{% if n <= 1 %}1{% else %}{{ n }}*{{ fact(n - 1) }}{% endif %}{% endmacro %}{{ fact(4) }}", {}),
    ("macro_closure", "{% set g = 'G' %}{% macro m() %}{{ g }}{% endmacro %}{{ m() }}", {}),
    ("macro_whitespace", "{%- macro m(x) -%}\n  <{{ x }}>\n{%- endmacro -%}\n{{ m(1) }}{{ m(2) }}", {}),
    ("call_block", "{% macro wrap() %}<{{ caller() }}>{% endmacro %}{% call wrap() %}inside{% endcall %}", {}),
    ("filter_block", "{% filter upper %}shout {{ 'this' }}{% endfilter %}", {}),
    ("with_block", "{% with a = 1, b = 2 %}{{ a + b }}{% endwith %}{{ a }}", {}),
    ("generation_tag", "{% generation %}assistant text{% endgeneration %}", {}),
    # expressions and operators
    ("arith_precedence", "{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 2 ** 3 ** 2 }} {{ -2 ** 2 }} {{ 7 % 4 }} {{ 'a' ~ 1 ~ none }}", {}),
    ("string_ops", "{{ 'ab' * 3 }} {{ 'a' + 'b' }} {{ [1] + [2] }} {{ 'b' in 'abc' }} {{ 'x' not in ['x'] }} {{ 'k' in {'k': 1} }}", {}),
    ("comparisons", "{{ 1 < 2 < 3 }} {{ 1 == 1.0 }} {{ true == 1 }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }} {{ none == none }} {{ missing == missing }}", {}),
    ("and_or_values", "{{ '' or 'default' }} {{ 'x' and 'y' }} {{ 0 or none }} {{ not '' }}", {}),
    ("subscripts", "{{ m['role'] }} {{ m.role }} {{ m.content[0] }} {{ items[-1] }} {{ items[5] is defined }} {{ m['nope'] is defined }}", {"m": {"role": "user", "content": "hey"}, "items": [1, 2, 3]}),
    ("slicing", "{{ s[1:] }} {{ s[:-1] }} {{ s[::-1] }} {{ l[1:3] }} {{ l[::2] }} {{ l[-2:] }} {{ l[5:] }} {{ s[2:100] }}", {"s": "héllo", "l": [1, 2, 3, 4, 5]}),
    ("attr_on_none", "{{ x.y is defined }}", {"x": None}),
    # A tuple index is no string's, list's or JSON object's key: undefined. jinja2 takes no trailing comma.
    ("tuple_subscripts", "[{{ s[1, 2] }}|{{ l[0, 1] is defined }}|{{ m[1, 2] is defined }}|{{ l[0] }}]", {"s": "héllo", "l": [7, 8], "m": {"a": 1}}),
    ("error_subscript_trailing_comma", "{{ l[0,] }}", {"l": [7, 8]}),
    ("dict_literal_order", "{{ {'b': 1, 'a': 2} | tojson }}", {}),
    ("string_escapes", "{{ 'tab\\tnewline\\nquote\\'uni\\u00e9' }}|{{ \"dq\\\"\" }}|{{ 'keep\\q' }}", {}),
    ("adjacent_strings", "{{ 'a' 'b' \"c\" }}", {}),
    # tests
    ("tests_types", "{{ s is string }} {{ n is number }} {{ n is integer }} {{ f is float }} {{ b is boolean }} {{ t is true }} {{ b is false }} {{ d is mapping }} {{ l is iterable }} {{ l is sequence }} {{ s is iterable }} {{ d is iterable }} {{ nn is none }} {{ missing is undefined }} {{ n is not string }}", {"s": "x", "n": 3, "f": 1.5, "b": False, "t": True, "d": {"a": 1}, "l": [1], "nn": None}),
    ("tests_values", "{{ 3 is odd }} {{ 4 is even }} {{ 9 is divisibleby 3 }} {{ 9 is divisibleby(2) }} {{ 'a' is eq 'a' }} {{ 2 is gt 1 }} {{ 1 is lt(2) }} {{ 'x' is in ['x'] }} {{ 'abc' is lower }} {{ 'ABC' is upper }} {{ none is sameas none }}", {}),
    ("test_none_vs_undefined", "{{ m.content is none }} {{ m.content is defined }} {{ m.other is none }}", {"m": {"content": None}}),
    ("test_bool_is_number", "{{ true is number }} {{ true is integer }}", {}),
    # filters
    ("filter_trim_length", "[{{ '  a b  ' | trim }}] {{ 'héllo' | length }} {{ [1, 2] | length }} {{ {'a': 1} | length }} {{ missing | length }} {{ 'xxhixx' | trim('x') }}", {}),
    ("filter_default", "{{ missing | default('dflt') }} {{ '' | default('e') }} {{ '' | default('e', true) }} {{ none | default('n') }} {{ missing | d('short') }}", {}),
    ("filter_join_upper_lower", "{{ ['a', 'b', 3] | join(', ') }} {{ 'MiXeD' | upper }} {{ 'MiXeD' | lower }} {{ ['x', 'y'] | join }}", {}),
    ("filter_replace", "{{ 'aaa' | replace('a', 'b') }} {{ 'aaa' | replace('a', 'b', 2) }} {{ 'ab' | replace('', '-') }}", {}),
    ("filter_first_last", "{{ [1, 2, 3] | first }} {{ [1, 2, 3] | last }} {{ 'abc' | first }} {{ [] | first is defined }}", {}),
    ("filter_items", "{% for k, v in d | items %}{{ k }}:{{ v }} {% endfor %}", {"d": {"z": 1, "y": [2]}}),
    ("filter_tojson", "{{ d | tojson }}\n{{ d | tojson(indent=2) }}\n{{ 'é\"\\n</script>' | tojson }}\n{{ 'é' | tojson(ensure_ascii=True) }}\n{{ [1.0, 2.5, none, true] | tojson }}\n{{ d | tojson(sort_keys=true) }}\n{{ d | tojson(separators=(',', ':')) }}\n{{ {} | tojson(indent=2) }}", {"d": {"b": [1, {"x": "y"}], "a": "ü", "e": {}}}),
    ("filter_selectattr_map", "{{ msgs | selectattr('role', 'equalto', 'user') | map(attribute='content') | join('/') }} {{ msgs | rejectattr('role', 'eq', 'user') | list | length }} {{ msgs | map(attribute='role') | unique | list }}", {"msgs": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]}),
    ("filter_selectattr_truthy", "{{ tools | selectattr('enabled') | map(attribute='name') | list }}", {"tools": [{"name": "a", "enabled": True}, {"name": "b", "enabled": False}, {"name": "c"}]}),
    ("filter_select_reject", "{{ [1, 2, 3, 4] | select('odd') | list }} {{ [1, 2, 3, 4] | reject('odd') | list }} {{ ['', 'a'] | select | list }}", {}),
    ("filter_map_filter", "{{ ['a', 'b'] | map('upper') | join }} {{ [' x ', 'y '] | map('trim') | list }}", {}),
    ("filter_misc", "{{ [3, 1, 2] | sort }} {{ [3, 1, 2] | sort(reverse=true) }} {{ 'abc' | reverse }} {{ [1, 2] | reverse | list }} {{ [1, 2, 3] | sum }} {{ [1, 5, 2] | max }} {{ [4, 2] | min }} {{ -3 | abs }} {{ '42' | int + 1 }} {{ '2.5' | float }} {{ 'x' | int }} {{ 3.7 | int }} {{ 42 | string ~ '!' }} {{ 'hello world' | title }} {{ 'hello' | capitalize }} {{ 'a b  c' | wordcount }} {{ [1, 2] | list }} {{ 'ab' | list }}", {}),
    ("filter_dictsort", "{% for k, v in d | dictsort %}{{ k }}{{ v }}{% endfor %}", {"d": {"b": 1, "A": 2, "c": 3}}),
    ("filter_indent", "{{ 'a\\nb\\n\\nc' | indent(2) }}|{{ 'a\\nb' | indent(4, true) }}|{{ 'a\\n\\nb' | indent(2, blank=true) }}", {}),
    ("filter_round", "{{ 2.5 | round }} {{ 3.14159 | round(2) }} {{ 2.1 | round(0, 'ceil') }}", {}),
    ("filter_attr", "{{ d | attr('x') is defined }}", {"d": {"x": 1}}),
    ("filter_escape", "{{ '<a href=\"x\">&</a>' | e }}", {}),
    # string methods
    ("str_methods", "{{ s.startswith('He') }} {{ s.endswith('!') }} {{ s.startswith(('x', 'H')) }} {{ s.split(' ') }} {{ s.split() }} {{ ' a  b '.split() }} {{ 'a,b,c'.split(',', 1) }} {{ 'a,b,c'.rsplit(',', 1) }} {{ '  x  '.strip() }}|{{ '  x  '.lstrip() }}|{{ '  x  '.rstrip() }}| {{ '\\n\\nx\\n'.strip('\\n') }} {{ s.upper() }} {{ s.lower() }} {{ s.replace('l', 'L') }} {{ s.find('o') }} {{ s.count('l') }} {{ '-'.join(['a', 'b']) }} {{ s.title() }}", {"s": "Hello World!"}),
    ("str_split_think", "{{ c.split('</think>')[-1].lstrip('\\n') }}|{{ c.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') }}", {"c": "<think>\nreason\n</think>\n\nanswer"}),
    ("str_unicode_strip", "[{{ s.strip() }}] [{{ s | trim }}]", {"s": "\u3000\u00a0 x \u2003\n"}),
    ("dict_methods", "{{ d.get('a') }} {{ d.get('zz') }} {{ d.get('zz', 'dflt') }} {{ d.keys() | list }} {{ d.values() | list }} {{ d.items() | list }}", {"d": {"a": 1, "b": 2}}),
    # globals
    ("global_range", "{{ range(3) | list }} {{ range(1, 7, 2) | list }} {{ range(5, 0, -2) | list }}", {}),
    ("global_dict", "{{ dict(a=1, b='x') | tojson }}", {}),
    ("raise_exception", "{% if true %}{{ raise_exception('Custom failure: ' ~ 42) }}{% endif %}", {}),
    # generators (select/map/... return one in jinja2) and formatting
    ("generator_truthy", "{% if msgs | selectattr('role', 'equalto', 'system') %}yes{% else %}no{% endif %} {{ msgs | selectattr('role', 'equalto', 'x') | list | length }} {{ (msgs | map(attribute='role') | first) }}", {"msgs": [{"role": "user"}]}),
    ("error_generator_length", "{{ [1, 2] | select('odd') | length }}", {}),
    ("error_generator_tojson", "{{ [1, 2] | map('string') | tojson }}", {}),
    ("percent_format", "{{ '%s and %r, %d%% %5.2f|%-4s|%04d' % ('a', 'b', 7, 3.14159, 'x', 42) }} {{ '%s' % 'solo' }} {{ '%(k)s=%(v)d' % {'k': 'n', 'v': 3} }}", {}),
    ("format_filter", "{{ '%s-%s' | format('a', 1) }}", {}),
    ("str_format", "{{ '{} + {} = {}'.format(1, 2, 3) }} {{ '{0}{1}{0}'.format('a', 'b') }} {{ '{name}!r={name!r}'.format(name='x') }} {{ '{{literal}}'.format() }}", {}),
    ("loop_changed", "{% for x in [1, 1, 2, 2, 1] %}{% if loop.changed(x) %}{{ x }}{% endif %}{% endfor %}", {}),
    ("sort_attribute", "{{ people | sort(attribute='age') | map(attribute='name') | join(',') }}", {"people": [{"name": "b", "age": 30}, {"name": "a", "age": 20}]}),
    ("not_precedence", "{{ not x is defined }} {{ not 1 == 2 }} {{ -1 | abs }} {{ (x if false) is defined }}", {}),
    ("nested_data_access", "{{ tools[0].function.parameters.properties.city.type }} {{ tools[0]['function']['name'] | upper }}", {"tools": [{"function": {"name": "get", "parameters": {"properties": {"city": {"type": "string"}}}}}]}),
    ("tojson_unicode_nested", "{{ x | tojson }} {{ x | tojson(ensure_ascii=true) }}", {"x": {"emoji": "🙂", "ctrl": "\u0001\t", "big": 12345678901234, "neg": -0.5, "exp": 1e-7}}),
    ("bool_none_printing", "{{ [true, none] }} {{ {'a': none} }} {{ 1 == 1 }} {{ none | string }} {{ true | tojson }}", {}),
    # errors
    ("error_unknown_filter", "line1\n{{ x | nosuchfilter }}", {}),
    ("error_unknown_test", "{{ x is nosuchtest }}", {}),
    ("error_unknown_tag", "ok\n{% include 'x' %}", {}),
    ("error_unclosed_if", "{% if true %}no end", {}),
    ("error_unclosed_var", "{{ x ", {}),
    ("error_bad_expression", "{{ 1 + }}", {}),
    ("error_undefined_attr", "{{ missing.attr }}", {}),
    ("error_add_str_int", "{{ 'a' + 1 }}", {}),
    ("error_add_undefined", "{{ 'a' + missing }}", {}),
    ("error_set_non_namespace", "{% set d = {} %}{% set d.x = 1 %}", {}),
    ("error_break_outside_loop", "{% break %}", {}),
    ("error_compare_types", "{{ 1 < 'a' }}", {}),
    ("error_unbalanced_paren", "{{ (1 + 2 }}", {}),
    ("error_missing_comment_end", "{# never closed", {}),
    ("error_call_undefined", "{{ nothing() }}", {}),
    ("error_iterate_int", "{% for x in 5 %}{% endfor %}", {}),
    ("error_tojson_undefined", "{{ missing | tojson }}", {}),
]


def render_unit(template, context):
    try:
        return {"expected": _compile_jinja_template(template).render(**context)}
    except Exception as e:  # noqa: BLE001 - any jinja2 failure is an expected error
        return {"error": f"{type(e).__name__}: {e}"}


# --- chat templates ------------------------------------------------------------------------------


def emulate_apply_chat_template(chat_template, special_tokens, messages, add_generation_prompt, extra):
    """What tokenizer.apply_chat_template(tokenize=False) does in transformers 5.23, minus the
    tokenizer: template choice, null-key dropping, special tokens + kwargs, render_jinja_template."""
    extra = dict(extra)
    tools = extra.pop("tools", None)
    documents = extra.pop("documents", None)
    if isinstance(chat_template, dict):
        chat_template = chat_template["tool_use"] if tools is not None and "tool_use" in chat_template else chat_template["default"]
    if len(messages) == 0:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    conversation = [{k: v for k, v in m.items() if v is not None} for m in messages]
    kwargs = {**special_tokens, **extra}
    rendered, _ = render_jinja_template(
        conversations=[conversation], tools=tools, documents=documents, chat_template=chat_template,
        add_generation_prompt=add_generation_prompt, **kwargs)
    return rendered[0]


def outcome(fn):
    try:
        return {"expected": fn()}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}


def make_cases(render):
    cases = []
    for name, messages, extra in CONVERSATIONS:
        for gen in (True, False):
            case = {"name": f"{name}/{'gen' if gen else 'nogen'}", "messages": messages,
                    "add_generation_prompt": gen, "extra": extra}
            case.update(outcome(lambda: render(copy.deepcopy(messages), gen, copy.deepcopy(extra))))
            cases.append(case)
    return cases


def special_tokens_of(config):
    out = {}
    for k in SPECIAL_TOKEN_NAMES:
        v = config.get(k)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            out[k] = v
    return out


def write(path, obj):
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path.relative_to(ROOT)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", default=str(ROOT.parent / "shared"))
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {"jinja2": __import__("jinja2").__version__, "transformers": transformers.__version__}

    unit = []
    for name, template, context in UNIT_CASES:
        case = {"name": name, "template": template, "context": context}
        case.update(render_unit(template, context))
        unit.append(case)
    write(OUT / "jinja_unit_goldens.json", {"generator": "tools/make_template_goldens.py", **meta, "cases": unit})

    tok_root = pathlib.Path(args.shared) / "data" / "tokenizers"
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="vireo_tok_"))
    try:
        for tid in ("deepseek_v3", "qwen3", "gemma3"):
            src = tok_root / tid
            if not src.exists():
                print(f"skip {tid}: {src} not found", file=sys.stderr)
                continue
            dst = tmp / tid
            dst.mkdir()
            for f in ("tokenizer_config.json", "tokenizer.json"):
                with gzip.open(src / (f + ".gz"), "rb") as fin, open(dst / f, "wb") as fout:
                    shutil.copyfileobj(fin, fout)
            config = json.loads((dst / "tokenizer_config.json").read_text(encoding="utf-8"))
            tok = AutoTokenizer.from_pretrained(str(dst))

            def real(messages, gen, extra, tok=tok):
                return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **extra)

            def emulated(messages, gen, extra, config=config):
                return emulate_apply_chat_template(config["chat_template"], special_tokens_of(config), messages, gen, extra)

            cases = make_cases(real)
            # The emulation must agree with the real thing (it is the oracle for the GLM template).
            for case, check in zip(cases, make_cases(emulated)):
                assert ("error" in case) == ("error" in check) and case.get("expected") == check.get("expected"), \
                    f"{tid} {case['name']}: emulation differs from apply_chat_template"
            write(OUT / f"goldens_{tid}.json", {
                "generator": "tools/make_template_goldens.py", **meta, "template_id": tid,
                "source": f"data/tokenizers/{tid}/tokenizer_config.json.gz (relative to the shared dir)",
                "cases": cases})
    finally:
        shutil.rmtree(tmp)

    glm_src = (OUT / "glm5_template.jinja").read_text(encoding="utf-8")
    glm_special = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    cases = make_cases(lambda m, g, e: emulate_apply_chat_template(glm_src, glm_special, m, g, e))
    write(OUT / "goldens_glm5.json", {
        "generator": "tools/make_template_goldens.py", **meta, "template_id": "glm5",
        "source": "tests/data/chat/glm5_template.jinja", "special_tokens": glm_special, "cases": cases})


if __name__ == "__main__":
    main()
