"""What a chat content part is to the engine: its kind, told as vLLM tells it, for the part checks and the estimate.

vLLM 0.32 (`vllm/renderers/chat_utils.py`, `_parse_chat_message_content_mm_part`) reads a part by its `type` only
while the part has no `uuid`. A part with a `uuid` (or with no `type`) is read by its keys: the first of `UUID_KEYS`
it has decides its kind, whatever its `type` says, and with none of them the engine refuses it. So
`{"type": "text", "text": "x", "uuid": "u1", "image_url": ...}` is an image to the engine (with `"image_url": null`,
the caller's cached image of that uuid); it was reserved as its one character of text, the image prefilled unbilled
(found by a review). Without a `uuid`, `{"type": "text", "text": "x", "image_url": null}` is text to the engine, and
passes: a null carries no media. OpenAI's API has no part that carries two kinds of content or names a kind its `type` does not,
so the gateway refuses such a part (`mismatch`) rather than pricing it, and the estimate reads a part's text only when
`kind_of` says it is text.
"""

from __future__ import annotations

# The part types vLLM reads by their `type` (its `MM_PARSER_MAP`).
PARSED_TYPES = frozenset({
    "text", "thinking", "input_text", "output_text", "refusal", "input_image", "image_url", "image_embeds",
    "audio_embeds", "video_embeds", "prompt_embeds", "image_pil", "audio_url", "input_audio", "video_url",
    "tool_reference",
})  # fmt: skip
# The keys that decide the kind of a part with a `uuid`, in the order vLLM tries them.
UUID_KEYS = (
    "image_url", "image_pil", "image_embeds", "audio_embeds", "video_embeds", "prompt_embeds", "audio_url",
    "input_audio", "video_url", "tool_reference",
)  # fmt: skip
# The keys that make a part multimodal to vLLM whatever its `type` (its `_MEDIA_CONTENT_PART_KEYS`).
MEDIA_KEYS = PARSED_TYPES - {"text", "thinking", "input_text", "output_text", "refusal", "tool_reference"}
# The media key a part of each type carries its content in, where it is not the type's own name.
_CARRIER_KEYS = {"input_image": "image_url"}


def kind_of(part) -> str | None:
    """The kind vLLM takes `part` for (a type of `PARSED_TYPES`, or the unknown type it then refuses); None where it
    refuses the part for having no kind (a `uuid` or no `type`, and none of `UUID_KEYS`)."""
    if isinstance(part, str):
        return "text"
    if not isinstance(part, dict):
        return None
    declared = part.get("type")
    if isinstance(declared, str) and declared in PARSED_TYPES and part.get("uuid") is None:
        return declared
    if declared is None or part.get("uuid") is not None:
        return next((key for key in UUID_KEYS if key in part), None)
    return declared if isinstance(declared, str) else None


def mismatch(part: dict) -> str | None:
    """Why vLLM would not read `part` (whose `type` is a string) as the one kind its `type` names: what it carries
    or names besides (a sentence's end), or None."""
    has_uuid = part.get("uuid") is not None
    if not has_uuid and MEDIA_KEYS.isdisjoint(part):  # text, the common part: read by its `type`
        return None
    declared = part["type"]
    carried = _CARRIER_KEYS.get(declared, declared)
    # NOTE: without a `uuid` the engine reads the part by its `type` alone, and a media key set to null carries
    # nothing (clients generated from OpenAI's schema send every optional field, nulls included); with one, it reads
    # the part by which keys it has, null or not.
    stray = sorted(key for key in MEDIA_KEYS & part.keys() if key != carried and (has_uuid or part[key] is not None))
    if stray:
        return f"it also carries {', '.join(repr(key) for key in stray)}"
    kind = kind_of(part)
    if kind is None:
        return "it names a 'uuid' but carries no media for it"
    if kind != declared:
        return f"with its 'uuid', the engine reads it as {kind!r}"
    return None
