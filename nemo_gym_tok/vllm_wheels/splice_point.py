"""Whether a vLLM release's chat rendering still reaches the step the hook splices at, read from its source."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass

from nemo_gym_tok.vllm.internals import PATCHED_METHODS
from nemo_gym_tok.vllm_wheels.wheel_source import (
    MAX_HOPS,
    FunctionNode,
    SourceReader,
    calls,
    is_call_of,
    parameter_names,
)

# The splice point: preprocess_chat -> renderer.render_chat_async -> self.tokenize_prompts_async (wrapped by the hook)
# -> ... -> self._tokenize_singleton_prompt_async, which leaves a prompt holding PROMPT_IDS_KEY untokenized.
TOKENIZE_METHOD = "tokenize_prompts_async"
RENDER_CHAT_METHOD = "render_chat_async"
SINGLETON_METHOD = "_tokenize_singleton_prompt_async"
PROMPT_IDS_KEY = "prompt_token_ids"
# preprocess_chat's request-parser class parameter, and the call that hands a built parser the prompt ids (0.33+).
PARSER_PARAMETER = "parser"
PARSER_PROMPT_METHOD = "set_prompt_token_ids"


@dataclass(frozen=True)
class SplicePoint:
    """What the hook's splice at vLLM's tokenization step needs from one release (every field True when it fits)."""

    renders: bool
    """preprocess_chat renders through `render_chat_async`."""
    tokenizes: bool
    """`BaseRenderer.render_chat_async` tokenizes through `self.tokenize_prompts_async`, the method the hook wraps."""
    reaches_singleton: bool
    """`tokenize_prompts_async` leads, through `self.<method>()` calls, to `_tokenize_singleton_prompt_async`."""
    skips_prompt_ids: bool
    """`_tokenize_singleton_prompt_async` tokenizes only under a test that the prompt holds no `prompt_token_ids`."""
    parser_after_render: bool
    """preprocess_chat asks the parsers it builds from `parser` (and calls `set_prompt_token_ids`) only after its
    `render_chat_async` call, in source order, so the parser sees the spliced ids."""
    not_found: tuple[str, ...] = ()
    """The base renderer's methods among render_chat_async, tokenize_prompts_async and
    _tokenize_singleton_prompt_async that are not a def there (or on its bases)."""

    def gaps(self) -> list[tuple[str, str]]:
        """(short label for the table, problem) for every requirement that does not hold."""
        owner = _tokenize_owner()
        gaps = []

        def unread(method: str) -> str | None:
            return f"{owner} has no def of {method}" if method in self.not_found else None

        if not self.renders:
            gaps.append(
                (
                    f"no {RENDER_CHAT_METHOD} call",
                    f"preprocess_chat does not call {RENDER_CHAT_METHOD}: the hook's splice at "
                    f"{owner}.{TOKENIZE_METHOD} would never see its request",
                )
            )
        if not self.tokenizes:
            what = unread(RENDER_CHAT_METHOD) or f"{owner}.{RENDER_CHAT_METHOD} does not call self.{TOKENIZE_METHOD}"
            gaps.append((f"no {TOKENIZE_METHOD} call", f"{what}: the hook's splice would never run"))
        if not self.reaches_singleton:
            what = unread(TOKENIZE_METHOD) or f"{owner}.{TOKENIZE_METHOD} does not lead to self.{SINGLETON_METHOD}"
            gaps.append(
                (
                    f"no {SINGLETON_METHOD} call",
                    f"{what}: re-check that a prompt holding {PROMPT_IDS_KEY} is still not tokenized",
                )
            )
        if not self.skips_prompt_ids:
            what = unread(SINGLETON_METHOD) or (
                f"{owner}.{SINGLETON_METHOD} does not skip tokenizing a prompt that holds {PROMPT_IDS_KEY}"
            )
            gaps.append(
                (
                    f"tokenizes prompts with {PROMPT_IDS_KEY}",
                    f"{what}: the spliced ids would be replaced by the template's",
                )
            )
        if not self.parser_after_render:
            gaps.append(
                (
                    "parser used before rendering",
                    f"preprocess_chat uses its request parser before {RENDER_CHAT_METHOD}: the parser would "
                    "not see the spliced prompt ids",
                )
            )
        return gaps


def _tokenize_owner() -> str:
    """`module.Class` of the wrapped tokenization method (PATCHED_METHODS), where render_chat_async is looked up."""
    module, class_name = next((module, cls) for module, cls, method in PATCHED_METHODS if method == TOKENIZE_METHOD)
    return f"{module}.{class_name}"


def splice_point(reader: SourceReader, preprocess: FunctionNode | None) -> SplicePoint:
    """Read the splice point from preprocess_chat (None when the release has no def of it) and the base renderer."""
    module, _, class_name = _tokenize_owner().rpartition(".")
    found = {
        method: definition
        for method in (RENDER_CHAT_METHOD, TOKENIZE_METHOD, SINGLETON_METHOD)
        if isinstance(definition := reader.method(module, class_name, method), (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    render, tokenize, singleton = (
        found.get(method) for method in (RENDER_CHAT_METHOD, TOKENIZE_METHOD, SINGLETON_METHOD)
    )
    return SplicePoint(
        renders=preprocess is not None and calls(preprocess, RENDER_CHAT_METHOD),
        tokenizes=render is not None and _calls_on_self(render, TOKENIZE_METHOD),
        reaches_singleton=tokenize is not None and _reaches(reader, module, class_name, tokenize, SINGLETON_METHOD),
        skips_prompt_ids=singleton is not None and _tokenizes_only_without_ids(singleton),
        parser_after_render=preprocess is None or _parser_after_render(preprocess),
        not_found=tuple(
            method for method in (RENDER_CHAT_METHOD, TOKENIZE_METHOD, SINGLETON_METHOD) if method not in found
        ),
    )


def _self_calls(function: ast.AST) -> set[str]:
    """Names of the methods `function` calls on `self`."""
    return {
        node.func.attr
        for node in ast.walk(function)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
    }


def _calls_on_self(function: ast.AST, method: str) -> bool:
    return method in _self_calls(function)


def _reaches(reader: SourceReader, module: str, class_name: str, start: FunctionNode, target: str) -> bool:
    """Whether `start` leads to `self.<target>()` through the class's own methods (vLLM's chain is two calls long)."""
    seen: set[str] = set()
    frontier: list[ast.AST] = [start]
    for _ in range(MAX_HOPS):
        called = set().union(*(_self_calls(function) for function in frontier)) - seen
        if target in called:
            return True
        seen |= called
        frontier = [
            found
            for name in called
            if isinstance(found := reader.method(module, class_name, name), (ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        if not frontier:
            return False
    return False


def _is_tokenize_call(node: ast.AST) -> bool:
    """A call of `tokenize...` or `_tokenize...` (not `detokenize`, not `apply_pre_tokenization`)."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name.lstrip("_").startswith("tokenize")


