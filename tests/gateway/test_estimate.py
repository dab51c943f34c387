"""The worst case the gateway reserves: every sequence, every prompt, the output the engine honours."""

from __future__ import annotations

import json
import subprocess
import sys
import unicodedata
from decimal import ROUND_CEILING, Decimal
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from endpoints.gateway.estimate import MAX_RESERVATION, WorstCase, worst_case
from endpoints.gateway.tally import UsageTally

CONTEXT = 2048
PRICES = SimpleNamespace(price_input_per_million=Decimal("100"), price_cached_input_per_million=Decimal("50"),
                         price_output_per_million=Decimal("100"))
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello"}]}
REPO_ROOT = Path(__file__).resolve().parents[2]


def test_sixteen_completions_reserve_sixteen_times_the_output_of_one():
    one = worst_case({"model": "m", "prompt": "Hi", "max_tokens": 100}, "completion", CONTEXT)
    sixteen = worst_case({"model": "m", "prompt": "Hi", "max_tokens": 100, "n": 16}, "completion", CONTEXT)
    assert one.num_output_tokens == 100
    assert sixteen.num_output_tokens == 1600
    assert sixteen.max_cost(PRICES) > 15 * one.max_cost(PRICES) - Decimal("0.01")


def test_best_of_adds_no_sequences_since_the_engine_ignores_it():
    # vLLM's completions return `n` choices whatever `best_of` says (`endpoints.gateway.fields` refuses it above `n`)
    assert worst_case({"prompt": "Hi", "max_tokens": 10, "n": 2, "best_of": 2}, "completion", CONTEXT).num_output_tokens == 20


def test_a_list_of_prompts_reserves_each_prompt_and_its_outputs():
    case = worst_case({"prompt": ["a", "bb", "ccc"], "max_tokens": 10, "n": 2}, "completion", CONTEXT)
    assert case.prompt_bounds == (9, 10, 11)
    assert case.num_output_tokens == 3 * 2 * 10


def test_token_id_prompts_count_their_ids():
    assert worst_case({"prompt": [1, 2, 3]}, "completion", CONTEXT).prompt_bounds == (3,)
    assert worst_case({"prompt": [[1, 2], [3]]}, "completion", CONTEXT).prompt_bounds == (2, 1)


def test_completions_honour_max_tokens_only_as_the_engine_does():
    # vLLM's /v1/completions ignores max_completion_tokens and defaults max_tokens to 16.
    case = worst_case({"prompt": "Hi", "max_completion_tokens": 5}, "completion", CONTEXT)
    assert case.max_output_tokens == 16
    assert worst_case({"prompt": "Hi", "max_tokens": 300, "max_completion_tokens": 5}, "completion", CONTEXT).max_output_tokens == 300


def test_chat_prefers_max_completion_tokens_and_otherwise_fills_the_context():
    assert worst_case(CHAT | {"max_tokens": 300, "max_completion_tokens": 5}, "chat", CONTEXT).max_output_tokens == 5
    assert worst_case(CHAT | {"max_tokens": 300}, "chat", CONTEXT).max_output_tokens == 300
    assert worst_case(CHAT, "chat", CONTEXT).max_output_tokens == CONTEXT


def test_tools_and_schemas_count_toward_the_prompt():
    tools = [{"type": "function", "function": {"name": "lookup", "description": "x" * 500, "parameters": {"type": "object"}}}]
    plain = worst_case(CHAT, "chat", CONTEXT).num_prompt_tokens
    assert worst_case(CHAT | {"tools": tools}, "chat", CONTEXT).num_prompt_tokens > plain + 500
    schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"description": "y" * 300}}}
    assert worst_case(CHAT | {"response_format": schema}, "chat", CONTEXT).num_prompt_tokens > plain + 300


