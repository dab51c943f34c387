"""A prompt to a model whose tokenizer decomposes, replaces or prepends is reserved for what its tokenizer makes of
it (`endpoints.gateway.normalizers`), counted by the tokenizer itself (Hugging Face `tokenizers`, as vLLM runs it)
on the tiny model's byte-level BPE with each normalizer put in."""

from __future__ import annotations

import json
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from endpoints.gateway.directory import _endpoint_info
from endpoints.gateway.estimate import worst_case
from endpoints.gateway.normalizers import prompt_normalizer
from endpoints.models import ModelFacts, merged_claims
from gpu_agent.protocol import NormalizerStep, TokenizerNormalizer
from gpu_agent.runtime.tokenizer_normalizer import describe_normalizer, describe_tokenizer
from tests.agent.conftest import sentencepiece_charsmap
from tests.factories import EndpointFactory
from tests.gateway.test_estimate import HOSTILE

CONTEXT = 100_000
NFD = {"type": "NFD"}
NFKD = {"type": "NFKD"}
LLAMA = {
    "type": "Sequence",
    "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
    ],
}
NORMALIZERS = {
    "NFD": NFD,
    "NFKD": NFKD,
    "Llama's prepend and replace": LLAMA,
    "NFD, prepend and replace": {"type": "Sequence", "normalizers": [NFD, *LLAMA["normalizers"]]},
    "NFKC then a replacement": {
        "type": "Sequence",
        "normalizers": [
            {"type": "NFKC"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581\u2581"},
        ],
    },
    "NFKD, lowercase, then a replacement": {
        "type": "Sequence",
        "normalizers": [
            NFKD,
            {"type": "Lowercase"},
            {"type": "Replace", "pattern": {"String": "ab"}, "content": "\ufdfa"},
        ],
    },
    "a replacement, then NFKD": {
        "type": "Sequence",
        "normalizers": [{"type": "Replace", "pattern": {"String": "x"}, "content": "\ufdfa"}, NFKD],
    },
    # Mistral's newer conversions: "▁" for a space in pre-tokenizing; here the tiny model's bytes take it after
    "Metaspace, then bytes": (
        None,
        {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            ],
        },
    ),
    # XLM-R's: NFKC (its precompiled map's), runs of spaces made one, then Metaspace
    "XLM-R's": (
        {
            "type": "Sequence",
            "normalizers": [
                {"type": "NFKC"},
                {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "},
            ],
        },
        {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
    ),
    # BERT's clean-up makes a space of "\n" and "\t", which a later replacement lengthens (1 byte to 3)
    "BERT's clean-up, then a replacement": {
        "type": "Sequence",
        "normalizers": [
            {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": False, "lowercase": False},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
        ],
    },
    # XLM-R's own: sentencepiece's nmt_nfkc map (a newline becomes a space), then Metaspace
    "XLM-R's precompiled map": (
        {"type": "Precompiled", "precompiled_charsmap": sentencepiece_charsmap("nmt_nfkc")},
        {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
    ),
    # A pre-tokenizer's prepend after a splitter: one per piece, and a piece may be one character
    "Digits, then Metaspace": (
        None,
        {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Digits", "individual_digits": True},
                {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            ],
        },
    ),
    "a Split, then a prefix-space ByteLevel": (
        None,
        {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": "."}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": False},
            ],
        },
    ),
    "BERT's": {
        "type": "BertNormalizer",
        "clean_text": True,
        "handle_chinese_chars": True,
        "strip_accents": None,
        "lowercase": True,
    },
}
# Text a tokenizer lengthens: composed Hangul and Latin (NFD: "가" 3 bytes, 6 as jamo), spaces (1 byte, "▁" 3).
KOREAN = "가나다라마바사아자차카타파하" * 10
SPACED = "a " * 300


@pytest.fixture(scope="module")
def tiny_tokenizer_spec(tiny_model_dir) -> dict:
    return json.loads((tiny_model_dir / "tokenizer.json").read_text())


def _parts(tokenizer) -> tuple:
    """(normalizer, pre-tokenizer) of a `NORMALIZERS` entry: a normalizer, or both."""
    return tokenizer if isinstance(tokenizer, tuple) else (tokenizer, None)


def _tokens(spec: dict, tokenizer, text: str) -> int:
    from tokenizers import Tokenizer

    normalizer, pre_tokenizer = _parts(tokenizer)
    changed = {"normalizer": normalizer} | ({"pre_tokenizer": pre_tokenizer} if pre_tokenizer else {})
    return len(Tokenizer.from_str(json.dumps(spec | changed)).encode(text).ids)


def _bound(text: str, tokenizer) -> int:
    rewrites = (
        None if tokenizer is None else prompt_normalizer(describe_normalizer(*_parts(tokenizer)).to_dict())
    )
    return worst_case(
        {"prompt": text, "max_tokens": 1}, "completion", CONTEXT, normalizer=rewrites
    ).num_prompt_tokens


@pytest.mark.parametrize(
    ("normalizer", "text"),
    [
        (NFD, KOREAN),
        (NFD, "\u00e9" * 300),
        (NFKD, KOREAN),
        (LLAMA, SPACED),
        (NORMALIZERS["Metaspace, then bytes"], SPACED),
        (NORMALIZERS["BERT's clean-up, then a replacement"], "\n\t" * 250),
        (NORMALIZERS["XLM-R's precompiled map"], "\n" * 300),
        (NORMALIZERS["Digits, then Metaspace"], "0123456789" * 38),
        (NORMALIZERS["a Split, then a prefix-space ByteLevel"], "~" * 800),
    ],
)
def test_text_a_tokenizer_lengthens_was_free_past_the_bound_and_is_now_reserved(
    tiny_tokenizer_spec, normalizer, text
):
    # 140 Hangul syllables (420 bytes, already NFC) were 841 tokens behind NFD against a bound of 428; 300 spaces
    # behind Llama's Replace(" ", "▁") 1,204 against 608: half the prompt unbilled.
    num_tokens = _tokens(tiny_tokenizer_spec, normalizer, text)

    assert _bound(text, None) < num_tokens  # the bound for every model: what the tokenizer makes is past it
    assert _bound(text, normalizer) >= num_tokens


@pytest.mark.parametrize("name", NORMALIZERS)
@settings(max_examples=150, deadline=None)
@given(
    text=st.lists(
        st.characters(codec="utf-8", exclude_categories=("Cs",))
        | st.sampled_from(
            [
                "가",
                "\u00e9",
                "e\u0301",
                " ",
                "ab",
                "AB",
                "x",
                "\ufdfa",
                "\u1e9b",
                "\u337f",
                "\u3000",
                "\n",
                "\t",
                "\u2028",
                "<s>",
                "\u0130",
                "日本",
            ]
        ),
        max_size=40,
    ).map("".join)
)
def test_a_prompt_bound_holds_for_what_the_tokenizer_makes_of_any_text(tiny_tokenizer_spec, name, text):
    assert _bound(text, NORMALIZERS[name]) >= _tokens(tiny_tokenizer_spec, NORMALIZERS[name], text)


@pytest.mark.parametrize("kind", ["chat", "embedding"])
def test_a_chat_or_embedding_is_reserved_for_what_the_tokenizer_makes_of_it(tiny_tokenizer_spec, kind):
    rewrites = prompt_normalizer(describe_normalizer(NORMALIZERS["NFD, prepend and replace"]).to_dict())
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "description": SPACED,
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "description": KOREAN}},
                },
            },
        }
    ]
    payload = (
        {"messages": [{"role": "user", "content": KOREAN + SPACED}], "tools": tools}
        if kind == "chat"
        else {"input": [KOREAN + SPACED]}
    )
    rendered = KOREAN + SPACED + (json.dumps(tools, indent=4, ensure_ascii=False) if kind == "chat" else "")

    real = _tokens(tiny_tokenizer_spec, NORMALIZERS["NFD, prepend and replace"], rendered)

    assert worst_case(payload, kind, CONTEXT).num_prompt_tokens < real
    assert worst_case(payload, kind, CONTEXT, normalizer=rewrites).num_prompt_tokens >= real


