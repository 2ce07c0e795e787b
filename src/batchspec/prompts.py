"""Prompt files: JSON records (Spec-Bench style JSONL, whose ``turns[0]`` is the prompt, or a ``prompt`` field) or
plain text, one prompt per line. Every record is checked when the file is read, before any model loads, and a bad one
is refused with its file and line."""

from __future__ import annotations

import json
from pathlib import Path

JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")


def read_prompts(path) -> list[tuple[str, str]]:
    """Return ``(prompt id, text)`` pairs. JSON records may carry ``question_id`` (or ``id``) and ``category``; a
    file is read as JSON records when its suffix is .jsonl / .json / .ndjson or its first line starts with ``{``.
    Ids are unique, as outputs are keyed by them: a given id repeated is refused, and a record without one gets its
    0-based position (with a suffix where a given id took that)."""
    path = Path(path)
    text = read_text(path)
    first = next((line for line in text.splitlines() if line.strip()), "")
    if path.suffix.lower() in JSON_SUFFIXES or first.lstrip().startswith("{"):
        records = [(where, prompt_of(rec, where), rec.get("question_id", rec.get("id")))
                   for where, rec in json_records(path, text)]
        given: dict[str, str] = {}
        for where, _, pid in records:
            if pid is not None and given.setdefault(str(pid), where) != where:
                raise ValueError(f"{where}: id {str(pid)!r} is also the id of {given[str(pid)]}; give each prompt "
                                 "its own id (or none, to number it)")
        return [(str(pid) if pid is not None else _free_id(str(n), given), prompt)
                for n, (_, prompt, pid) in enumerate(records)]
    return [(str(i), line) for i, line in enumerate(line for line in text.splitlines() if line.strip())]


def _free_id(pid: str, given: dict) -> str:
    """``pid``, or ``pid-2``, ``pid-3``... where a given id is ``pid``."""
    n = 1
    while (pid if n == 1 else f"{pid}-{n}") in given:
        n += 1
    return pid if n == 1 else f"{pid}-{n}"


def read_text(path: Path) -> str:
    """The text of a prompt file, refused with one line when it is missing or not UTF-8."""
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} " + ("is not a file" if path.exists() else "does not exist"))
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"prompt file {path} is not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from e


def json_records(path, text: str):
    """``(where, record)`` for each JSON object of a prompt file: one per non-blank line (JSONL), or the items of a
    file that is one JSON array. ``where`` names the file and line (or item) for error messages; a line that is not
    JSON, or not an object, is a ValueError naming it."""
    if text.lstrip().startswith("["):  # one JSON array (Ray reads such a .json file too)
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            items = None  # not one array: read line by line, which names the bad line
        if isinstance(items, list):
            for i, rec in enumerate(items, 1):
                yield _object(rec, f"{path} item {i}")
            return
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line must be one JSON "
                             "object") from None
        yield _object(rec, where)


def _object(rec, where: str):
    if not isinstance(rec, dict):
        raise ValueError(f'{where}: expected a JSON object with "turns" or "prompt", got {_show(rec)}')
    return where, rec


def prompt_of(rec: dict, where: str, fields=("turns", "prompt"), token_ids: bool = False):
    """The prompt of one record: ``turns[0]`` or ``prompt``, from the first of ``fields`` that the record has. It
    must be a non-empty string (or, with ``token_ids``, a non-empty list of integer token ids); anything else is a
    ValueError naming ``where``, so that a bad line fails before any model loads instead of deep inside encoding."""
    field = next((f for f in fields if f in rec), None)
    if field is None:
        raise ValueError(f'{where}: no "turns" or "prompt" field; give the prompt as "turns": ["..."] or "prompt": '
                         '"..."')
    value, name = rec[field], f'"{field}"'
    if field == "turns":
        if not isinstance(value, list) or not value:
            raise ValueError(f'{where}: "turns" must be a non-empty list whose first item is the prompt, got '
                             f"{_show(value)}")
        value, name = value[0], '"turns"[0]'
    want = "a string or a list of token ids" if token_ids else "a string"
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{where}: {name} is empty; give the prompt text")
    elif token_ids and isinstance(value, list):
        if not value:
            raise ValueError(f"{where}: {name} is an empty list of token ids")
        bad = next((t for t in value if isinstance(t, bool) or not isinstance(t, int) or t < 0), None)
        if bad is not None:
            raise ValueError(f"{where}: {name} has token id {_show(bad)}; token ids are integers >= 0")
    else:
        raise ValueError(f"{where}: {name} must be {want}, got {_show(value)}")
    return value


def _show(value) -> str:
    """A JSON value as the user wrote it (``null``, ``12345``, ``[]``), cut short."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


def encode(tokenizer, texts: list[str], chat_template: bool) -> list[list[int]]:
    """Token ids for each text, through the tokenizer's chat template when asked (and available)."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        return [chat_ids(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    return [tokenizer(t)["input_ids"] for t in texts]


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True, template: str | None = None):
    """Token ids of one conversation (``{"role", "content"}`` messages) through the tokenizer's chat template, or
    ``template`` (a Jinja chat template) in its place."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                              return_dict=False, chat_template=template))