def test_a_prompt_never_counts_more_than_the_context_and_an_image_counts_as_all_of_it():
    huge = worst_case({"prompt": "x" * 10_000, "max_tokens": 10}, "completion", CONTEXT)
    assert huge.prompt_bounds == (CONTEXT,)
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}}]}
    assert worst_case({"messages": [image]}, "chat", CONTEXT).prompt_bounds == (CONTEXT,)


def test_the_cost_is_the_most_over_every_prompt_length_the_context_allows():
    # With no max_tokens, a short prompt leaves room for a long output: the worst case is not the longest prompt.
    case = worst_case(CHAT | {"n": 3}, "chat", 100)
    prices = SimpleNamespace(price_input_per_million=Decimal("1"), price_cached_input_per_million=Decimal("1"),
                             price_output_per_million=Decimal("1"))
    bound = case.prompt_bounds[0]
    brute = max(p + 3 * min(case.max_output_tokens, 100 - p) for p in range(bound + 1)) * Decimal("0.000001")
    assert case.max_cost(prices) == brute


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 300), st.integers(1, 4), st.integers(0, 400), st.data())
def test_tokens_and_cost_are_the_most_over_every_prompt_length_at_any_prices(context, n, max_output, data):
    # A guard of `WorstCase._most` (its three candidates written out for speed): against every length, by brute force.
    bounds = tuple(data.draw(st.lists(st.integers(0, context), max_size=3)))
    prices = SimpleNamespace(**{name: data.draw(st.decimals(0, 1000, places=4)) for name in (
        "price_input_per_million", "price_cached_input_per_million", "price_output_per_million")})
    case = WorstCase(prompt_bounds=bounds, num_sequences=n, max_output_tokens=max_output, max_model_len=context)
    price_in = max(prices.price_input_per_million, prices.price_cached_input_per_million) * Decimal("0.000001")
    price_out = prices.price_output_per_million * Decimal("0.000001")

    def most(bound, a, b):
        return max(p * a + n * min(max_output, context - p) * b for p in range(bound + 1))

    assert case.num_tokens == sum(most(bound, 1, 1) for bound in bounds)
    assert case.max_cost(prices) == min(sum((most(bound, price_in, price_out) for bound in bounds), Decimal(0)),
                                        MAX_RESERVATION).quantize(Decimal("1e-9"), rounding=ROUND_CEILING)


def test_a_prompt_bound_outside_the_context_is_refused_wherever_it_is_listed():
    for bounds in ((11,), (-1,), (0, 11), (11, 0), (3, -1, 4)):
        with pytest.raises(ValueError):
            WorstCase(prompt_bounds=bounds, num_sequences=1, max_output_tokens=1, max_model_len=10)
    assert WorstCase(prompt_bounds=(), num_sequences=1, max_output_tokens=1, max_model_len=10).num_tokens == 0


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
                    max_leaves=20),
       st.sampled_from(["chat", "completion"]))
def test_odd_bodies_never_raise_and_stay_within_bounds(value, kind):
    payload = {"model": "m", "messages": value, "prompt": value, "n": value, "max_tokens": value, "tools": value}
    case = worst_case(payload, kind, CONTEXT)
    assert all(0 <= bound <= CONTEXT for bound in case.prompt_bounds)
    assert Decimal(0) <= case.max_cost(PRICES) <= MAX_RESERVATION


def test_a_huge_n_reserves_at_most_the_ceiling():
    assert worst_case({"prompt": "Hi", "n": 10**30}, "completion", CONTEXT).max_cost(PRICES) == MAX_RESERVATION


def test_numbers_are_read_as_the_engine_reads_them():
    assert worst_case({"prompt": "Hi", "max_tokens": 10, "n": "4"}, "completion", CONTEXT).num_output_tokens == 40
    assert worst_case({"prompt": "Hi", "max_tokens": 10.0, "n": 2.0}, "completion", CONTEXT).num_output_tokens == 20


# --- the running tally of a stream ---------------------------------------------------------------

