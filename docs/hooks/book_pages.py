"""MkDocs hook: put the chapter READMEs into the site at build time, without copying them by hand.

The chapters' text lives in ``0X_chapter/README.md`` beside their code; ``docs/`` holds only the
book-level pages. At build time this hook:

* adds each chapter README as the page ``0X_chapter/README.md`` (served as ``0X_chapter/``) and
  the repository's ``README.md`` as ``getting-started.md``, and lists the chapters in the nav; a
  chapter's other pages (``0X_chapter/*.md``, ``0X_chapter/topics/*.md``) are published beside
  its README and listed under it, in the order the README links them;
* rewrites the relative links of every page, ``docs/`` included, for the site: the pages are
  written for the repository (``docs/reading-path.md`` links ``../01_paged_kv/README.md``), so a
  link into ``docs/`` points at that page, a link to a README at its page, and a link to any other
  file of the repository (code, a figure) keeps working because that file is published beside the
  page;
* fills the generated sections of the ``docs/`` pages afresh (``GENERATED``): the chapter sizes,
  the engine's imports, the figures, each chapter page's measured results, the exercises; and
  those of the chapters' topic pages: the deploying page's table of ``vllm serve``'s flags and of
  vLLM's CPU environment variables.

The generated sections are also committed, between ``<!-- book:NAME -->`` and
``<!-- /book:NAME -->``, so the pages read complete in the repository without a build;
``python docs/hooks/book_pages.py --write`` refreshes them and ``--check`` fails when one is stale
(``tests/test_docs_build.py`` runs it). A link to something that does not exist is left alone, so
``mkdocs build --strict`` still fails on it. Registered in ``mkdocs.yml`` under ``hooks:``.
"""

from __future__ import annotations

import argparse
import ast
import json
import posixpath
import re
import sys
from collections.abc import Callable
from pathlib import Path

import tomllib
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
CHAPTER_RE = re.compile(r"^\d\d_[a-z0-9_]+$")
# [text](target) and ![alt](target); the target stops at whitespace or ')'.
LINK_RE = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\s+\"[^\"]*\")?\)")
FENCE_RE = re.compile(r"^(```|~~~)")
RESULTS_HEADING_RE = re.compile(r"^(#{2,3})\s+(.*(result|measur|benchmark|numbers).*)$", re.I)


def chapters() -> list[str]:
    """Chapter directories that have a README, in book order."""
    return sorted(
        p.name for p in ROOT.iterdir() if p.is_dir() and CHAPTER_RE.match(p.name) and (p / "README.md").is_file()
    )


def page_title(repo_path: str) -> str:
    """A page's first heading, else its file name."""
    for line in (ROOT / repo_path).read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return posixpath.basename(posixpath.dirname(repo_path)) if repo_path.endswith("README.md") else repo_path


def chapter_title(chapter: str) -> str:
    """The README's first heading, else the directory name."""
    return page_title(f"{chapter}/README.md")


def chapter_pages(chapter: str) -> list[str]:
    """The chapter's Markdown pages (repository paths): its README, then its other pages
    (``*.md`` beside the README, ``topics/*.md``) in the order the README first links them,
    then any it does not link, by name."""
    d = ROOT / chapter
    others = sorted(
        p.relative_to(ROOT).as_posix() for p in [*d.glob("*.md"), *d.glob("topics/*.md")] if p.name != "README.md"
    )
    linked = []
    for m in LINK_RE.finditer((d / "README.md").read_text(encoding="utf-8")):
        target = posixpath.normpath(posixpath.join(chapter, m.group(2).partition("#")[0]))
        if target in others and target not in linked:
            linked.append(target)
    return [f"{chapter}/README.md", *linked, *(p for p in others if p not in linked)]


# Repository files published as pages: repo path -> site path.
def _pages() -> dict[str, str]:
    pages = {"README.md": "getting-started.md"}
    pages.update({p: p for c in chapters() for p in chapter_pages(c)})
    return pages


def _split_lines_outside_fences(text: str):
    """Yield (line, in_code) so links inside code blocks are never touched."""
    in_code = False
    for line in text.splitlines(keepends=True):
        if FENCE_RE.match(line.lstrip()):
            in_code = not in_code
            yield line, True
            continue
        yield line, in_code


