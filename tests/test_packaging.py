"""What an install carries: a wheel built from this checkout holds every shipped recipe and cluster
profile (package data), and the supported-versions table is the one setup.py and the README use."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from prism_megatron.megatron import versions
from prism_megatron.recipes import ROOT

REPO = Path(__file__).resolve().parents[1]


def test_wheel_carries_the_recipes_and_cluster_profiles(tmp_path):
    shipped = sorted(p.relative_to(REPO).as_posix() for p in ROOT.rglob("*.yaml"))
    assert any("/mini/" in p for p in shipped) and any("/clusters/" in p for p in shipped)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(REPO)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (wheel,) = (tmp_path / "dist").glob("prism_megatron-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        in_wheel = sorted(n for n in names if n.endswith(".yaml"))
        assert in_wheel == shipped, "the wheel's YAML files differ from the checkout's"
        assert "prism_megatron/recipes/__init__.py" in names
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    bounds = versions.requirement().removeprefix("megatron-core").split(",")
    pins = [line for line in metadata.splitlines() if line.startswith("Requires-Dist: megatron-core")]
    assert pins and all(bound in line for line in pins for bound in bounds), (pins, bounds)


def test_recipes_load_from_the_package_outside_a_checkout(tmp_path):
    """`recipe list` / `recipe show` from a directory that is no checkout find the package's recipes."""
    proc = subprocess.run([sys.executable, "-m", "prism_megatron", "recipe", "list"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "mini-dense-tp2pp2dp2" in proc.stdout


def test_the_readme_states_the_supported_table():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert versions.tested_line() in readme


def test_every_seam_names_the_supported_releases():
    import importlib
    import pkgutil

    import prism_megatron.patches as patches

    for info in pkgutil.iter_modules(patches.__path__):
        module = importlib.import_module(f"prism_megatron.patches.{info.name}")
        assert getattr(module, "CHECKED", None) == versions.checked_versions(), info.name


def test_auto_driver_and_requirement_from_the_table():
    assert versions.requirement() == "megatron-core>=0.16,<0.20"
    for row in versions.SUPPORTED:
        assert versions.auto_driver(row.version) == (row.auto_driver, row.why)
        patch = row.version.rsplit(".", 1)[0] + ".9"  # another patch release of a supported minor
        assert versions.support_for(patch) is row
    driver, why = versions.auto_driver("0.18.0")
    assert driver == "core" and "0.18.0 is not a supported release" in why
    assert versions.auto_driver(None)[0] == "core"


def test_every_test_that_runs_megatron_carries_the_marker():
    """.ci/run's Python 3.12 leg selects the Megatron tests by the `megatron` marker: a file that imports
    Megatron or runs a recipe (itself or through the shared ``megatron_runs``) without it would silently
    stay untested on the second stack."""
    import re

    unmarked = []
    for path in sorted((REPO / "tests").glob("test_*.py")):
        text = path.read_text(encoding="utf-8")
        runs_megatron = (re.search(r"^\s*(import|from) megatron\b", text, re.M) or '"run", "--recipe"' in text
                         or re.search(r"\bmegatron_runs\b", text))  # the shared captures (conftest)
        if runs_megatron and "pytest.mark.megatron" not in text:
            unmarked.append(path.name)
    assert not unmarked


def test_ci_runs_the_readme_test_command_verbatim():
    """CI's first leg is exactly what the README tells a user to run; its second reads the table's pins and
    runs the Megatron tests but the heavy ones (pytest.ini declares both markers)."""
    import re

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    command = next(b for b in blocks if b.startswith("python3 -m venv") and b.endswith("pytest -q"))
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert command in ci.splitlines()
    assert "prism_megatron/megatron/versions.py" in ci and '-m "megatron and not heavy"' in ci
    ini = (REPO / "pytest.ini").read_text(encoding="utf-8")
    assert re.search(r"^ +megatron: ", ini, re.M) and re.search(r"^ +heavy: ", ini, re.M)
