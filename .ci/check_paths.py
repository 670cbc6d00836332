#!/usr/bin/env python3
"""Every repository path named in the docs and in the code's text exists: fails listing file:line: path.

Reads README.md, docs/**/*.md, benchmarks/README.md and the text of src/, tests/, benchmarks/, workflow/,
Snakefile and .ci/ (Python 3.11+, standard library only; run from anywhere: `python3 .ci/check_paths.py`).
What counts as a path named in text:
- a token that starts with a top-level directory (src/, tests/, benchmarks/, docs/, workflow/, profiles/,
  resources/, envs/, config/, .ci/), or with dflash_eval/ (resolved under src/);
- a top-level file name (config.yaml, Snakefile, pyproject.toml, or an upper-case NAME.md such as README.md);
- a `dir/module.py` name (a directory part is required), resolved against the repository, src/dflash_eval/,
  src/, tests/, and the naming file's own directory and every directory above it (a package-relative name);
- a relative Markdown link target, resolved from the Markdown file's directory.
Templates match as patterns: `<stage>`, `{dataset}` and `*` stand for any name. Generated outputs (results/,
.snakemake/, resources/demo/) are skipped, and so is whatever ALLOW lists, each with its reason.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TOP_DIRS = ("src", "tests", "benchmarks", "docs", "workflow", "profiles", "resources", "envs", "config", ".ci")
TOP_FILES = ("config.yaml", "Snakefile", "pyproject.toml")
GENERATED = ("results/", ".snakemake/", "resources/demo/")
CODE_DIRS = ("src", "tests", "benchmarks", "workflow", ".ci")
CODE_SUFFIXES = {".py", ".smk", ".yaml", ".yml", ".rst", ".sh", ".toml", ".json", ".md", ""}
SKIP_DIRS = {"__pycache__", ".pytest_cache", ".ruff_cache", "results", "dflash_eval.egg-info"}  # egg-info: pip writes it  # benchmarks/results: dated records, not read

# pattern (matched against the whole path) -> why it is not a path of this repository
ALLOW: dict[str, str] = {
    r"(entrypoints|managers|models|speculative|arg_groups|utils|srt|layers|sampling|observability)/.*": "a file inside SGLang's wheel (sglang/srt/)",
    r"sglang/.*": "a file inside SGLang's wheel",
    r"(engine|v1|model_executor|completion|chat_completion|generate|serve|instrumentator|vllm)/.*|"
    r"config/(speculative|observability|vllm|model)\.py": "a file inside vLLM's wheel (vllm/)",
    r"dflash/.*": "a file of z-lab/dflash, the reference implementation",
    r"benchmarks/benchmarker/?": "SpecForge's benchmark directory (sgl-project/SpecForge)",
    r"(transformers|fla|torch)/.*": "a file inside a third-party package",
    r"dir/module\.py|NAME\.md": "this checker's and docs/testing.md's description of what a path looks like",
}

_SEG = r"[\w.{}<>*-]"
PREFIXED = re.compile(r"(?<![\w./-])((?:%s|dflash_eval)/(?:%s+/)*%s*)" % ("|".join(re.escape(d) for d in TOP_DIRS), _SEG, _SEG))
MODULE = re.compile(r"(?<![\w./<>{}*-])((?:[\w{}<>*-]+/)+[\w{}<>*-]+\.py)\b")
UPPER_MD = re.compile(r"(?<![\w./-])([A-Z][A-Z_]+\.md)\b")
TOP_FILE = re.compile(r"(?<![\w./-])(%s)(?![\w/-])" % "|".join(re.escape(f) for f in TOP_FILES))
MD_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
TEMPLATE = re.compile(r"<[^>/]*>|\{[^}/]*\}")


def scanned_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "Snakefile", ROOT / "benchmarks" / "README.md"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    for top in CODE_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and path.suffix in CODE_SUFFIXES and not SKIP_DIRS & set(path.relative_to(ROOT).parts):
                files.append(path)
    seen, out = set(), []
    for f in files:
        if f.is_file() and f not in seen:
            seen.add(f)
            out.append(f)
    return out


def exists(base: Path, rel: str) -> bool:
    rel = rel.rstrip("/")
    if not rel:
        return base.is_dir()
    if TEMPLATE.search(rel) or "*" in rel:
        pattern = TEMPLATE.sub("*", rel)
        try:
            return any(base.glob(pattern))
        except (ValueError, NotImplementedError):
            return False
    return (base / rel).exists()


def spellings(path: str) -> list[str]:
    """The path, and for `dir/module.name` (a module's attribute) also `dir/module.py`."""
    head, _, last = path.rpartition("/")
    if head and "." in last and not last.endswith((".py", ".md")):
        return [path, f"{head}/{last.split('.')[0]}.py"]
    return [path]


def candidates(path: str, named_in: Path, kind: str) -> list[Path]:
    if kind == "link":
        return [named_in.parent]
    if path.startswith("dflash_eval/"):
        return [ROOT / "src"]
    if kind == "prefixed":
        return [ROOT]
    bases = [ROOT, ROOT / "src" / "dflash_eval", ROOT / "src", ROOT / "tests"]
    d = named_in.parent
    while d != ROOT and ROOT in d.parents:
        bases.append(d)
        d = d.parent
    return bases


def allowed(path: str) -> bool:
    return any(re.fullmatch(p, path.rstrip("/") + ("/" if path.endswith("/") else "")) or re.fullmatch(p, path)
               for p in ALLOW)


def paths_in(line: str, is_markdown: bool):
    spans = []
    for kind, rx in (("prefixed", PREFIXED), ("module", MODULE), ("upper_md", UPPER_MD), ("top_file", TOP_FILE)):
        for m in rx.finditer(line):
            if any(a <= m.start(1) < b for a, b in spans):
                continue  # a module name inside a path already taken
            spans.append((m.start(1), m.end(1)))
            yield kind, m.group(1)
    if is_markdown:
        for m in MD_LINK.finditer(line):
            target = m.group(1)
            if not re.match(r"^[a-z]+:", target) and not target.startswith("/"):
                yield "link", target


def clean(path: str) -> str:
    path = path.rstrip(".,;:'\")`")
    while path.endswith(".") and not path.endswith("/."):
        path = path[:-1]
    return path


def check() -> list[str]:
    problems = []
    for f in scanned_files():
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        rel_file = f.relative_to(ROOT).as_posix()
        for lineno, line in enumerate(text.splitlines(), 1):
            for kind, raw in paths_in(line, f.suffix == ".md"):
                path = clean(raw)
                if not path or path.startswith(GENERATED) or path + "/" in GENERATED or allowed(path):
                    continue
                if kind == "prefixed" and path.rstrip("/") in TOP_DIRS:
                    continue
                if not any(exists(base, p) for base in candidates(path, f, kind) for p in spellings(path)):
                    problems.append(f"{rel_file}:{lineno}: {path}")
    return problems


def main() -> int:
    problems = check()
    for p in problems:
        print(p)
    if problems:
        print(f"check_paths: {len(problems)} path(s) named in text do not exist (fix them, or add to ALLOW with a reason)",
              file=sys.stderr)
        return 1
    print("check_paths: every path named in the docs and the code's text exists")
    return 0


if __name__ == "__main__":
    sys.exit(main())