def _split_runs_outside_fences(text: str):
    """Yield (run of lines, in_code): a link whose text wraps onto the next line stays whole."""
    run, run_in_code = "", False
    for line, in_code in _split_lines_outside_fences(text):
        if run and in_code != run_in_code:
            yield run, run_in_code
            run = ""
        run, run_in_code = run + line, in_code
    if run:
        yield run, run_in_code


def rewrite_links(text: str, repo_path: str, site_path: str, pages: dict[str, str], assets: dict[str, str]) -> str:
    """Point the relative links of ``repo_path`` (published at ``site_path``) at site paths.

    Repository files linked that are neither pages nor docs are collected in ``assets``
    (site path -> repo path) to be published as they are.
    """
    repo_dir = posixpath.dirname(repo_path)
    site_dir = posixpath.dirname(site_path)

    def fix(match: re.Match) -> str:
        prefix, target, title = match.group(1), match.group(2), match.group(3) or ""
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return match.group(0)
        path, _, anchor = target.partition("#")
        resolved = posixpath.normpath(posixpath.join(repo_dir, path))
        if resolved.startswith(".."):
            return match.group(0)
        if posixpath.join(resolved, "README.md") in pages:  # a link to a chapter's folder
            resolved = posixpath.join(resolved, "README.md")
        if resolved in pages:
            new = pages[resolved]
        elif resolved.startswith("docs/") and (ROOT / resolved).exists():
            new = resolved[len("docs/") :]
        elif (ROOT / resolved).is_file():
            new = resolved
            assets[new] = resolved
        else:
            return match.group(0)  # broken: left for --strict to report
        rel = posixpath.relpath(new, site_dir or ".")
        return f"{prefix}{rel}{'#' + anchor if anchor else ''}{title})"

    return "".join(run if in_code else LINK_RE.sub(fix, run) for run, in_code in _split_runs_outside_fences(text))


def relocate_links(text: str, from_path: str, to_path: str) -> str:
    """Rewrite the relative links of text taken from repository file ``from_path`` so that they
    point at the same files from ``to_path`` (links to files that do not exist are left alone)."""
    from_dir, to_dir = posixpath.dirname(from_path), posixpath.dirname(to_path)

    def fix(match: re.Match) -> str:
        prefix, target, title = match.group(1), match.group(2), match.group(3) or ""
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return match.group(0)
        path, _, anchor = target.partition("#")
        resolved = posixpath.normpath(posixpath.join(from_dir, path))
        if resolved.startswith("..") or not (ROOT / resolved).exists():
            return match.group(0)
        rel = posixpath.relpath(resolved, to_dir or ".")
        return f"{prefix}{rel}{'#' + anchor if anchor else ''}{title})"

    return "".join(run if in_code else LINK_RE.sub(fix, run) for run, in_code in _split_runs_outside_fences(text))


def results_section(chapter: str, repo_path: str | None = None) -> str | None:
    """The measured-results section (heading to the next heading of its level) of the chapter's
    README, or of another of its pages."""
    lines = (ROOT / (repo_path or f"{chapter}/README.md")).read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        m = RESULTS_HEADING_RE.match(line)
        if not m:
            continue
        level = len(m.group(1))
        body = []
        in_code = False
        for nxt in lines[i + 1 :]:
            if FENCE_RE.match(nxt.lstrip()):
                in_code = not in_code
            if not in_code and re.match(rf"^#{{1,{level}}}\s", nxt):
                break
            body.append(nxt)
        return "\n".join(body).strip()
    return None


def chapter_results_markdown() -> str:
    """Each chapter page's measured-results section, its links fixed for ``docs/results.md``."""
    parts = []
    for chapter in chapters():
        for repo_path in chapter_pages(chapter):
            section = results_section(chapter, repo_path)
            if section is None:
                continue
            section = relocate_links(section, repo_path, "docs/results.md")
            section = re.sub(r"^(#{1,4}) ", lambda m: "#" * min(len(m.group(1)) + 2, 6) + " ", section, flags=re.M)
            title = chapter_title(chapter)
            if not repo_path.endswith("/README.md"):
                title = f"{title}: {page_title(repo_path)}"
            where = chapter if repo_path.endswith("/README.md") else repo_path
            parts.append(f"### {title}\n\nFrom [{where}](../{repo_path}).\n\n{section}\n")
    return "\n".join(parts) if parts else "_No chapter has published measured results yet._\n"


