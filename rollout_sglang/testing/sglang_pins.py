"""Our pins beside SGLang's: is the `sglang` extra installable? Checked offline, from the pinned wheel's metadata.

setup.py's requirements (``install_requires`` plus the ``sglang`` and ``gpu`` extras, read from setup.py's
source) and constraints.txt's exact versions are compared with the ``Requires-Dist`` of a distribution file
(the SGLang wheel that :func:`~rollout_sglang.testing.sglang_contract.find_wheel` finds; a Transformer Engine
wheel or sdist): every requirement both sides name must leave some version that satisfies both, and
constraints.txt's version must satisfy the other side's (the dev environment tests versions SGLang accepts),
except for :data:`DEV_ONLY`. Markers are evaluated for the platform the SGLang wheel is built for
(:data:`TARGET_ENV`). This sees direct requirements only: ``.ci/run`` also runs pip's real resolver
(``pip install --dry-run --ignore-installed '.[sglang]'``) for the transitive ones.

``python -m rollout_sglang.testing.sglang_pins [FILE...]`` prints the conflicts (none: exit 0).
"""
from __future__ import annotations

import argparse
import ast
import email.parser
import sys
import tarfile
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

#: the platform the pinned SGLang wheel is built for (cp311, manylinux x86_64): markers are evaluated there
TARGET_ENV = {"python_version": "3.11", "python_full_version": "3.11.7", "implementation_name": "cpython",
              "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
              "os_name": "posix", "platform_machine": "x86_64"}
#: the extras of setup.py installed beside SGLang
EXTRAS = ("sglang", "gpu")
#: constraints.txt pins that are meant to differ from SGLang's: the CPU dev environment (``make install``)
#: tests these versions; the `sglang` extra resolves to SGLang's own, which setup.py's ranges admit. So
#: ``pip install -c constraints.txt '.[sglang]'`` does not resolve (nor, transitively, would huggingface_hub
#: 2.x, which tokenizers 0.23.3 brings and SGLang's tokenizers 0.23.2 refuses)
DEV_ONLY = {
    "torch": "the dev environment runs the CPU build of torch 2.13.0 (Makefile); SGLang needs its CUDA build",
    "transformers": "the dev environment tests the newest transformers that setup.py's range admits",
    "tokenizers": "follows the dev environment's transformers",
}


