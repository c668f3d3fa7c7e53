"""README.md and docs/*.md hold only what is true of the tree: read from the text, nothing is run.

Every relative link and image names a file in the repository, and its anchor a heading of that
file by GitHub's rules; every ``python -m X``, ``make X``, ``hsdp-serve --flag`` and ``hsdp-load
--flag`` in their code names a module that exists, a Makefile target, a declared flag; the README
stays short; and every path and name its layout table, "Where a change goes" and request sketch
give exists. The checkers return their findings, so the last test feeds them a broken page to
show they can fail.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
PAGES = [README, *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]
README_MAX_LINES = 320

FENCE = re.compile(r"^```.*?^```[ \t]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
PATH_LIKE = re.compile(r"[\w.-]+(?:/[\w.-]+)*(?:/|\.(?:py|md|sh|yml|yaml|json|toml|png))")

PYTHON_M = re.compile(r"\b(?:python3?|torchrun\b[^`\n]*?)\s+-m\s+([A-Za-z_][\w.]*)([^\n`]*)")
MAKE = re.compile(r"(?<![\w-])make\s+([A-Za-z][\w-]*)([^\n`]*)")
SCRIPT = re.compile(r"(?<![\w/-])(hsdp-serve|hsdp-load)(?![\w-])([^\n`]*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def rel(path: str) -> str:
    return os.path.relpath(path, REPO)


def prose(text: str) -> str:
    """The text without fenced blocks and code spans: what GitHub renders links and headings from."""
    return CODE_SPAN.sub("code", FENCE.sub("", text))


def code(text: str) -> list[str]:
    """Every fenced block's lines (a trailing backslash joins the next) and every code span."""
    lines = []
    for block in FENCE.findall(text):
        lines += block.replace("\\\n", " ").splitlines()[1:-1]
    return lines + CODE_SPAN.findall(FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text, lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays, its target goes
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: str) -> set[str]:
    """Every heading's anchor in a Markdown file, repeats numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for _, heading in HEADING.findall(FENCE.sub("", read(path))):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: str, text: str) -> list[str]:
    """Relative links and images in ``text`` (the page ``page``) that name no file or no heading."""
    problems = []
    for target in LINK.findall(prose(text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
            continue
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        where = f"{rel(page)}: ({target})"
        if os.path.commonpath([resolved, REPO]) != REPO:
            problems.append(f"{where} leaves the repository")
        elif not os.path.exists(resolved):
            problems.append(f"{where}: no {rel(resolved)}")
        elif anchor and not (resolved.endswith(".md") and anchor in anchors(resolved)):
            problems.append(f"{where}: no heading #{anchor} in {rel(resolved)}")
    return problems


def makefile_targets() -> dict[str, str]:
    """Each Makefile target and its recipe."""
    targets, current = {}, None
    for line in read(os.path.join(REPO, "Makefile")).splitlines():
        m = re.match(r"([A-Za-z][\w-]*)\s*:(?!=)", line)
        if m:
            current = m.group(1)
            targets[current] = ""
        elif line.startswith("\t") and current:
            targets[current] += line + "\n"
        elif not line.strip().startswith("#"):
            current = None
    return targets


def declared_flags() -> set[str]:
    from server.config import OPTIONS, flag_of

    flags = {"--help"}
    for f in OPTIONS:
        flags.add(flag_of(f))
        if f.metadata["option"].switch:
            flags.add("--no-" + flag_of(f).removeprefix("--"))
    return flags


def module_file(dotted: str) -> str | None:
    """The repository's file that ``python -m dotted`` runs, or None when the module is not ours."""
    base = os.path.join(REPO, *dotted.split("."))
    if os.path.isfile(base + ".py"):
        return base + ".py"
    if os.path.isdir(base) and os.path.isfile(os.path.join(base, "__init__.py")):
        return os.path.join(base, "__main__.py")  # a package runs its __main__, which must exist
    return None


def command_segment(rest: str) -> str:
    """A command's arguments: up to a comment, a separator or a pipe (a choice list's | is no pipe)."""
    return re.split(r"\s#|;|&&|\s\|\s", rest)[0]


