"""A pin in setup.py or constraints.txt must leave the `sglang` and `gpu` extras installable: checked offline
against the Requires-Dist of the pinned SGLang wheel (the wheel tests/rollout/test_sglang_contract.py reads),
so that the next conflicting pin fails `make test` rather than a user's `pip install '.[sglang]'`.

The wheel-reading tests skip, naming the reason, only when the wheel cannot be had; Transformer Engine's
requirements are read from whatever of its distribution files the wheel cache holds (``.ci/run`` fetches its
wheel, and runs pip's real resolver on `.[sglang]` and `.[sglang,gpu]`).
"""
from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from rollout_sglang.testing.sglang_contract import cache_dir
from rollout_sglang.testing.sglang_pins import (
    DEV_ONLY,
    active,
    check,
    conflicts,
    dist_requirements,
    intersects,
    ours,
    read_constraints,
    setup_requirements,
    stale_dev_only,
)

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------- the real pins
def test_setup_py_and_constraints_admit_the_pinned_sglang(wheel):
    found = check(ROOT, [wheel])
    assert not found, "\n".join(found)


def test_the_sglang_wheel_requirements_are_read(wheel):
    """The check sees what pip sees: SGLang's own exact pins, its platform markers evaluated for Linux x86_64."""
    reqs = {r.name.lower(): r for r in dist_requirements(wheel) if active(r)}
    assert str(reqs["openai"].specifier).startswith("==")
    assert "av" not in reqs  # aarch64 only
    assert "torch" in reqs and "checkpoint-engine" not in reqs  # an extra of SGLang's that the extra does not ask


def test_dev_only_exceptions_are_needed(wheel):
    """Each pin of constraints.txt allowed to differ from SGLang's does differ: one that has come in line is
    checked again."""
    stale = stale_dev_only(dist_requirements(wheel), read_constraints(ROOT / "constraints.txt"))
    assert not stale, f"constraints.txt now satisfies SGLang for {stale}: remove them from DEV_ONLY"
    assert set(DEV_ONLY) <= {r.name.lower() for r in ours(ROOT / "setup.py")}


def test_every_constraint_is_exact_and_every_requirement_is_in_constraints():
    pins = read_constraints(ROOT / "constraints.txt")
    base, extras = setup_requirements(ROOT / "setup.py")
    missing = [r for r in [*base, *extras["dev"]] if canonicalize_name(Requirement(r).name) not in pins]
    assert not missing, f"constraints.txt lacks the exact versions of {missing}"
    for r in [*base, *extras["dev"]]:
        req = Requirement(r)
        pinned = pins[canonicalize_name(req.name)]
        assert req.specifier.contains(pinned), f"constraints.txt pins {req.name}=={pinned} outside setup.py's {r}"


def test_transformer_engine_beside_sglang(wheel):
    """The `gpu` extra beside the `sglang` extra: Transformer Engine's requirements (its wheel, and the
    framework sdist and core wheels' metadata where cached) against ours and SGLang's."""
    _, extras = setup_requirements(ROOT / "setup.py")
    te = next(Requirement(r) for r in extras["gpu"] if Requirement(r).name == "transformer-engine")
    (spec,) = te.specifier
    cached = sorted(p for p in cache_dir().glob(f"transformer_engine*-{spec.version}*")
                    if p.name.endswith((".whl", ".tar.gz", ".metadata")))
    if not cached:
        pytest.skip(f"no transformer_engine*-{spec.version} distribution in {cache_dir()} (`.ci/run` fetches "
                    "it); `.ci/run` checks the gpu extra with pip's real resolver")
    mine, pins = ours(ROOT / "setup.py"), read_constraints(ROOT / "constraints.txt")
    sglang = [r for r in dist_requirements(wheel) if active(r)]
    found = []
    for d in cached:
        reqs = dist_requirements(d)
        found += conflicts(mine, reqs, d.name, pins, theirs_extras=te.extras)
        found += conflicts(sglang, reqs, d.name, theirs_extras=te.extras)
    assert not found, "\n".join(found)


# ------------------------------------------------------------------- the check on planted conflicts
SGLANG_REQS = [Requirement(r) for r in (
    "openai==2.8.0", "python-dateutil<3", "prometheus-client>=0.20.0", "torch==2.14.1",
    "av==16.1.0; sys_platform == 'linux' and platform_machine == 'aarch64'", "ray[default]>=2.55.1; extra == 'ray'")]