# ------------------------------------------------------------------------------------------ reading
def dist_requirements(path: str | Path) -> list[Requirement]:
    """The ``Requires-Dist`` of a wheel (``*.dist-info/METADATA``), an sdist (``PKG-INFO``) or a bare
    ``.metadata`` file (PEP 658)."""
    path = Path(path)
    name = path.name
    if name.endswith(".whl"):
        with zipfile.ZipFile(path) as z:
            meta = next(n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
            text = z.read(meta).decode()
    elif name.endswith((".tar.gz", ".tgz")):
        with tarfile.open(path) as t:
            member = min((m for m in t.getmembers() if m.name.endswith("/PKG-INFO")), key=lambda m: m.name.count("/"))
            text = t.extractfile(member).read().decode()  # type: ignore[union-attr]
    else:
        text = path.read_text()
    msg = email.parser.Parser().parsestr(text, headersonly=True)
    return [Requirement(r) for r in msg.get_all("Requires-Dist") or []]


def setup_requirements(setup_py: str | Path) -> tuple[list[str], dict[str, list[str]]]:
    """``install_requires`` and ``extras_require`` of setup.py, read from its source (literals; never run)."""
    tree = ast.parse(Path(setup_py).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setup":
            kw = {k.arg: k.value for k in node.keywords}
            return ast.literal_eval(kw["install_requires"]), ast.literal_eval(kw.get("extras_require", ast.Dict()))
    raise ValueError(f"{setup_py}: no setup(...) call")


def ours(setup_py: str | Path, extras: Iterable[str] = EXTRAS) -> list[Requirement]:
    """What installing ``.[<extras>]`` asks for directly."""
    base, extra = setup_requirements(setup_py)
    return [Requirement(r) for r in [*base, *(r for e in extras for r in extra.get(e, []))]]


def read_constraints(path: str | Path) -> dict[str, Version]:
    """constraints.txt: canonical name -> its exact version (``name==version`` lines)."""
    out = {}
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            out[canonicalize_name(req.name)] = Version(spec.version)
    return out


def active(req: Requirement, extras: Iterable[str] = (), env: Mapping[str, str] = TARGET_ENV) -> bool:
    """Whether ``req`` applies on ``env`` when the distribution is installed with ``extras``."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": e}) for e in ("", *extras))


# ------------------------------------------------------------------------------------- intersection
def _neighbours(v: Version) -> list[Version]:
    """``v`` and versions just above and just below it: where two specifier sets' intervals could meet."""
    rel = list(v.release)
    out = [v, Version(".".join(map(str, [*rel, 0, 0, 1]))), Version(".".join(map(str, [*rel, 0, 0, 2])))]
    for i in range(len(rel) - 1, -1, -1):
        if rel[i] > 0:
            out.append(Version(".".join(map(str, [*rel[:i], rel[i] - 1, 999999]))))
            break
    return out


def candidates(*specs: SpecifierSet) -> list[Version]:
    """The versions worth trying against ``specs``: every bound, each side of it, and the extremes."""
    out = [Version("0"), Version("999999")]
    for ss in specs:
        for s in ss:
            text = s.version.removesuffix(".*")
            try:
                out += _neighbours(Version(text))
            except InvalidVersion:  # an ``===`` arbitrary string: no version of ours can equal it
                continue
            if s.operator == "~=":  # ~=X.Y.Z admits up to X.(Y+1) exclusive
                rel = Version(text).release
                out += _neighbours(Version(".".join(map(str, [*rel[:-2], rel[-2] + 1]))))
    return out


def intersects(a: SpecifierSet, b: SpecifierSet) -> bool:
    """Whether some version satisfies both ``a`` and ``b`` (pre-releases count)."""
    return any(a.contains(v, prereleases=True) and b.contains(v, prereleases=True) for v in candidates(a, b))


# ------------------------------------------------------------------------------------------- checks
def conflicts(mine: Iterable[Requirement], theirs: Iterable[Requirement], theirs_name: str,
              constraints: Mapping[str, Version] | None = None, theirs_extras: Iterable[str] = (),
              dev_only: Mapping[str, str] = DEV_ONLY, env: Mapping[str, str] = TARGET_ENV) -> list[str]:
    """One message per requirement that ``theirs`` (the ``Requires-Dist`` of ``theirs_name``, installed with
    ``theirs_extras``) shares with ``mine`` (setup.py, markers and extras already applied) and no version can
    meet; and, with ``constraints``, per constraints.txt pin that ``theirs`` refuses (``dev_only`` excepted)."""
    theirs_extras = tuple(theirs_extras)
    by_name: dict[str, list[Requirement]] = {}
    for r in mine:
        if active(r, (), env):
            by_name.setdefault(canonicalize_name(r.name), []).append(r)
    out = []
    for t in theirs:
        if not active(t, theirs_extras, env):
            continue
        name = canonicalize_name(t.name)
        for m in by_name.get(name, []):
            if not intersects(m.specifier, t.specifier):
                out.append(f"setup.py requires {m} but {theirs_name} requires {t}: no version satisfies both, so "
                           f"pip ends in ResolutionImpossible; loosen setup.py's {m.name} to a range that admits "
                           f"{t.specifier or 'any version'} (the exact version goes in constraints.txt)")
        pinned = (constraints or {}).get(name)
        if pinned is not None and name not in dev_only and not t.specifier.contains(pinned, prereleases=True):
            out.append(f"constraints.txt pins {name}=={pinned} but {theirs_name} requires {t}: pin a version that "
                       f"satisfies {t.specifier} (and setup.py's range), so that CI tests a version SGLang accepts "
                       f"(or, if the dev environment must differ, add it to DEV_ONLY with the reason)")
    return out


def stale_dev_only(theirs: Iterable[Requirement], constraints: Mapping[str, Version],
                   dev_only: Mapping[str, str] = DEV_ONLY, env: Mapping[str, str] = TARGET_ENV) -> list[str]:
    """The :data:`DEV_ONLY` exceptions no longer needed: their constraints.txt version now satisfies ``theirs``."""
    need = {canonicalize_name(t.name) for t in theirs if active(t, (), env)
            and canonicalize_name(t.name) in constraints
            and not t.specifier.contains(constraints[canonicalize_name(t.name)], prereleases=True)}
    return sorted(set(dev_only) - need)


def check(root: str | Path, dists: Iterable[str | Path]) -> list[str]:
    """Every conflict between the repository at ``root`` (setup.py with :data:`EXTRAS`, constraints.txt) and
    each distribution file in ``dists``."""
    root = Path(root)
    mine, pins = ours(root / "setup.py"), read_constraints(root / "constraints.txt")
    return [msg for d in dists for msg in conflicts(mine, dist_requirements(d), Path(d).name, pins)]


def main(argv: list[str] | None = None) -> None:
    """``python -m rollout_sglang.testing.sglang_pins [FILE...]``: the conflicts with each distribution file
    (default: the pinned SGLang wheel); exit status 1 when there are any."""
    from rollout_sglang.testing.sglang_contract import SGLANG_PIN, find_wheel

    ap = argparse.ArgumentParser(description="check setup.py and constraints.txt against SGLang's requirements")
    ap.add_argument("dists", nargs="*", help="wheels, sdists or .metadata files (default: the pinned SGLang wheel)")
    ap.add_argument("--root", default=".", help="the repository (setup.py, constraints.txt)")
    args = ap.parse_args(argv)
    dists = args.dists or [find_wheel(fetch=True)]
    if None in dists:
        sys.exit(f"the sglang=={SGLANG_PIN} wheel could not be had; set AGENTRL_SGLANG_WHEEL")
    found = check(args.root, dists)
    for msg in found:
        print(msg)
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
