"""The template sweep fails on a planted wrong splice and on a planted crash in the splice, counts crashes on their own
line, and does not take a template's own refusal to render a shape for a crash (nor a crash for the template's)."""

from __future__ import annotations

import pytest

from nemo_gym_tok.cli.main import main
from nemo_gym_tok.testing.chat_templates import entry
from nemo_gym_tok.testing.chat_templates.families import family_of
from nemo_gym_tok.testing.chat_templates.sweep import SweepRenderer, failure_kind, sweep
from nemo_gym_tok.testing.chat_templates.tokenizer import family_tokenizer
from tests.splice_plants import PlantedSplice

# Spliced by ids (Qwen 2.5), closed by plain text (Falcon), and Gemma 2, whose template raises on a tool episode
# (strict user/assistant alternation): a shape it cannot render, not a crash.
TEMPLATES = ["Qwen-Qwen2.5-7B-Instruct", "tiiuae-falcon-7b-instruct", "google-gemma-2-2b-it"]


def test_the_real_splice_does_not_crash_and_a_template_raising_is_not_a_crash() -> None:
    report = sweep([entry(name) for name in TEMPLATES])
    assert report.crashes == 0 and not report.failed, report.format()
    assert "\ncrashes: 0 " in report.format()
    gemma = report.results[2]
    assert gemma.outcome == "exact" and gemma.unrenderable
    assert all("TemplateError: Conversation roles must alternate" in reason for reason in gemma.unrenderable)


def test_a_planted_crash_in_the_splice_fails_the_sweep(monkeypatch) -> None:
    plant = PlantedSplice("crash", every=20).install(monkeypatch)
    report = sweep([entry(name) for name in TEMPLATES])
    assert plant.planted >= len(TEMPLATES)
    assert report.crashes == plant.planted  # each one counted: a crash ends its episode (or edit), not the template
    assert report.failed
    for result in report.results:
        assert result.crashes and result.outcome == "crash", (result.name, result.outcome, result.reason)
    text = report.format()
    assert f"\ncrashes: {plant.planted} " in text
    assert "IndexError: list index out of range (planted in the splice) at _splice.py:" in text
    assert f"crashes (by downloads, first {len(TEMPLATES)} of {len(TEMPLATES)} templates)" in text


def test_a_planted_wrong_splice_fails_the_sweep(monkeypatch) -> None:
    plant = PlantedSplice("wrong", every=20).install(monkeypatch)
    report = sweep([entry(name) for name in TEMPLATES])
    assert plant.planted > 0 and report.failed and report.crashes == 0
    wrong = [result for result in report.results if result.outcome == "wrong"]
    assert wrong, report.format()
    assert "wrong (by downloads" in report.format()


@pytest.mark.parametrize("kind", ["crash", "wrong"])
def test_the_cli_exits_1_on_a_planted_fault_and_0_without(kind, monkeypatch, capsys) -> None:
    # One process: the fault is planted in this one (`--jobs 2` judges in processes of their own).
    assert main(["template-sweep", "--limit", "2", "--jobs", "1"]) == 0
    assert "\ncrashes: 0 " in capsys.readouterr().out
    plant = PlantedSplice(kind, every=10).install(monkeypatch)
    assert main(["template-sweep", "--limit", "2", "--jobs", "1"]) == 1
    out = capsys.readouterr().out
    assert plant.planted > 0
    if kind == "crash":
        assert f"\ncrashes: {plant.planted} " in out
    else:
        assert "\ncrashes: 0 " in out and "wrong (by downloads" in out


def test_only_what_the_template_raises_is_taken_for_a_shape_it_cannot_render() -> None:
    """The rule behind "unrenderable": the exception left the renderer's render call and was not raised by our code.
    Gemma 2's own raise_exception is the template's; a TypeError our code raises inside the same call (preparing a
    message that is not a mapping) is a crash."""
    template = entry("google-gemma-2-2b-it")
    renderer = SweepRenderer(family_tokenizer(template.text, family_of(template)))
    not_alternating = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="roles must alternate") as raised:
        renderer.render(not_alternating, add_generation_prompt=True)
    assert failure_kind(raised.value) == "unrenderable"
    with pytest.raises(TypeError) as raised:
        renderer.render([7], add_generation_prompt=True)
    assert failure_kind(raised.value) == "crash"
    assert failure_kind(IndexError("raised outside any rendering")) == "crash"


def test_the_cli_reports_alike_over_several_processes(capsys) -> None:
    assert main(["template-sweep", "--limit", "6", "--jobs", "1"]) == 0
    alone = capsys.readouterr().out
    assert main(["template-sweep", "--limit", "6", "--jobs", "2"]) == 0
    assert capsys.readouterr().out == alone
    assert main(["template-sweep", "--jobs", "0"]) == 2
