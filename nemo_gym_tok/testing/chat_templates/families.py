"""Checked-in table of model families: how to recognise a template, and each family's bos/eos/stop/marker tokens."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from nemo_gym_tok.testing.tiny_model.tokenizer import QWEN_ADDED_TOKENS

if TYPE_CHECKING:
    from nemo_gym_tok.testing.chat_templates.catalog import TemplateEntry

_THINK = ("<think>", "</think>")
_QWEN_TOOLS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# Qwen2/2.5/3's added tokens in Qwen's id order, so a Qwen template's tokenizer puts them at Qwen's real ids.
_QWEN_SPECIAL = tuple(text for _, text, special in QWEN_ADDED_TOKENS if special)
_QWEN_MARKUP = tuple(text for _, text, special in QWEN_ADDED_TOKENS if not special)
_DS = "<｜{}｜>"  # DeepSeek's markers use full-width bars and U+2581 for spaces
_DEEPSEEK_SPECIAL = tuple(
    _DS.format(name.replace(" ", "▁"))
    for name in (
        "begin of sentence", "end of sentence", "User", "Assistant", "tool calls begin", "tool calls end",
        "tool call begin", "tool call end", "tool sep", "tool outputs begin", "tool outputs end",
        "tool output begin", "tool output end",
    )
)  # fmt: skip


@dataclass(frozen=True)
class Family:
    """One row: recognition rule, the tokens the family's tokenizer must hold, and kwargs its templates read.

    `special` are role/turn markers (added with special=True, like the real tokenizers); `markup` is reasoning and
    tool markup added as ordinary added tokens so it survives `skip_special_tokens` decoding, as in Qwen3.
    `end_tokens` are the generation config's stop tokens (always special). `all_of`/`any_of`/`none_of` are regexes
    on the template text; the first matching row in FAMILIES wins, so more specific rows come first.
    """

    name: str
    bos: str | None
    eos: str
    end_tokens: tuple[str, ...]
    special: tuple[str, ...] = ()
    markup: tuple[str, ...] = ()
    kwargs: tuple[str, ...] = ()
    all_of: tuple[str, ...] = ()
    any_of: tuple[str, ...] = ()
    none_of: tuple[str, ...] = ()
    # `[INST]`-style bracket markers are control tokens only in Mistral's tokenizers (plain text in Llama 2's).
    bracket_markers: bool = False
    _compiled: tuple[tuple[re.Pattern[str], ...], ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        compiled = tuple(tuple(re.compile(p) for p in group) for group in (self.all_of, self.any_of, self.none_of))
        object.__setattr__(self, "_compiled", compiled)

    def matches(self, text: str) -> bool:
        """True if every `all_of`, at least one `any_of` (when given) and no `none_of` regex occurs in `text`."""
        all_of, any_of, none_of = self._compiled
        if not (all_of or any_of):
            return False  # the generic fallback matches nothing by itself
        return (
            all(p.search(text) for p in all_of)
            and (not any_of or any(p.search(text) for p in any_of))
            and not any(p.search(text) for p in none_of)
        )


IM = r"<\|im_start\|>"
FAMILIES: tuple[Family, ...] = (
    Family("gpt_oss", bos="<|startoftext|>", eos="<|return|>", end_tokens=("<|return|>", "<|call|>", "<|endoftext|>"),
           special=("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                    "<|constrain|>", "<|return|>", "<|call|>"),
           kwargs=("reasoning_effort", "model_identity", "builtin_tools"), all_of=(r"<\|channel\|>", r"<\|start\|>")),
    Family("kimi", bos="[BOS]", eos="<|im_end|>", end_tokens=("<|im_end|>",),
           special=("[BOS]", "[EOS]", "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>",
                    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                    "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
           markup=_THINK, kwargs=("thinking", "preserve_thinking"), any_of=(r"<\|im_user\|>", r"<\|im_assistant\|>")),
    Family("deepseek_v3", bos=_DEEPSEEK_SPECIAL[0], eos=_DEEPSEEK_SPECIAL[1], end_tokens=(_DEEPSEEK_SPECIAL[1],),
           special=_DEEPSEEK_SPECIAL, markup=_THINK, kwargs=("thinking", "enable_thinking", "reasoning_effort"),
           any_of=("<｜Assistant｜>", "<｜User｜>")),
    # DeepSeek V2 (and V2.5-era chat models) spell roles as plain text and close turns with eos_token.
    Family("deepseek_v2", bos=_DEEPSEEK_SPECIAL[0], eos=_DEEPSEEK_SPECIAL[1], end_tokens=(_DEEPSEEK_SPECIAL[1],),
           special=_DEEPSEEK_SPECIAL[:2], all_of=(r"'User: '", r"'Assistant:", r"\beos_token\b", r"\bbos_token\b")),
    Family("gemma4", bos="<bos>", eos="<eos>", end_tokens=("<eos>", "<turn|>", "<|tool_response>"),
           special=("<bos>", "<eos>", "<|turn>", "<turn|>", "<|tool_response>"),
           markup=("<|think|>", "<|channel>", "<channel|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>",
                   "<tool_response|>", '<|"|>'),
           kwargs=("enable_thinking", "preserve_thinking"), all_of=(r"<\|turn>", r"<turn\|>")),
    Family("gemma", bos="<bos>", eos="<eos>", end_tokens=("<eos>", "<end_of_turn>"),
           special=("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), all_of=(r"<start_of_turn>",)),
    Family("glm4", bos=None, eos="<|endoftext|>", end_tokens=("<|endoftext|>", "<|user|>", "<|observation|>"),
           special=("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|endoftext|>"),
           markup=(*_THINK, "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<arg_key>",
                   "</arg_key>", "<arg_value>", "</arg_value>", "/nothink"),
           kwargs=("enable_thinking", "clear_thinking"), all_of=(r"\[gMASK\]",)),
    Family("phi4", bos=None, eos="<|im_end|>", end_tokens=("<|im_end|>", "<|endoftext|>"),
           special=("<|endoftext|>", "<|im_start|>", "<|im_sep|>", "<|im_end|>"), markup=_THINK,
           all_of=(r"<\|im_sep\|>",)),
    Family("phi3", bos="<s>", eos="<|endoftext|>", end_tokens=("<|end|>", "<|endoftext|>"),
           special=("<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
           all_of=(r"<\|end\|>", r"<\|assistant\|>")),
    Family("granite", bos=None, eos="<|end_of_text|>", end_tokens=("<|end_of_text|>",),
           special=("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"), markup=_THINK,
           kwargs=("thinking", "documents", "controls"), all_of=(r"<\|start_of_role\|>",)),
    Family("llama3", bos="<|begin_of_text|>", eos="<|eot_id|>",
           end_tokens=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"),
           special=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                    "<|eom_id|>", "<|python_tag|>"),
           kwargs=("date_string", "tools_in_user_message", "builtin_tools"), all_of=(r"<\|start_header_id\|>",)),
    # Nemotron-H / Nemotron Nano v2 (`<SPECIAL_10>System`), and Nemotron 3 (ChatML with Qwen3-Coder-style tool XML).
    Family("nemotron_h", bos="<s>", eos="<SPECIAL_12>", end_tokens=("<SPECIAL_12>", "</s>"),
           special=("<s>", "</s>", "<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>"),
           markup=(*_THINK, "<TOOLCALL>", "</TOOLCALL>", "<TOOL_RESPONSE>", "</TOOL_RESPONSE>"),
           all_of=(r"<SPECIAL_1[01]>",)),
    Family("nemotron3", bos=None, eos="<|im_end|>", end_tokens=("<|im_end|>",),
           special=("<|im_start|>", "<|im_end|>"), markup=(*_THINK, *_QWEN_TOOLS),
           kwargs=("enable_thinking", "truncate_history_thinking"), all_of=(IM, r"truncate_history_thinking")),
    Family("smollm3", bos=None, eos="<|im_end|>", end_tokens=("<|im_end|>", "<|end_of_text|>"),
           special=("<|im_start|>", "<|im_end|>", "<|end_of_text|>"), markup=(*_THINK, *_QWEN_TOOLS),
           kwargs=("enable_thinking", "xml_tools", "python_tools"),
           all_of=(IM, r"/no_think", r"SmolLM|Reasoning Mode")),
    # Olmo 3 (ChatML, `<functions>` tool block, `environment` role); OLMo 2 / OLMoE / Tulu 3 (`<|user|>\n` text roles).
    Family("olmo3", bos=None, eos="<|endoftext|>", end_tokens=("<|im_end|>", "<|endoftext|>"),
           special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"), markup=_THINK,
           all_of=(IM, r"<functions>")),
    Family("olmo2", bos="<|endoftext|>", eos="<|endoftext|>", end_tokens=("<|endoftext|>",),
           special=("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"),
           all_of=(r"<\|assistant\|>", r"\beos_token\b"), none_of=(r"<\|end\|>",)),
    Family("minimax", bos="]~!b[", eos="[e~[", end_tokens=("[e~[",), special=("]~!b[", "]~b]", "[e~["),
           markup=(*_THINK, "<minimax:tool_call>", "</minimax:tool_call>"), kwargs=("model_identity",),
           all_of=(r"\]~b\]",)),
    Family("exaone", bos=None, eos="[|endofturn|]", end_tokens=("[|endofturn|]",),
           special=("[|system|]", "[|user|]", "[|assistant|]", "[|tool|]", "[|endofturn|]"), markup=_THINK,
           kwargs=("enable_thinking",), any_of=(r"\[\|assistant\|\]", r"\[\|endofturn\|\]")),
    Family("cohere", bos="<BOS_TOKEN>", eos="<|END_OF_TURN_TOKEN|>", end_tokens=("<|END_OF_TURN_TOKEN|>",),
           special=("<BOS_TOKEN>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|SYSTEM_TOKEN|>",
                    "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>"),
           kwargs=("documents", "reasoning"), all_of=(r"<\|START_OF_TURN_TOKEN\|>",)),
    Family("mistral", bos="<s>", eos="</s>", end_tokens=("</s>",),
           special=("<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[AVAILABLE_TOOLS]",
                    "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[ARGS]", "[CALL_ID]"),
           markup=("[THINK]", "[/THINK]"), kwargs=("reasoning_effort",),
           any_of=(r"\[/?INST\]", r"\[SYSTEM_PROMPT\]"), none_of=(r"<<SYS>>",), bracket_markers=True),
    # Llama 2 / CodeLlama: `[INST]` and `<<SYS>>` are plain text for that tokenizer; only <s>/</s> are special.
    Family("llama2", bos="<s>", eos="</s>", end_tokens=("</s>",), special=("<s>", "</s>"),
           all_of=(r"\[/?INST\]",)),
    # Qwen rows: 3.5/3.6 (vision + XML tool calls + thinking), Qwen3-Coder (XML tool calls), Qwen3 (thinking),
    # then Qwen2/2.5 (ChatML plus a Qwen fingerprint). All share Qwen's added-token order.
    Family("qwen3_5", bos=None, eos="<|im_end|>", end_tokens=("<|im_end|>", "<|endoftext|>"),
           special=_QWEN_SPECIAL, markup=_QWEN_MARKUP, kwargs=("enable_thinking", "preserve_thinking", "add_vision_id"),
           all_of=(IM, r"<function=", r"<\|vision_start\|>", r"enable_thinking")),
    Family("qwen3_coder", bos=None, eos="<|im_end|>", end_tokens=("<|im_end|>", "<|endoftext|>"),
           special=_QWEN_SPECIAL, markup=_QWEN_MARKUP, kwargs=("enable_thinking",), all_of=(IM, r"<function=")),
    Family("qwen3", bos=None, eos="<|im_end|>", end_tokens=("<|im_end|>", "<|endoftext|>"),
           special=_QWEN_SPECIAL, markup=_QWEN_MARKUP, kwargs=("enable_thinking",),
           all_of=(IM,), any_of=(r"reasoning_content", r"enable_thinking", r"<think>")),
    # Qwen2/2.5 and the non-thinking Qwen3 templates (Instruct-2507, VL, Omni, ASR): ChatML + a Qwen fingerprint.
    Family("qwen2_5", bos=None, eos="<|im_end|>", end_tokens=("<|im_end|>", "<|endoftext|>"),
           special=_QWEN_SPECIAL, markup=_QWEN_MARKUP, kwargs=("add_vision_id",), all_of=(IM,),
           any_of=(r"Qwen", r"Alibaba", r"<\|vision_start\|>", r"<\|audio_bos\|>", r"<tool_call>",
                   r"reason step by step", r"You are a helpful assistant\.<\|im_end\|>")),
    Family("chatml", bos=None, eos="<|im_end|>", end_tokens=("<|im_end|>",), special=("<|im_start|>", "<|im_end|>"),
           all_of=(IM,)),
)  # fmt: skip

# Fallback for unrecognised templates; `classify` fills in bos/eos/end tokens from what the template references.
GENERIC = Family("generic", bos=None, eos="</s>", end_tokens=("</s>",))

_BY_NAME = {family.name: family for family in (*FAMILIES, GENERIC)}
# What marks the end of a turn in an unrecognised template's markers, most telling first (for its eos).
_END_HINTS = tuple(re.compile(p, re.I) for p in (
    r"eot|end_of_turn|endofturn", r"im_end|role_end|assistant_end", r"end.of.sentence|end_of_text|endoftext",
    r"[<|｜]eos[|｜>]|hy_eos", r"<\|end\|>",
))  # fmt: skip


# A template that sets `eos_token` to a marker-shaped literal writes that string where the model's eos goes.
_DECLARED_EOS = re.compile(r"set\s+eos_token\s*=\s*'(<[^'\s{}<>]{1,48}>)'")


def family(name: str) -> Family:
    """The table row called `name` (including `generic`); KeyError if unknown."""
    return _BY_NAME[name]


def _generic_for(text: str) -> Family:
    """The generic row specialised to one template: bos/eos/stop tokens from the markers it references."""
    from nemo_gym_tok.testing.chat_templates.tokenizer import extract_markers  # lazy: tokenizer imports this module

    markers = [marker for marker, _ in extract_markers(text, GENERIC)]
    enders = [m for hint in _END_HINTS for m in markers if hint.search(m)]
    declared = _DECLARED_EOS.search(text)  # the template names its own eos (Hy-MT2: `set eos_token = '<eos:…>'`)
    eos = declared.group(1) if declared else enders[0] if enders else "</s>"
    bos = "<s>" if re.search(r"\bbos_token\b", text) else None
    ends = tuple(dict.fromkeys((eos, *enders)))
    return replace(GENERIC, bos=bos, eos=eos, end_tokens=ends, special=tuple(t for t in (bos, eos) if t))


def classify(text: str) -> Family:
    """The first (most specific) table row whose rule matches the template text, else the generic fallback."""
    for row in FAMILIES:
        if row.matches(text):
            return row
    return _generic_for(text)


def family_of(entry: TemplateEntry) -> Family:
    """`classify` applied to a catalog entry's template text."""
    return classify(entry.text)