def _chunk(index: int, prompt: int, completion: int) -> tuple[dict, bytes]:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    event = b"data: " + json.dumps({"id": "x", "choices": [{"index": index, "text": "t"}], "usage": usage},
                                   separators=(",", ":")).encode()
    return usage, event


def test_a_stream_of_many_choices_is_counted_per_choice_and_its_prompts_once_each():
    tally = UsageTally(num_choices_per_prompt=2)
    for index, prompt, completion in [(0, 5, 1), (1, 5, 1), (2, 7, 1), (0, 5, 2), (3, 7, 3), (1, 5, 4)]:
        tally.take_chunk(*_chunk(index, prompt, completion))
    assert (tally.prompt_tokens, tally.completion_tokens) == (5 + 7, 2 + 4 + 1 + 3)
    tally.take_totals({"prompt_tokens": 12, "completion_tokens": 11, "prompt_tokens_details": {"cached_tokens": 4}})
    assert (tally.prompt_tokens, tally.cached_tokens, tally.completion_tokens) == (12, 4, 11)


def test_a_stream_has_every_prompt_counted_once_each_prompt_has_an_event_with_usage():
    # A stream whose client left during its prefill reads on until this holds (`InferenceCall._relay_events`).
    tally = UsageTally(num_choices_per_prompt=2, num_prompts=2)
    assert not tally.every_prompt_counted
    tally.take_chunk(*_chunk(1, 5, 0))  # prompt 0's second choice
    assert not tally.every_prompt_counted
    tally.take_chunk(*_chunk(2, 7, 0))  # prompt 1's first choice
    assert tally.every_prompt_counted and tally.prompt_tokens == 12
    whole = UsageTally(num_prompts=3)
    whole.take_totals({"prompt_tokens": 9, "completion_tokens": 1})
    assert whole.every_prompt_counted