@pytest.mark.parametrize(
    "normalizer",
    [
        {"type": "SomethingNew"},
        # matches nothing: lengthens every position
        {"type": "Replace", "pattern": {"Regex": "a*"}, "content": "b"},
        {
            "type": "Sequence",
            "normalizers": [
                {"type": "Replace", "pattern": {"String": "a"}, "content": "bb"},
                {"type": "Replace", "pattern": {"String": "b"}, "content": "ccc"},
            ],
        },
        {
            "type": "Sequence",
            "normalizers": [NFKD, {"type": "Replace", "pattern": {"String": "\u0301"}, "content": "xx"}],
        },
    ],
)
def test_a_normalizer_nothing_bounds_reserves_the_context(normalizer):
    rewrites = prompt_normalizer(describe_normalizer(normalizer).to_dict())

    assert rewrites.unbounded
    assert worst_case(
        {"prompt": "a", "max_tokens": 1}, "completion", 4096, normalizer=rewrites
    ).prompt_bounds == (4096,)
    assert worst_case(
        {"messages": [{"role": "user", "content": "a"}]}, "chat", 4096, normalizer=rewrites
    ).prompt_bounds == (4096,)


@pytest.mark.parametrize(
    "normalizer",
    [
        None,
        {"type": "NFC"},
        {"type": "NFKC"},
        {"type": "Lowercase"},
        {"type": "Strip", "left": True, "right": True},
        # XLM-R's (and its embedding models'): runs of spaces made one
        {
            "type": "Sequence",
            "normalizers": [
                {"type": "NFKC"},
                {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "},
            ],
        },
    ],
)
def test_a_model_whose_tokenizer_adds_nothing_new_or_says_nothing_is_counted_as_before(normalizer):
    # None: an agent older than the report (`ModelFacts.tokenizer_normalizer` null).
    description = None if normalizer is None else describe_normalizer(normalizer).to_dict()

    assert prompt_normalizer(description) is None


@pytest.mark.parametrize("shape", HOSTILE)
@pytest.mark.parametrize(
    "name", ["NFD, prepend and replace", "NFKD, lowercase, then a replacement", "BERT's"]
)
def test_a_hostile_body_to_a_rewriting_tokenizer_is_counted_no_further_than_the_context(shape, name):
    # As for every model (`test_estimate`): what it allocates measures the text it examined.
    import tracemalloc

    rewrites = prompt_normalizer(describe_normalizer(NORMALIZERS[name]).to_dict())
    payload = HOSTILE[shape] | {"model": "m", "max_tokens": 1}
    worst_case({"prompt": "\ufdfa e\u0301 \u0130"}, "completion", 4096, normalizer=rewrites)
    tracemalloc.start()
    try:
        case = worst_case(payload, "chat", 4096, normalizer=rewrites)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert case.prompt_bounds == (4096,)
    assert peak < 64 * 1024


@pytest.mark.django_db
def test_the_gateway_reads_the_normalizer_an_agent_reported_once_with_the_endpoint():
    endpoint = EndpointFactory()
    assert _endpoint_info(endpoint).prompt_normalizer is None  # nothing reported yet: counted as before

    ModelFacts.objects.create(
        source=endpoint.model_source,
        scope=endpoint.weights_scope,
        tokenizer_normalizer=describe_normalizer(NFD).to_dict(),
    )

    assert _endpoint_info(endpoint).prompt_normalizer.decomposes
    assert _endpoint_info(endpoint, for_calls=False).prompt_normalizer is None  # /v1/models reserves nothing


def test_decomposition_is_counted_only_for_a_tokenizer_that_decomposes():
    # NFC text already composed: for every other model its bytes alone, as before (~4x the work on everyday text).
    assert unicodedata.is_normalized("NFC", KOREAN)
    assert _bound(KOREAN, None) == len(KOREAN.encode()) + 8
    assert _bound(KOREAN, NFD) > 2 * len(KOREAN.encode())


# --- tools and schemas, counted per string; a request's passes over ASCII text --------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a given city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
WEATHER_QUESTION = [
    {"role": "user", "content": "What is the weather like in Paris today? One short sentence."}
]
LLAMA_2_STYLE = {
    "steps": [
        {"kind": "prepend", "content": "\u2581"},
        {"kind": "replace", "pattern": " ", "content": "\u2581"},
    ],
    "segment_starts": "<[",
}


def test_eight_small_tools_to_a_llama_2_style_tokenizer_are_reserved_near_what_their_text_makes():
    # Every byte of the tools' JSON was counted as an occurrence and a piece: 6,852 tokens became the whole 32k.
    body = {"messages": WEATHER_QUESTION, "tools": [WEATHER_TOOL] * 8, "max_tokens": 256}
    plain = worst_case(body, "chat", 32_768).num_prompt_tokens
    rewritten = worst_case(
        body, "chat", 32_768, normalizer=prompt_normalizer(LLAMA_2_STYLE)
    ).num_prompt_tokens

    assert plain < rewritten < 2.5 * plain < 32_768


def test_tools_are_reserved_for_what_the_tokenizer_makes_of_them_rendered(tiny_tokenizer_spec):
    # The JSON a template renders (indented, as `tojson(indent=4)` does), through Llama's normalizer.
    tools = [WEATHER_TOOL] * 3
    rendered = json.dumps(tools, indent=4)
    counted = _tokens(tiny_tokenizer_spec, LLAMA, rendered)
    rewrites = prompt_normalizer(describe_normalizer(LLAMA).to_dict())
    body = {"messages": [{"role": "user", "content": ""}], "tools": tools}

    assert worst_case(body, "chat", CONTEXT, normalizer=rewrites).num_prompt_tokens >= counted


def test_a_prepend_counted_by_more_than_eight_added_tokens_first_characters_reserves_the_context():
    # Each first character is a pass over every ASCII text of a request.
    description = {"steps": [{"kind": "prepend", "content": "\u2581"}], "segment_starts": "<[{(|!#$%"}

    assert prompt_normalizer(description).unbounded


def test_text_past_the_requests_ascii_scans_is_counted_unread_and_still_bounds_it(
    tiny_tokenizer_spec, monkeypatch
):
    from endpoints.gateway import estimate

    prompts = ["a b<s>c " * 40] * 12
    counted = sum(_tokens(tiny_tokenizer_spec, LLAMA, prompt) for prompt in prompts)
    rewrites = prompt_normalizer(describe_tokenizer(tiny_tokenizer_spec | {"normalizer": LLAMA}).to_dict())
    body = {"prompt": prompts, "max_tokens": 1}
    read = worst_case(body, "completion", CONTEXT, normalizer=rewrites).num_prompt_tokens
    monkeypatch.setattr(estimate, "ASCII_SCAN_ALLOWANCE", 1000)  # two prompts' worth of passes

    unread = worst_case(body, "completion", CONTEXT, normalizer=rewrites).num_prompt_tokens

    assert counted <= read < unread


# --- a post-processor's special tokens -------------------------------------------------------------------------------


def test_a_post_processor_adding_500_special_tokens_a_prompt_is_counted_for_them(tiny_tokenizer_spec):
    from tokenizers import Tokenizer

    post_processor = dict(tiny_tokenizer_spec["post_processor"])
    post_processor["single"] = [{"SpecialToken": {"id": "<s>", "type_id": 0}}] * 500 + [
        {"Sequence": {"id": "A", "type_id": 0}}
    ]
    spec = tiny_tokenizer_spec | {"post_processor": post_processor}
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    prompts = ["a"] * 4
    counted = sum(len(tokenizer.encode(prompt, add_special_tokens=True).ids) for prompt in prompts)
    rewrites = prompt_normalizer(describe_tokenizer(json.loads(tokenizer.to_str())).to_dict())

    bound = worst_case({"prompt": prompts, "max_tokens": 1}, "completion", 4096, normalizer=rewrites)

    assert bound.num_prompt_tokens >= counted  # 2,004 tokens were bounded by 36


def test_a_post_processor_repeating_the_text_reserves_every_prompt_as_the_context(tiny_tokenizer_spec):
    from tokenizers import Tokenizer

    post_processor = dict(tiny_tokenizer_spec["post_processor"])
    post_processor["single"] = [{"Sequence": {"id": "A", "type_id": 0}}] * 20
    tokenizer = Tokenizer.from_str(json.dumps(tiny_tokenizer_spec | {"post_processor": post_processor}))
    counted = len(
        tokenizer.encode("hello world " * 10, add_special_tokens=False).ids
    )  # a chat's, no specials asked
    rewrites = prompt_normalizer(describe_tokenizer(json.loads(tokenizer.to_str())).to_dict())

    bound = worst_case(
        {"messages": [{"role": "user", "content": "hello world " * 10}]}, "chat", 4096, normalizer=rewrites
    )

    assert counted > 400  # twenty times the text
    assert bound.prompt_bounds == (4096,)


def test_a_sequence_of_templates_taking_the_first_ones_pieces_as_a_pair_reserves_the_context(
    tiny_tokenizer_spec,
):
    from tokenizers import Tokenizer

    # `tokenizers` hands the second template one encoding per piece of the first's (`<s>`, the text): a pair.
    twenty_times = {
        "type": "TemplateProcessing",
        "single": [{"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}] + [{"Sequence": {"id": "B", "type_id": 0}}] * 20,
        "special_tokens": {},
    }
    post_processor = {"type": "Sequence", "processors": [tiny_tokenizer_spec["post_processor"], twenty_times]}
    tokenizer = Tokenizer.from_str(json.dumps(tiny_tokenizer_spec | {"post_processor": post_processor}))
    prompt = " ".join(["a"] * 500)
    counted = len(tokenizer.encode(prompt, add_special_tokens=True).ids)
    rewrites = prompt_normalizer(describe_tokenizer(json.loads(tokenizer.to_str())).to_dict())

    bound = worst_case({"prompt": prompt, "max_tokens": 1}, "completion", CONTEXT, normalizer=rewrites)

    assert counted > 20 * 500  # the text twenty times over, and a BOS
    assert bound.num_prompt_tokens >= counted  # 10,001 tokens were bounded by 1,007


def test_a_chat_asking_for_special_tokens_is_counted_for_the_post_processors(tiny_tokenizer_spec):
    from tokenizers import Tokenizer

    post_processor = dict(tiny_tokenizer_spec["post_processor"])
    post_processor["single"] = [{"SpecialToken": {"id": "<s>", "type_id": 0}}] * 500 + [
        {"Sequence": {"id": "A", "type_id": 0}}
    ]
    tokenizer = Tokenizer.from_str(json.dumps(tiny_tokenizer_spec | {"post_processor": post_processor}))
    rewrites = prompt_normalizer(describe_tokenizer(json.loads(tokenizer.to_str())).to_dict())
    body = {"messages": [{"role": "user", "content": "a"}]}

    plain = worst_case(body, "chat", 4096, normalizer=rewrites).num_prompt_tokens
    asking = worst_case(
        body | {"add_special_tokens": True}, "chat", 4096, normalizer=rewrites
    ).num_prompt_tokens

    assert asking >= plain + 500


def test_a_post_processor_adding_a_bos_alone_leaves_the_model_counted_as_before(tiny_tokenizer_spec):
    assert tiny_tokenizer_spec["post_processor"] is not None
    assert prompt_normalizer(describe_tokenizer(tiny_tokenizer_spec).to_dict()) is None


def test_a_copy_whose_replicas_read_two_tokenizers_bounds_each_prompt_by_the_larger_of_its_two_bounds():
    # One tokenizer makes each space 9 "▁", the other decomposes Hangul (3 bytes to 9): a list with a prompt of each
    # is reserved each prompt's larger bound (not the larger total of either, which leaves one prompt short; not the
    # context, as before: 2 x 100,000).
    spaces = TokenizerNormalizer(steps=[NormalizerStep(kind="replace", pattern=" ", content="\u2581" * 9)])
    decomposing = TokenizerNormalizer(steps=[NormalizerStep(kind="decompose")])
    differing = merged_claims(
        {
            "node-1": {"tokenizer_normalizer": spaces.to_dict()},
            "node-2": {"tokenizer_normalizer": decomposing.to_dict()},
        }
    )["tokenizer_normalizer"]
    payload = {"prompt": [" " * 1000, "\uac00" * 1000], "max_tokens": 1}

    bounds = worst_case(payload, "completion", CONTEXT, normalizer=prompt_normalizer(differing)).prompt_bounds

    by_spaces = worst_case(payload, "completion", CONTEXT, normalizer=prompt_normalizer(spaces.to_dict()))
    by_decomposing = worst_case(
        payload, "completion", CONTEXT, normalizer=prompt_normalizer(decomposing.to_dict())
    )
    assert bounds == (by_spaces.prompt_bounds[0], by_decomposing.prompt_bounds[1])
    assert bounds[0] > by_decomposing.prompt_bounds[0] and bounds[1] > by_spaces.prompt_bounds[1]
    assert sum(bounds) < CONTEXT
    # a gateway that reads no alternatives (the previous version, mid-deploy) sees an unknown tokenizer: the context
    assert TokenizerNormalizer.from_dict(differing).unknown


def _four_differing_tokenizers():
    """Four descriptions a copy's replicas may read (each decomposes, then makes a space k "▁"), kept together."""
    each = {
        f"node-{k}": {
            "tokenizer_normalizer": TokenizerNormalizer(
                steps=[
                    NormalizerStep(kind="decompose"),
                    NormalizerStep(kind="replace", pattern=" ", content="\u2581" * k),
                ]
            ).to_dict()
        }
        for k in range(1, 5)
    }
    return merged_claims(each)["tokenizer_normalizer"], each["node-4"]["tokenizer_normalizer"]


def test_tokenizers_that_differ_share_one_allowance_of_characters_to_normalize(monkeypatch):
    # A list of U+FDFA prompts (18 characters each decomposed) past the context's allowance: four tokenizers each with
    # a whole allowance normalized four times what one does (the event loop held 4 times as long).
    from endpoints.gateway import estimate

    normalized = []

    class CountingUnicodedata:
        is_normalized = staticmethod(unicodedata.is_normalized)

        @staticmethod
        def normalize(form, text):
            decomposed = unicodedata.normalize(form, text)
            normalized.append(len(text) + len(decomposed))
            return decomposed

    monkeypatch.setattr(estimate, "unicodedata", CountingUnicodedata)
    differing, one = _four_differing_tokenizers()
    payload = {"prompt": ["\ufdfa"] * 20_000, "max_tokens": 1}
    context = 131_072

    worst_case(payload, "completion", context, normalizer=prompt_normalizer(one))
    by_one, normalized[:] = sum(normalized), []
    case = worst_case(payload, "completion", context, normalizer=prompt_normalizer(differing))
    by_four = sum(normalized)

    assert len(prompt_normalizer(differing).alternatives) == 4
    # each share may end a text past it: one U+FDFA read, then decomposed (NFD: 1 character, NFKD: 18) more each
    assert by_four <= by_one + 4 * (1 + 1 + 1 + 18)
    # past its share a prompt counts unread, never less than the one tokenizer counts it
    by_one_alone = worst_case(payload, "completion", context, normalizer=prompt_normalizer(one)).prompt_bounds
    assert all(shared >= alone for shared, alone in zip(case.prompt_bounds, by_one_alone, strict=True))


def test_a_list_of_more_prompts_than_the_context_shared_among_differing_tokenizers_reserves_each_the_context(
    monkeypatch,
):
    # The later tokenizers read the texts again only while all their reads stay within one context (2,048 here)
    from endpoints.gateway import estimate

    counted = []
    rewritten_bytes = estimate._rewritten_bytes

    def counting(text, budget, rewrites):
        counted.append(text)
        return rewritten_bytes(text, budget, rewrites)

    monkeypatch.setattr(estimate, "_rewritten_bytes", counting)
    differing, _ = _four_differing_tokenizers()
    rewrites = prompt_normalizer(differing)

    few = worst_case({"prompt": ["a b"] * 600, "max_tokens": 1}, "completion", 2048, normalizer=rewrites)
    assert len(counted) == 4 * 600
    assert (
        few.prompt_bounds == (3 + 11 + 8,) * 600
    )  # the largest: a space made 4 "▁" (12 bytes) by the fourth
    counted.clear()
    many = worst_case({"prompt": ["a b"] * 3000, "max_tokens": 1}, "completion", 2048, normalizer=rewrites)
    assert len(counted) == 3000
    assert many.prompt_bounds == (2048,) * 3000