def test_a_planted_exact_pin_conflict_fails_naming_both_sides_and_the_fix():
    found = conflicts([Requirement("openai==3.54.0")], SGLANG_REQS, "sglang-0.5.23.whl")
    assert len(found) == 1
    msg = found[0]
    assert "setup.py requires openai==3.54.0" in msg and "sglang-0.5.23.whl requires openai==2.8.0" in msg
    assert "loosen setup.py's openai to a range that admits ==2.8.0" in msg and "constraints.txt" in msg


def test_a_planted_constraint_conflict_fails_naming_both_sides_and_the_fix():
    pins = {"python-dateutil": Version("4.0.0"), "openai": Version("2.8.0"), "torch": Version("2.13.0")}
    found = conflicts([Requirement("openai>=2.8,<4"), Requirement("torch>=2.13,<2.15")], SGLANG_REQS,
                      "sglang-0.5.23.whl", pins)
    assert found == ["constraints.txt pins python-dateutil==4.0.0 but sglang-0.5.23.whl requires python-dateutil<3: "
                     "pin a version that satisfies <3 (and setup.py's range), so that CI tests a version SGLang "
                     "accepts (or, if the dev environment must differ, add it to DEV_ONLY with the reason)"]
    # torch is DEV_ONLY; without the exception it is named too
    assert any("torch==2.13.0" in m for m in conflicts([], SGLANG_REQS, "w", pins, dev_only={}))


def test_ranges_that_admit_sglangs_pass_and_markers_and_extras_are_evaluated():
    mine = [Requirement(r) for r in ("openai>=2.8,<4", "prometheus_client==0.26.0", "torch>=2.13.0,<2.15",
                                     "av==1.0", "ray==2.60.0")]
    # av applies to aarch64 only and ray only with SGLang's `ray` extra, which we do not ask for
    assert conflicts(mine, SGLANG_REQS, "w") == []
    assert conflicts([Requirement("ray==2.0")], SGLANG_REQS, "w", theirs_extras=("ray",))
    aarch64 = {"sys_platform": "linux", "platform_machine": "aarch64", "python_version": "3.11"}
    assert conflicts(mine, SGLANG_REQS, "w", env=aarch64)  # av==1.0 vs av==16.1.0
    # a requirement of ours behind a marker that is false on the target platform is not installed
    assert conflicts([Requirement("openai==3.54.0; sys_platform == 'win32'")], SGLANG_REQS, "w") == []


@pytest.mark.parametrize("a, b, expected", [
    ("==3.54.0", "==2.8.0", False), (">=2.8,<4", "==2.8.0", True), ("<3", ">=3", False), ("<3", ">=2.9", True),
    (">2.8", "<=2.8", False), (">2.8", "<2.8.1", True), ("~=2.8", ">=2.9,<2.10", True), ("~=2.8.0", ">=2.9", False),
    ("==2.8.*", ">=2.8.5,<2.9", True), ("==2.8.*", ">=2.9", False), ("!=2.8.0", "==2.8.0", False),
    ("", "<3", True), (">=0.20.0", "==0.26.0", True), ("<2.15,>=2.13.0", "==2.14.1", True),
])
def test_intersects(a, b, expected):
    assert intersects(SpecifierSet(a), SpecifierSet(b)) is expected
    assert intersects(SpecifierSet(b), SpecifierSet(a)) is expected


def test_reads_sdist_and_bare_metadata(tmp_path):
    import io
    import tarfile

    meta = "Metadata-Version: 2.4\nName: te-torch\nVersion: 2.20.2\nRequires-Dist: torch>=2.1\nRequires-Dist: einops\n"
    sdist = tmp_path / "te_torch-2.20.2.tar.gz"
    with tarfile.open(sdist, "w:gz") as t:
        data = meta.encode()
        info = tarfile.TarInfo("te_torch-2.20.2/PKG-INFO")
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    bare = tmp_path / "te_torch-2.20.2-py3-none-any.whl.metadata"
    bare.write_text(meta)
    for f in (sdist, bare):
        assert [str(r) for r in dist_requirements(f)] == ["torch>=2.1", "einops"]


def test_the_command_line_names_the_conflict(tmp_path, wheel, capsys):
    from rollout_sglang.testing.sglang_pins import main

    (tmp_path / "setup.py").write_text((ROOT / "setup.py").read_text().replace('"openai>=2.8,<4"', '"openai==3.54.0"'))
    (tmp_path / "constraints.txt").write_text((ROOT / "constraints.txt").read_text())
    with pytest.raises(SystemExit) as e:
        main(["--root", str(tmp_path), str(wheel)])
    assert e.value.code == 1
    assert "setup.py requires openai==3.54.0 but sglang-" in capsys.readouterr().out