def test_the_separators_between_text_parts_are_reserved():
    # vLLM joins a message's text parts with "\n": 800 one-letter parts prompt ~1,600 tokens, and the estimate
    # counted ~880, so nearly half the prefill was past the reservation, and billing stops at the reservation.
    parts = [{"type": "text", "text": "a"}] * 800
    case = worst_case({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": parts}]}, "chat", CONTEXT)
    assert case.num_prompt_tokens >= len("\n".join(part["text"] for part in parts).encode())


def test_tool_call_arguments_are_reserved_as_a_template_renders_them_parsed():
    arguments = json.dumps({"a": [0] * 600}, separators=(",", ":"))
    message = {"role": "assistant", "content": None,
               "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}
    case = worst_case({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}, message]}, "chat",
                      CONTEXT)
    assert case.num_prompt_tokens >= len(json.dumps(json.loads(arguments)))  # `tojson`'s ", " and ": "


def test_a_completions_suffix_is_reserved_with_every_prompt():
    # A fill-in-the-middle renderer prefills the suffix with each prompt of a list: 8 prompts of "a" with a 30 KB
    # suffix reserved 9 tokens each.
    case = worst_case({"model": "m", "prompt": ["a"] * 8, "suffix": "x" * 30_000, "max_tokens": 1}, "completion", CONTEXT)
    assert case.prompt_bounds == (min(CONTEXT, 1 + 8 + 30_000 + 8),) * 8


@pytest.mark.parametrize("kwargs", [{"eos_token": "%" * 90}, {"bos_token": True}, {"tools": [{"name": "f"}]},
                                    {"date_string": "today"}, {"budget": 10**40}, {"enable_thinking": None}])
def test_template_kwargs_other_than_flags_reserve_the_whole_context(kwargs):
    # A template renders `eos_token` in every message: 90 bytes of it made 20 empty messages a ~2,000-token prompt on
    # the tiny model against a bound of ~580, the rest unbilled. Any text, number or list may sit in such a loop.
    messages = [{"role": "user", "content": ""}] * 20
    case = worst_case({"model": "m", "max_tokens": 1, "messages": messages, "chat_template_kwargs": kwargs}, "chat",
                      CONTEXT)
    assert case.prompt_bounds == (CONTEXT,)
    responses = worst_case({"model": "m", "input": messages, "chat_template_kwargs": kwargs}, "responses", CONTEXT)
    assert responses.prompt_bounds == (CONTEXT,)


def test_template_flags_the_engine_measured_are_bounded_by_the_measure():
    measured = (300, 20)
    flags = worst_case(CHAT | {"chat_template_kwargs": {"enable_thinking": False}}, "chat", CONTEXT, (64, 16), measured)
    assert worst_case(CHAT, "chat", CONTEXT, (64, 16), measured).num_prompt_tokens + 300 - 64 < flags.num_prompt_tokens
    assert flags.num_prompt_tokens < CONTEXT


# A Granite-like template: `thinking: true` adds ~600 bytes of system prompt to every conversation.
GRANITE = (
    "{%- set system = 'Knowledge Cutoff Date: April 2024. You are Granite, developed by IBM.' -%}"
    "{%- if thinking %}{%- set system = system + ' You are a helpful AI assistant.\\nRespond to every user query in a"
    " comprehensive and detailed way. You can write down your thoughts and reasoning process before responding. In the"
    " thought process, engage in a comprehensive cycle of analysis, summarization, exploration, reassessment,"
    " reflection, backtracing, and iteration to develop well-considered thinking process. In the response section,"
    " based on various attempts, explorations, and reflections from the thoughts section, systematically present the"
    " final solution that you deem correct. The response should summarize the thought process. Write your thoughts"
    " after Here is my thought process: and write your response after Here is my response: for each user query.' %}"
    "{%- else %}{%- set system = system + ' You are a helpful AI assistant.' %}{%- endif -%}"
    "{{- '<|start_of_role|>system<|end_of_role|>' + system + '<|end_of_text|>\\n' }}"
    "{%- for message in messages %}{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content']"
    " + '<|end_of_text|>\\n' }}{%- endfor %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}"
)


def _granite_tokens(messages, **kwargs) -> int:
    import jinja2
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import BPE

    text = jinja2.Environment().from_string(GRANITE).render(messages=messages, **kwargs)
    tokenizer = Tokenizer(BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                              merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return len(tokenizer.encode(text).ids)


def _measured_as_the_probe_does(**kwargs) -> tuple[int, int]:
    user, assistant = {"role": "user", "content": ""}, {"role": "assistant", "content": ""}
    one, two = _granite_tokens([user], **kwargs), _granite_tokens([user, assistant], **kwargs)
    return one, two - one


def test_a_flag_that_switches_on_a_long_template_block_is_reserved_for_it():
    # Granite's `thinking: true` rendered 970 tokens against a bound of 366: the flag counted its bytes alone.
    user = {"role": "user", "content": ""}
    payload = {"model": "m", "max_tokens": 1, "messages": [user], "chat_template_kwargs": {"thinking": True}}
    real = _granite_tokens([user], thinking=True)
    plain = _measured_as_the_probe_does()

    assert real > plain[0] + 400
    assert worst_case(payload, "chat", 100_000, plain).num_prompt_tokens >= real  # not measured: the context
    flagged = _measured_as_the_probe_does(thinking=True)
    assert real <= worst_case(payload, "chat", 100_000, plain, flagged).num_prompt_tokens < 100_000


@pytest.mark.parametrize("effort", ["high", "none"])
def test_a_reasoning_effort_reaches_the_template_and_is_bounded_only_once_measured(effort):
    # vLLM hands the template `reasoning_effort` and sets `enable_thinking` from it.
    chat = CHAT | {"reasoning_effort": effort}
    responses = {"model": "m", "input": "Hello", "reasoning": {"effort": effort}}
    assert worst_case(chat, "chat", CONTEXT, (64, 16)).prompt_bounds == (CONTEXT,)
    assert worst_case(responses, "responses", CONTEXT, (64, 16)).prompt_bounds == (CONTEXT,)
    assert worst_case(chat, "chat", CONTEXT, (64, 16), (500, 16)).num_prompt_tokens >= 500
    assert worst_case(responses, "responses", CONTEXT, (64, 16), (500, 16)).num_prompt_tokens >= 500
    assert worst_case(CHAT | {"reasoning_effort": "extreme"}, "chat", CONTEXT, (64, 16), (500, 16)).prompt_bounds == (
        CONTEXT,)
    other_flag = CHAT | {"chat_template_kwargs": {"add_vision_id": True}}
    assert worst_case(other_flag, "chat", CONTEXT, (64, 16), (500, 16)).prompt_bounds == (CONTEXT,)


@pytest.mark.parametrize(("normalizer", "character"), [
    ("NFC", "\U0001d160"), ("NFKC", "\ufdfa"),
    # CLIP's (an embedding model vLLM serves) lowercases after NFC: U+0130 is 2 bytes and 3 lowercased
    ({"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Lowercase"}]}, "\u0130"),
])
def test_text_a_tokenizer_normalizes_longer_is_reserved_as_it_tokenizes(tiny_model_dir, normalizer, character):
    # Qwen's tokenizers normalize NFC, XLM-R's (and its embedding models') NFKC: U+1D160 is 4 bytes and 12 once
    # normalized, U+FDFA 3 and 33. 150 of the first were 1,801 tokens against a bound of 608, the bill stopping there.
    from tokenizers import Tokenizer

    normalizer = normalizer if isinstance(normalizer, dict) else {"type": normalizer}
    spec = json.loads((tiny_model_dir / "tokenizer.json").read_text()) | {"normalizer": normalizer}
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    text = character * 150
    num_tokens = len(tokenizer.encode(text).ids)
    tools = [{"type": "function", "function": {"name": "f", "description": text}}]

    assert num_tokens > len(text.encode())
    assert worst_case({"prompt": text, "max_tokens": 1}, "completion", 100_000).num_prompt_tokens >= num_tokens
    assert worst_case({"input": [text]}, "embedding", 100_000).num_prompt_tokens >= num_tokens
    assert worst_case({"messages": [{"role": "user", "content": text}]}, "chat", 100_000).num_prompt_tokens >= num_tokens
    assert worst_case(CHAT | {"tools": tools}, "chat", 100_000).num_prompt_tokens >= num_tokens