def exercises_markdown() -> str:
    parts = []
    for registry in sorted((ROOT / "exercises").glob("*/exercises.toml")):
        chapter = registry.parent.name
        with open(registry, "rb") as f:
            data = tomllib.load(f)
        rows = ["| id | you write | in | checked by |", "| --- | --- | --- | --- |"]
        for ex in data.get("exercise", []):
            module, qualname = ex["target"].split(":")
            stub_file = ex["stub"].split(":")[0]
            tests = "<br>".join(
                [f"`{t.split('::', 1)[1]}`" for t in ex["tests"]]
                + [f"`{t.split('::', 1)[1]}` (differential)" for t in ex.get("differential", [])]
            )
            rows.append(
                f"| {ex['id']} | `{qualname}` ({module}.py): {ex['title']} | "
                f"`exercises/{chapter}/{stub_file}` | {tests} |"
            )
        title = chapter_title(chapter) if (ROOT / chapter / "README.md").exists() else chapter
        link = f"[{title}](../{chapter}/README.md)" if (ROOT / chapter / "README.md").exists() else title
        parts.append(f"### {link}\n\n" + "\n".join(rows) + "\n")
    return "\n".join(parts)


def chapter_sizes_markdown() -> str:
    """Words of prose and lines of code per page of each chapter, and the reading time they suggest.

    A chapter with pages of its own (chapter 07's topics) gets a row per page, each with the modules
    it walks through: a module or test file belongs to the other page that names it most often, or
    to the README where no other page names it. Benchmark scripts are run, not read, so they are
    not counted. Reading time: prose at 200 words a minute, modules at 20 lines a minute (code is
    read twice: once for the idea, once for the edge cases), tests at 60 lines a minute. Words are
    rounded to hundreds and lines to fifties, and the time is computed from the rounded sizes: the
    committed table (docs/reading-path.md) then changes when a chapter grows, not at every edit.
    """
    rows = [
        "| page | words | module lines | test lines | reading time |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for chapter in chapters():
        for page, (words, code, tests) in _page_sizes(chapter).items():
            words, code, tests = _round_to(words, 100), _round_to(code, 50), _round_to(tests, 50)
            minutes = words / 200 + code / 20 + tests / 60
            name = chapter if page.endswith("README.md") else f"{chapter}: {page_title(page)}"
            rel = posixpath.relpath(page, "docs")
            rows.append(f"| [{name}]({rel}) | {words:,} | {code:,} | {tests:,} | {_duration(minutes)} |")
    return "\n".join(rows) + "\n"


def _page_sizes(chapter: str) -> dict[str, tuple[int, int, int]]:
    """Each page of ``chapter``: (words, module lines, test lines) as chapter_sizes_markdown counts them."""
    pages = chapter_pages(chapter)
    texts = {page: (ROOT / page).read_text(encoding="utf-8") for page in pages}
    files = [p for p in (ROOT / chapter).rglob("*.py") if not {"__pycache__", "benchmarks"} & set(p.parts)]
    # The README's table names every module once; a page that walks through one names it too.
    owner = {f: max(pages[1:], key=lambda page: texts[page].count(f.name), default=pages[0]) for f in files}
    owner = {f: page if texts[page].count(f.name) else pages[0] for f, page in owner.items()}
    sizes = {}
    for page in pages:
        own = [f for f in files if owner[f] == page]
        tests = sum(_code_lines(f) for f in own if f.name.startswith("test_"))
        code = sum(_code_lines(f) for f in own if not f.name.startswith("test_"))
        sizes[page] = (len(texts[page].split()), code, tests)
    return sizes


def _round_to(n: int, step: int) -> int:
    return max(step, round(n / step) * step)


def _code_lines(path: Path) -> int:
    return sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())


def _duration(minutes: float) -> str:
    minutes = 5 * max(1, round(minutes / 5))
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


def chapter_modules() -> dict[str, str]:
    """Flat module name -> chapter, for every module a chapter folder holds (tests excluded)."""
    return {
        p.stem: c
        for c in chapters()
        for p in (ROOT / c).glob("*.py")
        if not p.name.startswith("test_") and p.name not in ("demo.py", "conftest.py")
    }


