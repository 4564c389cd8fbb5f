"""Row formats: which fields a row of each format has, how a row's format is recognised, and how alpaca and
sharegpt rows map onto chat conversations.

  prompt_completion  {"prompt", "completion"}
  text               {"text"}
  chat               {"messages": [{"role", "content"}, ...]}  (OpenAI style)
  alpaca             {"instruction", "input" (optional), "output", "system" (optional)}
  sharegpt           {"conversations": [{"from", "value"}, ...], "system" (optional)}
"""

from __future__ import annotations

from typing import Any

from harli_train.data.example import DataError

# The fields that mark a row as being of each format (any one of them does).
MARKERS = {
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
    "chat": ("messages",),
    "alpaca": ("instruction", "output"),
    "sharegpt": ("conversations",),
}
FORMATS = ("auto", *MARKERS)
CHAT_FORMATS = ("chat", "alpaca", "sharegpt")  # rendered with the tokenizer's chat template
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}


def detect_format(row: dict[str, Any], where: str) -> str:
    """The one format whose marker fields the row has;
    DataError naming `where` when it has none or several."""
    found = [fmt for fmt, keys in MARKERS.items() if any(k in row for k in keys)]
    if len(found) == 1:
        return found[0]
    if not found:
        known = ", ".join("/".join(repr(k) for k in keys) for keys in MARKERS.values())
        raise DataError(
            f"{where}: row has none of the fields of a known format ({known}); "
            f"keys: {', '.join(row) or 'none'}"
        )
    named = " and ".join(f"{fmt} ({'/'.join(repr(k) for k in MARKERS[fmt] if k in row)})" for fmt in found)
    raise DataError(
        f"{where}: row has fields of {'both' if len(found) == 2 else 'several formats:'} {named}; "
        "set data.format to say which to read"
    )


def has_markers(row: dict[str, Any], fmt: str) -> bool:
    return any(k in row for k in MARKERS[fmt])


def text_fields(row: dict[str, Any], fmt: str, where: str) -> list[str]:
    """The strings of a prompt_completion ([prompt, completion]) or text ([text]) row."""
    names = ("prompt", "completion") if fmt == "prompt_completion" else ("text",)
    return [_string(row, name, fmt, where, names) for name in names]


def messages(row: dict[str, Any], fmt: str, where: str) -> list[dict[str, str]]:
    """A chat, alpaca or sharegpt row as OpenAI-style messages ([] for a row with no text at all).

    alpaca: [system,] user (instruction, then a newline and the input when there is one), assistant (output).
    sharegpt: `from` human/user -> user, gpt/assistant -> assistant, system -> system; a row-level `system`
    comes first.
    """
    if fmt == "chat":
        return [
            _message(m, where, i, "role", "content") for i, m in enumerate(_list(row, "messages", where), 1)
        ]
    if fmt == "sharegpt":
        turns = [
            _message(m, where, i, "from", "value")
            for i, m in enumerate(_list(row, "conversations", where), 1)
        ]
        for i, turn in enumerate(turns, 1):
            if turn["role"] not in SHAREGPT_ROLES:
                raise DataError(
                    f"{where}: conversations[{i}].from is {turn['role']!r}; "
                    f"expected one of {', '.join(SHAREGPT_ROLES)}"
                )
            turn["role"] = SHAREGPT_ROLES[turn["role"]]
        return _with_system(row, turns, where)
    names = ("instruction", "output")
    instruction, output = (_string(row, name, fmt, where, names) for name in names)
    extra = _optional_string(row, "input", where)
    if not (instruction or extra or output):
        return []
    user = instruction + ("\n" + extra if extra else "")
    return _with_system(
        row, [{"role": "user", "content": user}, {"role": "assistant", "content": output}], where
    )


def _with_system(row: dict[str, Any], turns: list[dict[str, str]], where: str) -> list[dict[str, str]]:
    system = _optional_string(row, "system", where)
    return ([{"role": "system", "content": system}] if system else []) + turns


def _string(row: dict[str, Any], name: str, fmt: str, where: str, needed: tuple[str, ...]) -> str:
    if name not in row:
        raise DataError(
            f"{where}: missing field {name!r} ({fmt} rows need {' and '.join(repr(n) for n in needed)})"
        )
    value = row[name]
    if not isinstance(value, str):
        raise DataError(f"{where}: field {name!r} must be a string, got {type(value).__name__}")
    return value


def _optional_string(row: dict[str, Any], name: str, where: str) -> str:
    value = row.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DataError(f"{where}: field {name!r} must be a string, got {type(value).__name__}")
    return value


def _list(row: dict[str, Any], name: str, where: str) -> list[Any]:
    value = row.get(name)
    if not isinstance(value, list):
        raise DataError(f"{where}: field {name!r} must be a list of messages, got {type(value).__name__}")
    return value


def _message(m: Any, where: str, i: int, role_key: str, text_key: str) -> dict[str, str]:
    name = "messages" if role_key == "role" else "conversations"
    if not isinstance(m, dict):
        raise DataError(
            f"{where}: {name}[{i}] must be an object with {role_key!r} and {text_key!r}, "
            f"got {type(m).__name__}"
        )
    for key in (role_key, text_key):
        if not isinstance(m.get(key), str):
            got = "nothing" if key not in m else type(m[key]).__name__
            raise DataError(f"{where}: {name}[{i}].{key} must be a string, got {got}")
    return {"role": m[role_key], "content": m[text_key]}