@settings(max_examples=300, deadline=None)
@given(st.lists(st.characters(exclude_categories=("Cs",)) | st.sampled_from("\U0001d160\ufdfa\u0390\uac00e\u0301\ufb01\u0130"),
                max_size=40).map("".join))
def test_a_prompt_bound_holds_whatever_normalization_the_tokenizer_applies(text):
    bound = worst_case({"prompt": text, "max_tokens": 1}, "completion", 10**9).num_prompt_tokens
    assert bound >= max(len(rewritten.encode()) for form in ("NFC", "NFKC")
                        for rewritten in (unicodedata.normalize(form, text), unicodedata.normalize(form, text).lower()))


# Bodies up to the gateway's 8 MiB limit, of text that makes counting slow: a 7.7 MiB one held the event loop 2.8 s.
HOSTILE_CHARACTERS = 2 * 1024 * 1024
_DISTINCT = "".join(chr(c) for c in range(0x80, 0x30000) if not 0xD800 <= c <= 0xDFFF)
HOSTILE = {
    "combining marks": {"messages": [{"role": "user", "content": "e\u0301" * (HOSTILE_CHARACTERS // 2)}]},
    "tool call arguments": {"messages": [{"role": "assistant", "tool_calls": [{"id": "a", "type": "function", "function": {
        "name": "f", "arguments": json.dumps("e\u0301" * (HOSTILE_CHARACTERS // 2), ensure_ascii=False)}}]}]},
    "distinct characters": {"messages": [{"role": "assistant", "tool_calls": [{"id": "a", "type": "function", "function": {
        "name": "f", "arguments": json.dumps(_DISTINCT * (HOSTILE_CHARACTERS // len(_DISTINCT)), ensure_ascii=False)}}]}]},
    "many messages": {"messages": [{"role": "user", "content": "\ufdfa"}] * (HOSTILE_CHARACTERS // 16)},
    "many parts": {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ufdfa"}] * (HOSTILE_CHARACTERS // 32)}]},
    "a schema": {"messages": [], "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "enum": ["e\u0301"] * (HOSTILE_CHARACTERS // 8)}}}]},
}


@pytest.mark.parametrize("shape", HOSTILE)
def test_a_hostile_body_is_counted_no_further_than_the_context(shape):
    # NOTE: what it allocates measures the text it examined (normalized, dumped, encoded, counted): every such pass
    # over the whole body made a copy of it. Each shape allocated 2 MiB to 36 MiB before counting stopped at the context.
    import tracemalloc

    payload = HOSTILE[shape] | {"model": "m", "max_tokens": 1}
    worst_case({"prompt": "\ufdfa e\u0301 \u0130"}, "completion", CONTEXT)  # any table built once, outside the count
    tracemalloc.start()
    try:
        case = worst_case(payload, "chat", CONTEXT)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert case.prompt_bounds == (CONTEXT,)
    assert peak < 64 * 1024


def test_completions_and_embeddings_are_counted_no_further_than_the_context():
    import tracemalloc

    text = "\ufdfa" * (HOSTILE_CHARACTERS // 4)
    worst_case({"prompt": "\ufdfa e\u0301 \u0130"}, "completion", CONTEXT)
    tracemalloc.start()
    try:
        completion = worst_case({"prompt": [text] * 4, "suffix": text}, "completion", CONTEXT)
        embedding = worst_case({"input": [text] * 4}, "embedding", CONTEXT)
        responses = worst_case({"model": "m", "input": [{"role": "user", "content": text}] * 4}, "responses", CONTEXT)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert completion.prompt_bounds == embedding.prompt_bounds == (CONTEXT,) * 4 and responses.prompt_bounds == (CONTEXT,)
    assert peak < 64 * 1024


def test_text_in_its_normal_form_counts_its_bytes_and_full_width_forms_only_what_they_become():
    # NOTE: guards the common path (it held before as well): Chinese and composed French are their own NFC and NFKC;
    # full-width punctuation is not NFKC but shrinks to ASCII there (！ is 3 bytes, ! one).
    for text in ("我们今天讨论一下推理平台的计费问题。", "Le café était très léger, à côté."):
        assert worst_case({"prompt": text}, "completion", CONTEXT).num_prompt_tokens == len(text.encode()) + 8
    full_width = "明日（月曜日）も？"
    assert worst_case({"prompt": full_width}, "completion", CONTEXT).num_prompt_tokens == len(full_width.encode()) + 8


@pytest.mark.parametrize("kind", ["chat", "responses"])
def test_tool_call_arguments_that_are_a_json_string_are_reserved_as_the_text_they_parse_to(kind):
    # ASCII on the wire (6 bytes a character), vLLM parses it and a template renders the text raw: U+FDFA is 33 bytes
    # under NFKC. A review counted 66,163 real tokens against a bound of 14,288.
    arguments = json.dumps("\ufdfa" * 2000)
    if kind == "chat":
        body = {"model": "m", "messages": [
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]}]}
    else:
        body = {"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": arguments}]}
    assert worst_case(body, kind, 1_000_000).num_prompt_tokens >= 33 * 2000


@pytest.mark.parametrize(("kwargs", "effort"), [
    ({"thinking": True}, "high"),  # vLLM hands the template all three: the probe measured none of them together
    ({"thinking": True, "enable_thinking": False}, None),
    ({"enable_thinking": False}, "high"),
    ({"thinking": 1}, None),  # equal to True, yet a template may render the 1
])
def test_flags_and_efforts_together_are_bounded_only_as_the_engine_measured_them(kwargs, effort):
    body = CHAT | {"chat_template_kwargs": kwargs} | ({"reasoning_effort": effort} if effort else {})
    assert worst_case(body, "chat", CONTEXT, (64, 16), (500, 16)).prompt_bounds == (CONTEXT,)


def test_an_effort_with_the_enable_thinking_it_implies_is_bounded_by_the_measure():
    body = CHAT | {"chat_template_kwargs": {"enable_thinking": True}, "reasoning_effort": "high"}
    assert 500 <= worst_case(body, "chat", CONTEXT, (64, 16), (500, 16)).num_prompt_tokens < CONTEXT


@pytest.fixture
def characters_normalized(monkeypatch):
    """The characters the estimate hands Unicode normalization, and how many calls, as it counts them."""
    work = {"characters": 0, "calls": 0}
    for name in ("normalize", "is_normalized"):
        original = getattr(unicodedata, name)

        def counted(form, text, original=original):
            work["characters"] += len(text)
            work["calls"] += 1
            return original(form, text)

        monkeypatch.setattr(unicodedata, name, counted)
    return work


@pytest.mark.parametrize("kind", ["completion", "embedding"])
def test_a_request_of_many_prompts_normalizes_at_most_its_context_of_characters(kind, characters_normalized):
    # 2,048 prompts of U+FDFA, each under its own budget, stalled the loop 0.4 s: every prompt was normalized whole.
    field = "prompt" if kind == "completion" else "input"
    case = worst_case({"model": "m", field: ["\ufdfa" * 1000] * 2048}, kind, 100_000)
    assert characters_normalized["characters"] <= 4 * 100_000
    assert min(case.prompt_bounds) >= 33 * 1000


@pytest.mark.parametrize("kind", ["chat", "responses"])
def test_the_text_parts_of_a_content_list_are_normalized_in_one_pass(kind, characters_normalized):
    # 480,000 parts of "e\u0301" stalled the loop 0.8 s: each part was normalized on its own.
    if kind == "chat":
        body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "e\u0301"}] * 20_000}]}
    else:
        body = {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": "e\u0301"}] * 20_000}]}
    assert worst_case(body, kind, 1_000_000).num_prompt_tokens >= 20_000 * (3 + 1)
    assert characters_normalized["calls"] <= 64  # a chunk of 4,096 characters a call, not a part a call


def test_the_lengthening_characters_are_those_unicode_defines():
    from endpoints.gateway.estimate import LOWERCASE_GROWTH, MAX_GROWTH, TOKENIZER_NORMALIZATIONS

    def utf8(text):
        return len(text.encode("utf-8", "surrogatepass"))

    growth, most = [], 0
    for code_point in range(0x110000):
        character = chr(code_point)
        if utf8(character.lower()) > utf8(character):
            growth.append((character, utf8(character.lower()) - utf8(character)))
        forms = [character] + [unicodedata.normalize(form, character) for pair in TOKENIZER_NORMALIZATIONS for form in pair]
        most = max(most, *(utf8(text) for text in forms), *(utf8(text.lower()) for text in forms))
    assert tuple(growth) == LOWERCASE_GROWTH
    assert most == MAX_GROWTH


def test_the_estimate_imports_without_django_set_up_as_its_bench_does():
    """`bench/bench_estimate.py` imports the estimate alone: it and its normalizers need no app registry."""
    code = (
        "import sys, endpoints.gateway.estimate\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in {'django', 'controlplane', 'billing'}"
        " or m.startswith('endpoints.models')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT)},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
