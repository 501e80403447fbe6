"""Prompt datasets in the verl layout (Parquet or JSONL), validated row by row.

A row is `{"prompt": [{"role", "content"}, ...], "data_source": str, "reward_model":
{"ground_truth": ..., "style": ...}, "extra_info": {...}, "id": optional}`; other columns are
ignored. Every row becomes a typed `Prompt` with its prompt id, rendered text and token ids,
or is rejected with a `DatasetError` naming file, row and field. A bad row is never silently
"fixed": with on_bad_row="drop" it is skipped, counted by reason and listed (`dropped_rows`:
file, row, field, reason), so a run can report how much of its data it actually used. A file
that cannot be read at all (missing, a folder, not Parquet, truncated) is a `DataFileError`.

Rules beyond the types: a message's role is system | user | assistant | tool; a ground truth
is a string or a number (an object only for the data sources in STRUCTURED_TRUTH, whose
verifiers read one); rows nest at most MAX_DEPTH lists/objects deep. Length is bounded before
any work: contents longer than max_prompt_tokens x (the longest vocabulary entry, in
characters) cannot fit and are refused without rendering or tokenizing them, so a 10 MiB
prompt costs a JSON parse, not a tokenizer pass.

Rows are numbered from 0 in file order (for JSONL, row r is line r+1; blank lines count).
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from sealrl.config import UserError, relative_note

COLUMNS = ("id", "prompt", "data_source", "reward_model", "extra_info")
BAD_ROW_POLICIES = ("error", "drop")
ROLES = ("system", "user", "assistant", "tool")
STRUCTURED_TRUTH = ("countdown",)   # data sources whose ground truth is an object
MAX_DEPTH = 32                      # a verl row nests 3-4 levels; far deeper is an error


class DataFileError(UserError, ValueError):
    """A data file that cannot be read at all; the message names the file and the problem."""


class DatasetError(UserError, ValueError):
    """A row that cannot become a Prompt. `reason` is a short key used for drop counts."""

    def __init__(self, source: str, row: int | None, field: str, reason: str, problem: str,
                 value: Any = None, has_value: bool = True) -> None:
        where = f"{source}: row {row}" if row is not None else source
        if row is not None and source.endswith(".jsonl"):
            where += f" (line {row + 1})"
        shown = f"; got {_short(value)}" if has_value else ""
        super().__init__(f"{where}: field '{field}': {problem}{shown}")
        self.source, self.row, self.field, self.reason = source, row, field, reason


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass(frozen=True, slots=True)
class Prompt:
    """One validated prompt; `token_ids` are exactly what the policy is conditioned on."""

    prompt_id: str
    messages: tuple[dict, ...]
    text: str
    """The rendered prompt (chat template applied, or contents joined when it is off)."""
    token_ids: tuple[int, ...]
    data_source: str
    ground_truth: Any
    extra_info: dict


@dataclass(frozen=True, slots=True)
class DroppedRow:
    """One row skipped under on_bad_row="drop"."""

    source: str
    row: int | None
    field: str
    reason: str
    message: str


@dataclass(slots=True)
class PromptSet:
    """The prompts that passed validation, in file order, and what was dropped and why."""

    prompts: list[Prompt]
    source: str
    dropped: Counter = field(default_factory=Counter)
    """reason -> number of rows dropped (on_bad_row="drop")."""
    drop_examples: list[str] = field(default_factory=list)
    """The first few drop messages, for logs."""
    dropped_rows: list[DroppedRow] = field(default_factory=list)
    """Every dropped row: where it was and why (written to the run folder as dropped_rows.jsonl)."""

    @property
    def num_dropped(self) -> int:
        return sum(self.dropped.values())

    def __len__(self) -> int:
        return len(self.prompts)

    def __iter__(self) -> Iterator[Prompt]:
        return iter(self.prompts)

    def __getitem__(self, i: int) -> Prompt:
        return self.prompts[i]


# ----------------------------------------------------------------------------- validation

def _bad_text(value: Any, path: str) -> tuple[str, Any] | None:
    """The first (field path, value) holding text that is not valid UTF-8: undecodable bytes
    (Parquet read as binary) or lone surrogates (JSON \\udXXX escapes, or bytes that JSONL
    decoding escaped)."""
    if isinstance(value, (bytes, str)):
        try:
            value.decode("utf-8") if isinstance(value, bytes) else value.encode("utf-8")
        except UnicodeError:
            return path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            if (hit := _bad_text(v, f"{path}.{k}")) is not None:
                return hit
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if (hit := _bad_text(v, f"{path}[{i}]")) is not None:
                return hit
    return None


def _prompt_id(row: dict, source: str, r: int, stem: str) -> str:
    """The `id` column, else extra_info.index, else `<file stem>:<row>`."""
    for name, value in (("id", row.get("id")), ("extra_info.index", (row.get("extra_info") or {}).get("index"))):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
            raise DatasetError(source, r, name, "wrong_type", "must be a non-empty string or an int", value)
        pid = str(value)
        # Group ids are `run/iter/prompt`: a '/' in the prompt id would make them ambiguous.
        if "/" in pid or pid.strip() != pid:
            raise DatasetError(source, r, name, "bad_id", "must not contain '/' or surrounding spaces", value)
        return pid
    return f"{stem}:{r}"


def _depth(value: Any) -> int:
    """Nesting depth of lists and dicts, without recursion (a hostile row cannot overflow it)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (list, dict)):
            deepest = max(deepest, d)
            if d <= MAX_DEPTH:   # deeper is refused anyway: stop walking
                stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def _check_messages(messages: Any, source: str, r: int) -> tuple[dict, ...]:
    if messages is None:
        raise DatasetError(source, r, "prompt", "missing_field", "missing", has_value=False)
    if not isinstance(messages, list):
        raise DatasetError(source, r, "prompt", "wrong_type", "must be a list of chat messages", messages)
    if not messages:
        raise DatasetError(source, r, "prompt", "empty_prompt", "has no messages", messages)
    for i, m in enumerate(messages):
        f = f"prompt[{i}]"
        if not isinstance(m, dict):
            raise DatasetError(source, r, f, "wrong_type", "must be an object with role and content", m)
        for key in ("role", "content"):
            if m.get(key) is None:
                raise DatasetError(source, r, f"{f}.{key}", "missing_field", "missing", has_value=False)
            if not isinstance(m[key], str):
                raise DatasetError(source, r, f"{f}.{key}", "wrong_type", "must be a string", m[key])
        if m["role"] not in ROLES:
            raise DatasetError(source, r, f"{f}.role", "bad_role", f"must be one of {', '.join(ROLES)}",
                               m["role"])
        if not m["content"]:
            raise DatasetError(source, r, f"{f}.content", "empty_prompt", "is empty", m["content"])
    return tuple({"role": m["role"], "content": m["content"]} for m in messages)