def book_modules() -> dict[str, str]:
    """Every module of the book as its text names it -> the path to import it by.

    Chapter modules are imported flat (``scheduler``, ``chunked_prefill``); the engine package's
    modules by their dotted path (``vllm_from_scratch.layers.linear``) and, where no chapter
    module has that name, by their last part too (``linear``, ``model_runner``), the way the
    chapter READMEs write them. ``tests/test_documented_names.py`` resolves documented names
    through this map.
    """
    modules = {name: name for name in chapter_modules()}
    package = ROOT / "07_engine" / "vllm_from_scratch"
    for path in sorted(package.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = path.relative_to(package.parent).with_suffix("").parts
        dotted = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[dotted] = dotted
        modules.setdefault(dotted.rsplit(".", 1)[-1], dotted)
    return modules


def engine_imports_markdown() -> str:
    """Which chapter modules each engine module imports, read from the code itself (AST)."""
    owners = chapter_modules()
    package = ROOT / "07_engine" / "vllm_from_scratch"
    rows = ["| engine module | imports from the chapters |", "| --- | --- |"]
    for path in sorted(package.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        used = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                top = node.module.split(".")[0]
                if top in owners and owners[top] != "07_engine":
                    used.setdefault(top, []).extend(a.name for a in node.names)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in owners and owners[a.name] != "07_engine":
                        used.setdefault(a.name, [])
        if used:
            cells = "<br>".join(
                f"`{m}` ({owners[m][:2]}): {', '.join(f'`{n}`' for n in names) or 'module'}"
                for m, names in sorted(used.items(), key=lambda kv: owners[kv[0]])
            )
            rows.append(f"| `{path.relative_to(package.parent).as_posix()}` | {cells} |")
    if len(rows) == 2:
        return "_The engine imports no chapter module yet._\n"
    return "\n".join(rows) + "\n"


def figures_markdown() -> str:
    """Every figure docs/make_figures.py drew, with its caption and the command behind it."""
    manifest = ROOT / "docs" / "figures" / "figures.json"
    if not manifest.exists():
        return "_No figure yet: run `python docs/make_figures.py`._\n"
    parts = []
    for fig in json.loads(manifest.read_text(encoding="utf-8")):
        if not (ROOT / "docs" / fig["image"]).exists():
            continue
        where = f"[{fig['chapter']}](../{fig['chapter']}/README.md)" if fig["chapter"] in chapters() else fig["chapter"]
        parts.append(
            f"### {fig['title']}\n\n![{fig['title']}]({fig['image']})\n\n{fig['caption']}\n\n"
            f"Chapter {where}. Produced by `{fig['command']}` on {fig['machine']} "
            f"({fig['date'][:10]}); raw output in `docs/data/{fig['name']}.txt`.\n"
        )
    return "\n".join(parts)


def cell(text: str) -> str:
    """``text`` inside a Markdown table's cell: a ``|`` of its own does not end the cell."""
    return text.replace("|", "\\|")


def vllm_serve_flags_markdown() -> str:
    """Every flag of ``vllm serve`` beside ours (07_engine/benchmarks/vllm_serve_flags.py)."""
    import vllm_serve_flags

    return vllm_serve_flags.table_markdown()


def vllm_env_markdown() -> str:
    """vLLM's CPU environment variables: which the engine honours, which it refuses (vllm_env.py)."""
    from vllm_from_scratch import vllm_env

    rows = ["| variable | here | what it does, or why it is refused |", "| --- | --- | --- |"]
    rows += [f"| `{name}` | honoured | {cell(what)} |" for name, what in vllm_env.HONOURED.items()]
    rows += [
        f"| `{name}` | refused unless `{default}` (vLLM's default) | it {cell(why)} |"
        for name, (default, why) in vllm_env.REFUSED.items()
    ]
    return "\n".join(rows)


# ------------------------------------------------------------------ generated sections
GENERATED: dict[str, Callable[[], str]] = {  # <!-- book:NAME --> -> what fills it (links from its page)
    "chapter-sizes": chapter_sizes_markdown,
    "engine-imports": engine_imports_markdown,
    "figures": figures_markdown,
    "chapter-results": chapter_results_markdown,
    "exercises": exercises_markdown,
    "vllm-serve-flags": vllm_serve_flags_markdown,
    "vllm-cpu-env": vllm_env_markdown,
}
# A committed section, begin and end markers alone on their lines; or a begin marker alone.
SECTION_RE = re.compile(
    r"^<!-- book:(?P<name>[a-z-]+) -->[ \t]*\n(?:(?P<body>.*?)^<!-- /book:(?P=name) -->[ \t]*$)?", re.M | re.S
)


def fill_sections(text: str, keep_markers: bool = True) -> str:
    """``text`` with every generated section made afresh.

    ``keep_markers=True`` is the repository's form (markers around each section, so the next
    refresh finds it); ``False`` is the site's (the content alone).
    """

    def fill(match: re.Match) -> str:
        name = match.group("name")
        if name not in GENERATED:
            return match.group(0)
        body = GENERATED[name]().strip("\n")
        return f"<!-- book:{name} -->\n\n{body}\n\n<!-- /book:{name} -->" if keep_markers else body

    return SECTION_RE.sub(fill, text)


def pages_with_sections() -> list[Path]:
    """The ``docs/`` pages and the chapters' topic pages that hold a generated section."""
    pages = [*sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("0*/topics/*.md"))]
    return [p for p in pages if SECTION_RE.search(p.read_text(encoding="utf-8"))]


def stale_pages() -> list[str]:
    """``docs/`` pages whose committed generated sections differ from what the code gives now."""
    return [
        p.relative_to(ROOT).as_posix()
        for p in pages_with_sections()
        if fill_sections(text := p.read_text(encoding="utf-8")) != text
    ]


def write_sections() -> list[str]:
    """Refresh the generated sections of the ``docs/`` pages in place; the pages that changed."""
    changed = stale_pages()
    for path in changed:
        page = ROOT / path
        page.write_text(fill_sections(page.read_text(encoding="utf-8")), encoding="utf-8")
    return changed


# ---------------------------------------------------------------------------- MkDocs events
_assets: dict[str, str] = {}


def docs_page_for_site(text: str, src_uri: str, pages: dict[str, str], assets: dict[str, str]) -> str:
    """A ``docs/`` page as the site serves it: sections filled afresh, links pointed at the site."""
    return rewrite_links(fill_sections(text, keep_markers=False), f"docs/{src_uri}", src_uri, pages, assets)


def on_config(config):
    """List the chapters that exist in the nav, after the book-level pages."""
    nav = config.get("nav") or []
    chapter_nav = []
    for c in chapters():
        pages = chapter_pages(c)
        if len(pages) == 1:
            chapter_nav.append({chapter_title(c): pages[0]})
        else:  # a section: the README as its overview, then the chapter's other pages
            chapter_nav.append({chapter_title(c): [{"Overview": pages[0]}, *({page_title(p): p} for p in pages[1:])]})
    for i, entry in enumerate(nav):
        if isinstance(entry, dict) and "Chapters" in entry:
            nav[i] = {"Chapters": chapter_nav}
    config["nav"] = nav
    return config


def on_files(files, config):
    _assets.clear()
    pages = _pages()
    for repo_path, site_path in pages.items():
        text = fill_sections((ROOT / repo_path).read_text(encoding="utf-8"), keep_markers=False)
        text = rewrite_links(text, repo_path, site_path, pages, _assets)
        files.append(File.generated(config, site_path, content=text))
    # The docs pages are rewritten in on_page_markdown; the files they link to are published now.
    for page in files.documentation_pages():
        if page.src_uri not in pages.values() and page.abs_src_path:
            docs_page_for_site(Path(page.abs_src_path).read_text(encoding="utf-8"), page.src_uri, pages, _assets)
    for site_path, repo_path in sorted(_assets.items()):
        if files.get_file_from_path(site_path) is None:
            files.append(File.generated(config, site_path, abs_src_path=str(ROOT / repo_path)))
    return files


def on_page_markdown(markdown, page, config, files):
    pages = _pages()
    if page.file.src_uri in pages.values():  # a repository page: on_files already rewrote it
        return markdown
    return docs_page_for_site(markdown, page.file.src_uri, pages, {})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="The book's generated sections in docs/, and what the site publishes.")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help="refresh the generated sections of the docs/ pages")
    group.add_argument("--check", action="store_true", help="exit 1 when a generated section is stale")
    args = parser.parse_args()
    if args.write:
        print("\n".join(f"refreshed {p}" for p in write_sections()) or "every generated section is current")
    elif args.check:
        stale = stale_pages()
        print("\n".join(f"stale: {p}" for p in stale) or "every generated section is current")
        if stale:
            print("run: python docs/hooks/book_pages.py --write")
        sys.exit(1 if stale else 0)
    else:
        print("chapters:", ", ".join(chapters()) or "none")
        for c in chapters():
            print(f"{c}: pages {', '.join(chapter_pages(c))}")
        print("docs pages with generated sections:", ", ".join(p.name for p in pages_with_sections()) or "none")
