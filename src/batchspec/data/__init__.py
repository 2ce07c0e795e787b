"""Package data: the built-in prompt set and the trained draft model for the default target.

``prompts.jsonl`` holds 48 prompts written for batchspec, spread over the 13 Spec-Bench categories (writing, roleplay,
reasoning, math, coding, extraction, stem, humanities, translation, summarization, qa, math_reasoning, rag), in the
Spec-Bench record format (``question_id``, ``category``, ``turns``). They are held out from the drafts' training
prompts (``batchspec.training.prompts`` checks that). ``smollm2-135m-draft/`` is the default draft of the default
target, a feature-reading head; ``smollm2-135m-draft-model/`` the earlier draft model; both trained with
``batchspec train-draft``, each with its model card (the exact commands).
"""

from __future__ import annotations

import json
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
PROMPTS_FILE = DATA_DIR / "prompts.jsonl"


def builtin_records() -> list[dict]:
    """The built-in prompt records: ``{"question_id", "category", "turns": [text]}``."""
    with PROMPTS_FILE.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def builtin_prompts() -> list[tuple[str, str]]:
    """The built-in prompt set as ``(prompt id, text)`` pairs, in file order."""
    return [(str(r["question_id"]), r["turns"][0]) for r in builtin_records()]


def builtin_categories() -> dict[str, str]:
    """Prompt id -> category for the built-in prompt set."""
    return {str(r["question_id"]): r["category"] for r in builtin_records()}