def _check_ground_truth(row: dict, data_source: str, source: str, r: int) -> Any:
    reward_model = row.get("reward_model")
    if reward_model is None:
        raise DatasetError(source, r, "reward_model", "missing_field", "missing", has_value=False)
    if not isinstance(reward_model, dict):
        raise DatasetError(source, r, "reward_model", "wrong_type", "must be an object", reward_model)
    truth = reward_model.get("ground_truth")
    if truth is None:
        raise DatasetError(source, r, "reward_model.ground_truth", "missing_field", "missing", has_value=False)
    if isinstance(truth, dict) and data_source in STRUCTURED_TRUTH:
        return truth
    if isinstance(truth, bool) or not isinstance(truth, (str, int, float)):
        raise DatasetError(source, r, "reward_model.ground_truth", "wrong_type",
                           "must be a string or a number (an object only for data_source "
                           f"{' | '.join(STRUCTURED_TRUTH)}; else give it as a JSON string)", truth)
    return truth


def _render(msgs: tuple[dict, ...], source: str, r: int, tokenizer, max_prompt_tokens: int,
            use_chat_template: bool, longest_token: int) -> tuple[str, list[int]]:
    """Rendered text and token ids. Contents longer than max_prompt_tokens * longest_token
    characters cannot fit, so they are refused before any rendering or tokenizing."""
    num_chars = sum(len(m["content"]) for m in msgs)
    if num_chars > max_prompt_tokens * longest_token:
        raise DatasetError(source, r, "prompt", "too_long",
                           f"{num_chars} characters cannot fit in max_prompt_tokens={max_prompt_tokens} "
                           f"(no token of the vocabulary is longer than {longest_token} characters)",
                           "".join(m["content"][:100] for m in msgs))
    if use_chat_template:
        # The template owns special tokens (a BOS, if the model wants one), so add none here.
        text = tokenizer.apply_chat_template(list(msgs), tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        text = "".join(m["content"] for m in msgs)
        ids = tokenizer(text)["input_ids"]
    if len(ids) > max_prompt_tokens:
        raise DatasetError(source, r, "prompt", "too_long",
                           f"{len(ids)} tokens > max_prompt_tokens={max_prompt_tokens}", text)
    if not ids:
        raise DatasetError(source, r, "prompt", "empty_prompt", "renders to zero tokens", text)
    # A character the vocabulary lacks would train and score a different prompt than written.
    unk = tokenizer.unk_token_id
    if unk is not None and unk in ids and tokenizer.unk_token not in text:
        bad = dict.fromkeys(c for c in text if tokenizer(c, add_special_tokens=False)["input_ids"] == [unk])
        named = ", ".join(f"{c!r} (U+{ord(c):04X})" for c in bad)
        raise DatasetError(source, r, "prompt", "unknown_token",
                           f"characters outside the vocabulary of the model's tokenizer: {named}; use a model "
                           "whose tokenizer covers them (model.path=<local Hugging Face folder>), replace them "
                           "in the data, or skip such rows (data.on_bad_row=drop)", text)
    return text, ids


def _validate(row: Any, source: str, r: int, stem: str, tokenizer, max_prompt_tokens: int,
              use_chat_template: bool, longest_token: int) -> Prompt:
    if not isinstance(row, dict):
        raise DatasetError(source, r, "<row>", "wrong_type", "a row must be an object", row)
    if _depth(row) > MAX_DEPTH:
        raise DatasetError(source, r, "<row>", "too_deep", f"nested deeper than {MAX_DEPTH} levels",
                           has_value=False)
    if (hit := _bad_text({k: row[k] for k in COLUMNS if k in row}, "<row>")) is not None:
        raise DatasetError(source, r, hit[0].removeprefix("<row>."), "invalid_utf8",
                           "not valid UTF-8", hit[1])
    msgs = _check_messages(row.get("prompt"), source, r)
    data_source = row.get("data_source")
    if data_source is None:
        raise DatasetError(source, r, "data_source", "missing_field", "missing", has_value=False)
    if not isinstance(data_source, str) or not data_source:
        raise DatasetError(source, r, "data_source", "wrong_type", "must be a non-empty string", data_source)
    ground_truth = _check_ground_truth(row, data_source, source, r)
    extra_info = row.get("extra_info")
    if extra_info is not None and not isinstance(extra_info, dict):
        raise DatasetError(source, r, "extra_info", "wrong_type", "must be an object", extra_info)
    prompt_id = _prompt_id(row, source, r, stem)
    text, ids = _render(msgs, source, r, tokenizer, max_prompt_tokens, use_chat_template, longest_token)
    return Prompt(prompt_id=prompt_id, messages=msgs, text=text, token_ids=tuple(ids),
                  data_source=data_source, ground_truth=ground_truth, extra_info=dict(extra_info or {}))


def _longest_token(tokenizer) -> int:
    """Characters in the longest vocabulary entry (special tokens included): a text of n
    characters needs at least n / this many tokens."""
    return max(1, max(map(len, tokenizer.get_vocab()), default=1))


def _collect(rows: Iterable[tuple[int, Any]], source: str, stem: str, tokenizer,
             max_prompt_tokens: int, use_chat_template: bool, on_bad_row: str) -> PromptSet:
    """Validate (row number, row or DatasetError) pairs; enforce unique ids; apply the policy."""
    if on_bad_row not in BAD_ROW_POLICIES:
        raise ValueError(f"on_bad_row must be one of {BAD_ROW_POLICIES}, got {on_bad_row!r}")
    if not isinstance(max_prompt_tokens, int) or max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be a positive int, got {max_prompt_tokens!r}")
    out = PromptSet(prompts=[], source=source)
    first_row: dict[str, int] = {}
    longest = _longest_token(tokenizer)
    for r, row in rows:
        try:
            if isinstance(row, DatasetError):
                raise row
            p = _validate(row, source, r, stem, tokenizer, max_prompt_tokens, use_chat_template, longest)
            if p.prompt_id in first_row:
                raise DatasetError(source, r, "id", "duplicate_id",
                                   f"duplicate prompt id (first at row {first_row[p.prompt_id]})",
                                   p.prompt_id)
        except DatasetError as e:
            if on_bad_row == "error":
                raise
            out.dropped[e.reason] += 1
            out.dropped_rows.append(DroppedRow(e.source, e.row, e.field, e.reason, str(e)))
            if len(out.drop_examples) < 10:
                out.drop_examples.append(str(e))
            continue
        first_row[p.prompt_id] = r
        out.prompts.append(p)
    return out


# ----------------------------------------------------------------------------- readers

def _read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """Bytes in, strict UTF-8 per line: one bad line is one bad row, not a failed file."""
    source = str(path)
    lines = path.read_bytes().split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the newline that ends the last row
    for r, raw in enumerate(lines):
        raw = raw.rstrip(b"\r")
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8", errors="strict")
        except UnicodeDecodeError as e:
            # Still an error; parsing with the bad bytes escaped only finds the field to name.
            try:
                hit = _bad_text(json.loads(raw.decode("utf-8", "surrogateescape")), "<row>")
            except json.JSONDecodeError:
                hit = None
            field_path = hit[0].removeprefix("<row>.") if hit else "<line>"
            yield r, DatasetError(source, r, field_path, "invalid_utf8", f"invalid UTF-8 at "
                                  f"byte {e.start} of the line", raw[max(0, e.start - 10):e.end + 10])
            continue
        try:
            yield r, json.loads(text)
        except json.JSONDecodeError as e:
            yield r, DatasetError(source, r, "<line>", "invalid_json", f"invalid JSON ({e.msg})", text)
        except RecursionError:   # the C parser recurses once per level
            yield r, DatasetError(source, r, "<line>", "too_deep", f"nested deeper than {MAX_DEPTH} "
                                  "levels (too deep to parse)", has_value=False)


def _as_binary(ty: pa.DataType) -> pa.DataType:
    """The same nested type with every string as binary, so reading never decodes."""
    if pa.types.is_string(ty):
        return pa.binary()
    if pa.types.is_large_string(ty):
        return pa.large_binary()
    if pa.types.is_struct(ty):
        return pa.struct([pa.field(f.name, _as_binary(f.type)) for f in ty])
    if pa.types.is_list(ty):
        return pa.list_(_as_binary(ty.value_type))
    if pa.types.is_large_list(ty):
        return pa.large_list(_as_binary(ty.value_type))
    return ty


def _read_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    """Only the verl columns are read; a column with invalid UTF-8 is re-read as bytes to name
    the rows and the nested field that hold it."""
    source = str(path)
    try:
        table = pq.read_table(path, columns=[c for c in COLUMNS if c in pq.read_schema(path).names])
    except (pa.ArrowException, OSError) as e:   # zero bytes, truncated, not Parquet at all
        raise DataFileError(f"{path}: not a readable Parquet file ({' '.join(str(e).split())})") from None
    columns: dict[str, list] = {}
    bad: dict[int, DatasetError] = {}
    for name in table.column_names:
        col = table.column(name)
        try:
            columns[name] = col.to_pylist()
            continue
        except UnicodeDecodeError:
            pass
        values = []
        for r in range(len(col)):
            try:
                values.append(col.slice(r, 1).to_pylist()[0])
            except UnicodeDecodeError:
                raw = col.slice(r, 1).cast(_as_binary(col.type)).to_pylist()[0]
                field_path, data = _bad_text(raw, name) or (name, raw)
                bad.setdefault(r, DatasetError(source, r, field_path, "invalid_utf8",
                                               "invalid UTF-8", data))
                values.append(None)
        columns[name] = values
    for r in range(table.num_rows):
        yield r, bad.get(r) or {name: values[r] for name, values in columns.items()}


def load_prompts(path: str | Path, tokenizer, max_prompt_tokens: int,
                 use_chat_template: bool = True, on_bad_row: str = "error") -> PromptSet:
    """Load and validate a `.parquet` or `.jsonl` file (see module docstring)."""
    path = Path(path)
    check_data_file(path)
    reader = _read_parquet if path.suffix == ".parquet" else _read_jsonl
    try:
        return _collect(reader(path), str(path), path.stem, tokenizer,
                        max_prompt_tokens, use_chat_template, on_bad_row)
    except OSError as e:   # e.g. permission denied, or an I/O error while reading
        raise DataFileError(f"{path}: cannot be read ({e.strerror or e})") from None


def check_data_file(path: str | Path) -> None:
    """Cheap checks before loading: a .parquet or .jsonl file that exists and is a file.
    Relative paths are resolved against the working directory."""
    path = Path(path)
    if path.suffix not in (".parquet", ".jsonl"):
        raise DataFileError(f"{path}: unsupported extension {path.suffix!r}; use .parquet or .jsonl")
    if not path.exists():
        raise DataFileError(f"{path}: no such file{relative_note(path)}")
    if not path.is_file():
        raise DataFileError(f"{path}: is a directory, not a data file" if path.is_dir() else
                            f"{path}: not a regular file")


def has_rows(path: str | Path) -> bool:
    """Whether a data file holds any row, without loading it: the Parquet footer, or a
    non-blank byte in a JSONL file. Raises DataFileError for a file that cannot be read."""
    path = Path(path)
    check_data_file(path)
    try:
        if path.suffix == ".parquet":
            return pq.read_metadata(path).num_rows > 0
        with open(path, "rb") as f:
            return any(chunk.strip() for chunk in iter(lambda: f.read(1 << 16), b""))
    except (pa.ArrowException, OSError) as e:
        what = "a readable Parquet file" if path.suffix == ".parquet" else "readable"
        raise DataFileError(f"{path}: not {what} ({' '.join(str(e).split())})") from None


def prompts_from_rows(rows: Iterable[dict], tokenizer, max_prompt_tokens: int,
                      use_chat_template: bool = True, on_bad_row: str = "error",
                      source: str = "rows") -> PromptSet:
    """The same validation for in-memory rows (e.g. from `sealrl.data.tasks.make_task`)."""
    return _collect(enumerate(rows), source, source, tokenizer, max_prompt_tokens,
                    use_chat_template, on_bad_row)


def write_jsonl(rows: Iterable[dict], path: str | Path) -> None:
    """One JSON object per line, UTF-8, non-ASCII kept as is."""
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def write_parquet(rows: Iterable[dict], path: str | Path) -> None:
    """Rows as a Parquet table; nested fields become struct/list columns (schema inferred)."""
    pq.write_table(pa.Table.from_pylist(list(rows)), path)
