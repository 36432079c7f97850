"""The front door stays true to the code: README's layout names every module and folder at the top of each
package, and every file path the docs name exists."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("megatron_agentrl", "rollout_sglang", "env_controller")


def test_readme_layout_names_every_top_level_module():
    readme = ROOT.joinpath("README.md").read_text()
    layout = readme[readme.index("## Project layout"):readme.index("## Documentation")]
    missing = []
    for pkg in PACKAGES:
        section = layout[layout.index(f"\n{pkg}/"):]
        section = section[:re.search(r"\n\S", section[1:]).start() + 1]  # up to the next top-level entry
        for p in sorted(ROOT.joinpath(pkg).iterdir()):
            if p.name.startswith(("_", ".")) or (p.is_file() and p.suffix != ".py"):
                continue
            name = f"{p.name}/" if p.is_dir() else p.name
            if f"  {name}" not in section:
                missing.append(f"{pkg}/{name}")
    assert not missing, f"README's layout lacks {missing}"


def test_paths_named_in_the_docs_exist():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    pattern = re.compile(r"\b(?:tests|bench|tools|examples|%s)/[\w/.-]*\.(?:py|sh|yaml)\b" % "|".join(PACKAGES))
    missing = {(d.name, m.group(0)) for d in docs if d.name != "BENCHMARKS.md"  # records name paths of their day
               for m in pattern.finditer(d.read_text()) if not (ROOT / m.group(0)).exists()}
    assert not missing, sorted(missing)
