"""The documentation's links: every relative link in README.md and docs/*.md points at a file
that exists and, where it names one, at a heading of that file (GitHub's anchors)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation other than - and _ dropped, spaces to -,
    a repeated id numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        if m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    return [a or b for a, b in LINK.findall(text)]


def test_anchor_rule_on_headings_like_ours(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# accelrl\n## Pong in minutes\n### APPO on a 2-core CPU (`x.py --no-cuda`, "
                    "Pong-v5)\n## Tests\n## Tests\n```\n# not a heading\n```\n")
    assert anchors(page) == {"accelrl", "pong-in-minutes", "tests", "tests-1",
                             "appo-on-a-2-core-cpu-xpy---no-cuda-pong-v5"}


def test_every_relative_link_resolves():
    broken = []
    for page in pages():
        for target in links(page):
            if re.match(r"[a-z]+:", target):  # https:, mailto:: not checked offline
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
    assert sum(len(links(p)) for p in pages()) >= 5  # the pages do link somewhere


def test_the_install_text_agrees_with_itself():
    """README, requirements.txt and .ci/run say the same: a plain `pip install torch==2.13.0` is
    the GPU (CUDA) build, PyTorch's CPU index gives the CPU one, and CI installs the CPU build by
    its `+cpu` name (PyPI has none, so it cannot fall back to the CUDA build)."""
    cpu = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    readme = (ROOT / "README.md").read_text()
    assert "pip install torch==2.13.0  " in readme and "# GPU machine (CUDA 13)" in readme
    assert cpu in readme and "# CPU-only machine" in readme
    head = " ".join(ln.lstrip("# ") for ln in (ROOT / "requirements.txt").read_text().splitlines()
                    if ln.startswith("#"))
    assert cpu in head and "on a GPU machine `pip install torch==2.13.0`" in head
    ci = (ROOT / ".ci" / "run").read_text()
    install = [ln for ln in ci.splitlines() if "pip install" in ln and "torch" in ln]
    assert install == ["python -m pip install -q --retries 0 --extra-index-url "
                       "https://download.pytorch.org/whl/cpu torch==2.13.0+cpu"]
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert "[LICENSE](LICENSE)" in readme