def unknown_commands(page: str, text: str) -> list[str]:
    """Commands in ``text``'s code naming a module, target or flag that does not exist."""
    problems, targets, flags = [], makefile_targets(), declared_flags()
    for line in code(text):
        where = f"{rel(page)}: `{line.strip()}`"
        for module, rest in PYTHON_M.findall(line):
            used = FLAG.findall(command_segment(rest))
            path = module_file(module)
            if path is None and module.split(".")[0] in {"server", "shard_engine", "loaders", "benchmarks", "tests"}:
                problems.append(f"{where}: no module {module}")
            elif path is None:
                if importlib.util.find_spec(module.split(".")[0]) is None:
                    problems.append(f"{where}: no module {module} installed")
            elif not os.path.isfile(path):
                problems.append(f"{where}: {module} has no {rel(path)}")
            elif module == "server":
                problems += [f"{where}: hsdp-serve declares no {f}" for f in used if f not in flags]
            else:
                source = read(path)
                problems += [f"{where}: {rel(path)} takes no {f}" for f in used
                             if f'"{f}"' not in source and f"'{f}'" not in source]
        for target, rest in MAKE.findall(line):
            args = re.match(r"\s+ARGS=(?:'([^']*)'|\"([^\"]*)\"|(\S*))", rest)
            ran = re.search(r"-m ([\w.]+) \$\(ARGS\)", targets.get(target, ""))
            if target not in targets:
                problems.append(f"{where}: the Makefile has no target {target}")
            elif args and "$(ARGS)" not in targets[target]:
                problems.append(f"{where}: make {target} does not pass ARGS on")
            elif args and ran:  # the flags in ARGS go to the module the target runs
                problems += unknown_commands(page, f"`python -m {ran.group(1)} {''.join(args.groups(''))}`")
        for script, rest in SCRIPT.findall(line):
            used = FLAG.findall(command_segment(rest))
            if script == "hsdp-serve":
                problems += [f"{where}: hsdp-serve declares no {f}" for f in used if f not in flags]
            else:
                source = read(os.path.join(REPO, "server", "load_report.py"))
                problems += [f"{where}: hsdp-load takes no {f}" for f in used
                             if f not in flags and f'"{f}"' not in source]
    return problems


