"""README.md is what users read first: one screen on what tfps is, the two commands, and links into
the documentation site (docs/, mkdocs.yml). These tests keep it short and current, keep every
command it shows runnable from this repository, and keep the site's nav and generated TrainingJob
reference in step with the files."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
MAX_README_LINES = 250
# The top-level folders whose files a command in README may name.
REPO_FOLDERS = ("api", "bench", "charts", "cli", "crds", "docs", "examples", "hack", "images", "operator", "runtime")


def _sh_blocks(text: str) -> list[str]:
    return re.findall(r"^```sh\n(.*?)^```", text, flags=re.S | re.M)


def _commands(block: str) -> list[list[str]]:
    """The block's commands as words, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", block)
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            out.append(words)
    return out


def _make_targets() -> set[str]:
    targets = set()
    for line in (REPO / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+(?:\s+[A-Za-z0-9_.-]+)*)\s*:(?!=)", line)
        if m and not line.startswith((".PHONY", "\t")):
            targets.update(m.group(1).split())
    return targets


def _repo_paths(words: list[str]) -> list[str]:
    """Words that name a file or folder of this repository (a shell variable in one stands for any name)."""
    out = []
    for word in words:
        word = word.split("=", 1)[-1] if word.startswith("-") else word
        if "/" in word and word.split("/", 1)[0] in REPO_FOLDERS and "://" not in word:
            out.append(word.rstrip(".,;:"))
    return out


def _exists(path: str) -> bool:
    if "$" in path:
        pattern = re.sub(r"\$\{?\w+\}?", "*", path).rstrip("/")
        return any(REPO.glob(pattern))
    return (REPO / path).exists()


def problems_in_sh_blocks(text: str) -> list[str]:
    """Every `make` target, script and repository path in the sh code blocks of `text` that does not exist."""
    targets = _make_targets()
    problems = []
    for block in _sh_blocks(text):
        for words in _commands(block):
            for i, word in enumerate(words):
                if word == "make":
                    problems += [f"make {t}: no such target" for t in words[i + 1 :] if t not in targets]
                    break
            if words[:2] == ["kubectl", "apply"] and "-f" in words:
                target = words[words.index("-f") + 1]
                if target != "-" and not _exists(target):
                    problems.append(f"kubectl apply -f {target}: not in the repository")
            problems += [f"{p}: not in the repository" for p in _repo_paths(words) if not _exists(p)]
    return problems


def _nav_files(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [f for item in node for f in _nav_files(item)]
    if isinstance(node, dict):
        return [f for value in node.values() for f in _nav_files(value)]
    return []


def _mkdocs() -> dict:
    return yaml.safe_load((REPO / "mkdocs.yml").read_text())


def test_readme_opens_with_the_two_commands():
    text = README.read_text()
    first_block = text.split("```sh", 1)[1].split("```", 1)[0]
    assert [line.split()[:2] for line in first_block.strip().splitlines()] == [["make", "demo"], ["make", "test"]]


def test_readme_opens_with_what_tfps_is_before_any_command():
    head = README.read_text().split("```", 1)[0]
    assert len(head.splitlines()) <= 40, "the opening screen is too long"
    for words in ("Kubernetes", "parameter servers", "optimizer", "TFJob", "ParameterServerStrategy"):
        assert words in head, f"the opening screen does not say {words!r}"


def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines: move the detail into docs/"


def test_every_command_in_readme_names_what_exists():
    text = README.read_text()
    assert _sh_blocks(text), "README.md has no sh code block"
    problems = problems_in_sh_blocks(text)
    assert not problems, problems


def test_the_command_check_finds_what_is_missing():
    """The check above is only as good as what it catches: a target, a script and a manifest that do not exist."""
    text = "```sh\nmake demo nosuchtarget\nhack/no-such-script.sh up\nkubectl apply -f examples/nope.yaml\n```\n"
    problems = problems_in_sh_blocks(text)
    assert any("nosuchtarget" in p for p in problems)
    assert any("hack/no-such-script.sh" in p for p in problems)
    assert any("examples/nope.yaml" in p for p in problems)
    assert not problems_in_sh_blocks("```sh\nmake demo\nkubectl apply --server-side -f charts/tfps/crds/\n```\n")
    assert not problems_in_sh_blocks("```sh\ndocker build -f images/$i/Dockerfile .\n```\n")


def test_readme_links_resolve():
    text = README.read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link and not link.startswith("mailto:")]
    assert local, "README.md links nowhere into the docs"
    missing = [link for link in local if not (REPO / link).exists()]
    assert not missing, missing


def test_readme_and_performance_page_carry_no_diary():
    """Current figures only: no commit hashes, CPU models or per-run notes (`git log` keeps the history)."""
    hashes = re.compile(r"`[0-9a-f]{7,40}`|\bat [0-9a-f]{7,40}\b|\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
    cpus = re.compile(r"\b(EPYC|Xeon|Ryzen|Core i\d|family \d+, model \d+|AVX-512)\b", re.I)
    diary = re.compile(r"\b(this run|that run|an experiment patch|not kept|benchmark-history)\b", re.I)
    for page in (README, DOCS / "performance.md"):
        text = page.read_text()
        for pattern in (hashes, cpus, diary):
            found = pattern.findall(text)
            assert not found, f"{page.relative_to(REPO)}: {found}"


def test_docs_nav_lists_files_that_exist_and_every_page():
    config = _mkdocs()
    assert config["docs_dir"] == "docs" and config["theme"]["name"] == "material"
    listed = _nav_files(config["nav"])
    missing = [f for f in listed if not (DOCS / f).is_file()]
    assert not missing, f"mkdocs.yml's nav lists files that do not exist: {missing}"
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(listed) == pages, f"pages left out of the nav: {sorted(set(pages) - set(listed))}"


def test_metrics_reference_lists_every_metric():
    names = set()
    for module in (REPO / "runtime" / "metrics.py", REPO / "operator" / "metrics.py"):
        names |= set(re.findall(r'"(tfps_[a-z_]+)"', module.read_text()))
    assert names
    page = (DOCS / "reference" / "metrics.md").read_text()
    missing = sorted(n for n in names if f"`{n}`" not in page)
    assert not missing, f"docs/reference/metrics.md lacks: {missing}"


def test_api_reference_is_generated_from_the_crd():
    proc = subprocess.run(
        [sys.executable, str(REPO / "hack" / "gen-api-reference.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    text = (DOCS / "reference" / "trainingjob.md").read_text()
    for field in ("training.consistency.mode", "runPolicy.cleanPodPolicy", "replicaSpecs.Worker.replicas"):
        assert f"| `{field}` |" in text
