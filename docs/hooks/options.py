"""mkdocs hook: options and configuration tables generated from the options dataclasses.

Markers it replaces in any page, each alone on its line:

- ``<!-- options: weightsync.transport.backends.shm.engine.ShmOptions -->``: a table of that
  dataclass's fields (field, ``WEIGHTSYNC_*`` variable, default, doc), from
  :func:`weightsync.core.config.option_rows`.
- ``<!-- env-table -->``: one table of every ``WEIGHTSYNC_*`` variable of every class named
  by an ``options:`` marker anywhere in the docs, with a link to the page that documents it.

A class that cannot be imported, or that declares no field with ``option()``, is a warning,
so ``mkdocs build --strict`` fails. So is a ``WEIGHTSYNC_*`` variable that ``src/weightsync``
reads but the configuration page does not name, and one that ``src/weightsync`` names (in a
docstring, a help text) but nothing reads.
"""

from __future__ import annotations

import importlib
import logging
import re
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.options")

#: a marker counts only alone on its line (so a page can quote one in code)
MARKER = re.compile(r"^<!--\s*options:\s*([\w.]+)\s*-->[ \t]*$", re.M)
ENV_MARKER = re.compile(r"^<!--\s*env-table\s*-->[ \t]*$", re.M)
CONFIG_PAGE = "configuration.md"
#: variables src/weightsync reads: env_value("X", ...) / option("X", ...), or
#: environ.get / env.get / environ[...] / getenv of a literal "WEIGHTSYNC_X"
READS = (re.compile(r"\b(?:env_value|option)\(\s*[\"']([A-Z][A-Z0-9_]*)[\"']"),
         re.compile(r"\b(?:environ\.get|env\.get|getenv|environ\[)\(?\s*[\"']WEIGHTSYNC_([A-Z][A-Z0-9_]*)[\"']"))
#: every WEIGHTSYNC_X that src/weightsync names (docstrings, help texts, messages)
MENTIONS = re.compile(r"\bWEIGHTSYNC_([A-Z][A-Z0-9_]*[A-Z0-9])\b")

_classes: dict[str, str] = {}     # dotted class name -> page (src_uri) that shows its table
_rows: dict[str, object] = {}     # dotted class name -> its option_rows, or None (warned once)


def _load(dotted: str):
    if dotted not in _rows:
        _rows[dotted] = _read_rows(dotted)
    return _rows[dotted]


def _read_rows(dotted: str):
    module, _, name = dotted.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        from weightsync.core.config import option_rows
        rows = option_rows(cls)
    except Exception as exc:  # noqa: BLE001 - any failure is reported the same way
        log.warning("options table %s: cannot load it (%s: %s)", dotted, type(exc).__name__, exc)
        return None
    if not rows:
        log.warning("options table %s: no field declared with weightsync.core.config.option()",
                    dotted)
        return None
    return rows


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _default(value) -> str:
    if isinstance(value, bool) or value is None:
        return f"`{value}`"
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"`{value}` ({value >> 20} MiB)"
    if isinstance(value, str):
        return f"`{value!r}`" if value else "`''`"
    return f"`{value!r}`"


def _table(dotted: str) -> str:
    rows = _load(dotted)
    if rows is None:
        return f"!!! failure\n    The options table of `{dotted}` could not be generated.\n"
    lines = [f"Options of `{dotted.rpartition('.')[2]}` (keywords, or the environment "
             "variable, read when the options are built):", "",
             "| option | environment | default | what it does |", "| --- | --- | --- | --- |"]
    for name, env, default, doc in rows:
        lines.append(f"| `{name}` | {f'`{env}`' if env else '-'} | {_default(default)} | "
                     f"{_cell(doc)} |")
    return "\n".join(lines) + "\n"


def _env_table(page_uri: str) -> str:
    lines = ["| variable | option | class | default | what it does |",
             "| --- | --- | --- | --- | --- |"]
    seen = {}
    for dotted, src in sorted(_classes.items(), key=lambda kv: kv[0].rpartition(".")[2]):
        rows = _load(dotted) or []
        link = _relative(page_uri, src)
        short = dotted.rpartition(".")[2]
        for name, env, default, doc in rows:
            if not env:
                continue
            if env in seen and seen[env] != dotted:
                log.warning("%s is declared by both %s and %s", env, seen[env], dotted)
            seen[env] = dotted
            lines.append(f"| `{env}` | `{name}` | [{short}]({link}) | {_default(default)} | "
                         f"{_cell(doc)} |")
    return "\n".join(lines) + "\n"


def _relative(from_uri: str, to_uri: str) -> str:
    if from_uri == to_uri:
        return ""
    depth = from_uri.count("/")
    return "../" * depth + to_uri


def _src_names(root: Path) -> tuple[set[str], dict[str, str]]:
    """(variables src/weightsync reads, every variable it names -> a file naming it)."""
    read: set[str] = set()
    named: dict[str, str] = {}
    for path in sorted((root / "src" / "weightsync").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for pattern in READS:
            read.update("WEIGHTSYNC_" + m for m in pattern.findall(text))
        for m in MENTIONS.findall(text):
            named.setdefault("WEIGHTSYNC_" + m, str(path.relative_to(root)))
    return read, named


def on_files(files, config):
    """Find every class an ``options:`` marker names, and the page that shows it."""
    _classes.clear()
    _rows.clear()
    for f in files:
        if not f.src_uri.endswith(".md"):
            continue
        text = Path(f.abs_src_path).read_text(encoding="utf-8")
        for dotted in MARKER.findall(text):
            _classes.setdefault(dotted, f.src_uri)
    return files


def on_page_markdown(markdown, page, config, files):
    uri = page.file.src_uri
    if ENV_MARKER.search(markdown):
        markdown = ENV_MARKER.sub(lambda m: _env_table(uri), markdown)
    markdown = MARKER.sub(lambda m: _table(m.group(1)), markdown)
    if uri == CONFIG_PAGE:
        root = Path(config["config_file_path"]).parent
        read, named = _src_names(root)
        missing = sorted(n for n in read if not re.search(rf"\b{n}\b", markdown))
        if missing:
            log.warning("configuration.md does not name %s, read in src/weightsync",
                        ", ".join(missing))
        stale = sorted(n for n in named if n not in read)
        if stale:
            log.warning("src/weightsync names variables nothing reads: %s",
                        ", ".join(f"{n} ({named[n]})" for n in stale))
    return markdown