def _ids_test(test: ast.expr, prompt: str) -> str | None:
    """What an `if` test says about the prompt's ids: "absent" when it can only be true for a prompt without
    PROMPT_IDS_KEY (`"prompt_token_ids" not in prompt`, alone or `and`-ed with more), "present" when it is true
    whenever the prompt holds them (`"prompt_token_ids" in prompt`, alone or `or`-ed), else None; `prompt` names the
    function's prompt parameter."""

    def key_test(node: ast.expr, operator: type[ast.cmpop]) -> bool:
        return (
            isinstance(node, ast.Compare)
            and len(node.ops) == 1
            and isinstance(node.ops[0], operator)
            and isinstance(node.left, ast.Constant)
            and node.left.value == PROMPT_IDS_KEY
            and isinstance(node.comparators[0], ast.Name)
            and node.comparators[0].id == prompt
        )

    def operands(node: ast.expr, joiner: type[ast.boolop]) -> list[ast.expr]:
        return list(node.values) if isinstance(node, ast.BoolOp) and isinstance(node.op, joiner) else [node]

    if any(key_test(node, ast.NotIn) for node in operands(test, ast.And)):
        return "absent"
    if any(key_test(node, ast.In) for node in operands(test, ast.Or)):
        return "present"
    return None


def _exits(block: list[ast.stmt]) -> bool:
    return bool(block) and isinstance(block[-1], (ast.Return, ast.Raise))


def _tokenizes_only_without_ids(function: FunctionNode) -> bool:
    """Whether the function tokenizes at all, and only where a prompt without PROMPT_IDS_KEY gets to: inside
    `if "prompt_token_ids" not in prompt:`, in the `else` of `if "prompt_token_ids" in prompt:`, or after such an
    `if` whose body returns."""
    names = parameter_names(function)
    names = names[1:] if names[:1] == ["self"] else names
    if not names:
        return False
    prompt = names[0]  # the prompt, as vLLM names it and passes it first
    tokenize_calls = {"guarded": 0, "unguarded": 0}

    def visit_nodes(nodes: Iterable[ast.AST], guarded: bool) -> None:
        for node in nodes:
            for child in ast.walk(node):
                if _is_tokenize_call(child):
                    tokenize_calls["guarded" if guarded else "unguarded"] += 1

    def visit_block(block: list[ast.stmt], guarded: bool) -> None:
        for statement in block:
            if isinstance(statement, ast.If):
                visit_nodes([statement.test], guarded)
                kind = _ids_test(statement.test, prompt)
                visit_block(statement.body, guarded or kind == "absent")
                visit_block(statement.orelse, guarded or kind == "present")
                if kind == "present" and _exits(statement.body):
                    guarded = True  # the rest of this block runs only for a prompt without ids
                continue
            for _, value in ast.iter_fields(statement):  # a compound statement's blocks are opened, nested `if`s too
                if isinstance(value, list) and value and all(isinstance(item, ast.stmt) for item in value):
                    visit_block(value, guarded)
                else:
                    visit_nodes(
                        [item for item in (value if isinstance(value, list) else [value]) if isinstance(item, ast.AST)],
                        guarded,
                    )

    visit_block(function.body, False)
    return tokenize_calls["guarded"] > 0 and tokenize_calls["unguarded"] == 0


def _position(node: ast.AST) -> tuple[int, int]:
    return getattr(node, "lineno", 0), getattr(node, "col_offset", 0)


def _parser_after_render(preprocess: FunctionNode) -> bool:
    """Whether every method call on a parser preprocess_chat builds from its `parser` parameter (`parser(...).m()`,
    or `p = parser(...)` then `p.m()`), and every `set_prompt_token_ids` call, comes after the first
    `render_chat_async` call in the source. True when there is no render call (reported on its own)."""
    renders = [node for node in ast.walk(preprocess) if is_call_of(node, RENDER_CHAT_METHOD)]
    if not renders:
        return True
    first_render = min(_position(node) for node in renders)

    def builds_parser(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == PARSER_PARAMETER
            and PARSER_PARAMETER in parameter_names(preprocess)
        )

    built = {
        target.id
        for node in ast.walk(preprocess)
        if isinstance(node, ast.Assign) and builds_parser(node.value)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    uses = [
        node
        for node in ast.walk(preprocess)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and (
            node.func.attr == PARSER_PROMPT_METHOD
            or builds_parser(node.func.value)
            or (isinstance(node.func.value, ast.Name) and node.func.value.id in built)
        )
    ]
    return all(_position(node) > first_render for node in uses)
