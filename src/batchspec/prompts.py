"""Prompt files: Spec-Bench style JSONL (``turns[0]`` is the prompt) or plain text, one prompt per line."""

from __future__ import annotations

import json
from pathlib import Path


def read_prompts(path) -> list[tuple[str, str]]:
    """Return ``(prompt id, text)`` pairs. JSONL records may carry ``question_id`` and ``category``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} " + ("is not a file" if path.exists() else "does not exist"))
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"prompt file {path} is not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from e
    if path.suffix == ".jsonl" or (lines and lines[0].lstrip().startswith("{")):
        out = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                text = rec["turns"][0] if "turns" in rec else rec["prompt"]
            except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
                raise ValueError(f"{path}:{n}: expected a JSON object with turns[0] or prompt ({e})") from e
            out.append((str(rec.get("question_id", rec.get("id", len(out)))), text))
        return out
    return [(str(i), line) for i, line in enumerate(line for line in lines if line.strip())]


def encode(tokenizer, texts: list[str], chat_template: bool) -> list[list[int]]:
    """Token ids for each text, through the tokenizer's chat template when asked (and available)."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        return [
            list(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False))
            for t in texts
        ]
    return [tokenizer(t)["input_ids"] for t in texts]