def section(text: str, title: str) -> str:
    """A ``## title`` section's text, up to the next heading of its level."""
    m = re.search(rf"^## {re.escape(title)}[ \t]*\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert m, f"no section '## {title}'"
    return m.group(1)


def defines(path: str, name: str) -> bool:
    """Whether ``path`` defines ``name``: a function, a class or a module-level name."""
    source = read(path)
    return re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b|^{name}\s*[:=]", source, re.MULTILINE) is not None


def missing_in_layout(text: str) -> list[str]:
    """Paths and names the layout table, "Where a change goes" and the request sketch give that do not exist.

    A layout row's first cell holds repository paths; a file named in its second cell lies under
    one of them (or is itself a repository path). "`file.py` (`Name`" in a row, and "`Name` in
    `path.py`" in a change, say that the file defines ``Name``."""
    problems = []
    rows = [line for line in section(text, "Layout").splitlines() if line.startswith("| `")]
    assert rows, "the layout table has no rows"
    for row in rows:
        where_cell, what_cell = row.strip("|").split("|", 1)
        folders = [os.path.join(REPO, p) for p in CODE_SPAN.findall(where_cell)]
        problems += [f"layout: no {rel(p)}" for p in folders if not os.path.exists(p)]
        roots = [p for p in folders if os.path.isdir(p)] + [REPO]
        named = {}
        for name in CODE_SPAN.findall(what_cell):
            if PATH_LIKE.fullmatch(name):
                found = [os.path.join(r, name) for r in roots if os.path.exists(os.path.join(r, name))]
                if not found:
                    problems.append(f"layout: {name} is under none of {[rel(r) for r in roots]}")
                named[name] = found[0] if found else None
        for file, name in re.findall(r"`([\w./-]+\.py)` \(`(\w+)`", what_cell):
            if named.get(file) and not defines(named[file], name):
                problems.append(f"layout: {file} defines no {name}")
    changes = section(text, "Where a change goes")
    bullets = re.split(r"^- ", changes, flags=re.MULTILINE)[1:]
    assert len(bullets) >= 5, "'Where a change goes' answers fewer than five questions"
    for bullet in bullets:
        paths = [p for p in CODE_SPAN.findall(bullet) if PATH_LIKE.fullmatch(p)]
        if not paths:
            problems.append(f"where a change goes: names no path: {bullet.strip()[:60]}")
        problems += [f"where a change goes: no {p}" for p in paths if not os.path.exists(os.path.join(REPO, p))]
        for name, file in re.findall(r"`(\w+)` in `([\w./-]+\.py)`", bullet):
            path = os.path.join(REPO, file)
            if os.path.exists(path) and not defines(path, name):
                problems.append(f"where a change goes: {file} defines no {name}")
    sketch = section(text, "A request's way through the system")
    for p in re.findall(r"(?<![\w/])((?:server|shard_engine|loaders)/[\w/]+\.py)", sketch):
        if not os.path.exists(os.path.join(REPO, p)):
            problems.append(f"request sketch: no {p}")
    classes = set()
    for path in glob.glob(os.path.join(REPO, "server", "**", "*.py"), recursive=True):
        classes |= set(re.findall(r"^class (\w+)", read(path), re.MULTILINE))
    for name in set(re.findall(r"\b[A-Z][a-z]+(?:[A-Z][a-z]+)+\b", sketch)) - classes:
        problems.append(f"request sketch: no class {name} in server/")
    return problems


def test_every_relative_link_and_image_resolves():
    assert len(PAGES) > 1, "no docs/*.md"
    problems = [p for page in PAGES for p in broken_links(page, read(page))]
    assert not problems, "\n".join(problems)


def test_every_command_the_docs_name_exists():
    problems = [p for page in PAGES for p in unknown_commands(page, read(page))]
    assert not problems, "\n".join(problems)


def test_the_readme_is_short():
    lines = read(README).count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_every_path_the_readme_layout_names_exists():
    problems = missing_in_layout(read(README))
    assert not problems, "\n".join(problems)


def unnamed_in_layout(text: str, modules: list[str]) -> list[str]:
    """The product modules (repository paths) that no cell of the layout table names, by path or by
    its path's tail (``rank.py``, ``_spawn_site/sitecustomize.py``): a newcomer reading the table would not know they exist."""
    named = set()
    for row in (line for line in section(text, "Layout").splitlines() if line.startswith("| `")):
        named |= set(CODE_SPAN.findall(row))
    return [m for m in modules if os.path.basename(m) not in ("__init__.py", "__main__.py")
            and not any(m == n or m.endswith("/" + n) for n in named)]


def test_every_product_module_is_in_the_layout():
    modules = sorted(rel(p) for pkg in ("server", "shard_engine", "loaders")
                     for p in glob.glob(os.path.join(REPO, pkg, "**", "*.py"), recursive=True))
    assert len(modules) > 40, modules
    missing = unnamed_in_layout(read(README), modules)
    assert not missing, f"the README's layout table names none of {missing}"
    table = "## Layout\n\n| path | what |\n|---|---|\n| `server/engine/` | `rank.py` |\n\n## Next\n"
    assert unnamed_in_layout(table, ["server/engine/rank.py", "server/engine/gone.py", "server/__init__.py"]) \
        == ["server/engine/gone.py"]


def test_every_docs_page_is_linked_from_the_readme():
    linked = {os.path.normpath(os.path.join(REPO, t.partition("#")[0])) for t in LINK.findall(prose(read(README)))}
    unlinked = [rel(p) for p in PAGES[1:] if p not in linked]
    assert not unlinked, f"README.md links to none of {unlinked}"


def test_github_anchors():
    assert slug("Checkpoints in object storage (`--model s3://bucket/prefix`)") == \
        "checkpoints-in-object-storage---model-s3bucketprefix"
    assert slug("The page (`GET /`)") == "the-page-get-"
    assert slug("A request's way through the system") == "a-requests-way-through-the-system"
    assert slug("On a GPU: `make gpu-check` (`python -m benchmarks.gpu_check --out DIR`)") == \
        "on-a-gpu-make-gpu-check-python--m-benchmarksgpu_check---out-dir"


def test_the_checks_find_what_is_broken():
    page = os.path.join(REPO, "docs", "broken.md")  # never written: the checkers read the text given
    text = "\n".join([
        "# Broken", "",
        "[a file](nowhere.md), [a heading](api.md#no-such-heading), [out](../../elsewhere.md),",
        "![a picture](../server/http/ui/screenshots/missing.png), [fine](api.md#metrics-get-metrics)", "",
        "```bash", "hsdp-serve --no-such-flag --port 1", "make no-such-target", "make serve ARGS=x",
        "make serve ARGS='--no-such-port 1'",
        "python -m benchmarks.step --no-such-option", "python -m server.nothing", "```", "",
        "`hsdp-load --model X --not-a-load-flag`",
    ])
    links = broken_links(page, text)
    assert len(links) == 4, links
    assert [p for p in links if "nowhere.md" in p] and [p for p in links if "#no-such-heading" in p]
    assert [p for p in links if "leaves the repository" in p] and [p for p in links if "missing.png" in p]
    commands = unknown_commands(page, text)
    for needle in ("--no-such-flag", "no-such-target", "--no-such-port", "--no-such-option", "server.nothing",
                   "--not-a-load-flag"):
        assert [p for p in commands if needle in p], (needle, commands)
    assert len(commands) == 6, commands  # `make serve ARGS=x` is fine: serve passes ARGS on
    layout = missing_in_layout(
        "## Layout\n\n| path | what |\n|---|---|\n| `server/engine/` | `rank.py` (`NoSuchEngine`), `gone.py` |\n"
        "| `no_such_dir/` | x |\n\n## Where a change goes\n\n" + "- `server/config.py`\n" * 4
        + "- `SamplingParams` in `server/engine/rank.py`, `server/nowhere.py`\n\n"
        "## A request's way through the system\n\n```\nNoSuchRouter (server/engine/gone.py)\n```\n")
    for needle in ("NoSuchEngine", "gone.py is under none", "layout: no no_such_dir",
                   "rank.py defines no SamplingParams", "no server/nowhere.py", "no server/engine/gone.py",
                   "no class NoSuchRouter"):
        assert [p for p in layout if needle in p], (needle, layout)


def test_every_metric_is_in_the_api_page():
    from server.http.metrics import ServerMetrics

    with open(os.path.join(REPO, "docs", "api.md")) as f:
        page = f.read()
    names = {m.name for m in ServerMetrics().registry.collect()}
    missing = sorted(n for n in names if f"`{n}" not in page)
    assert missing == [], f"metrics missing from docs/api.md's table: {missing}"
