"""The image recipe (Dockerfile) the chart's default values point at.

No container engine runs here, so the Dockerfile is parsed and linted with hadolint (from a
PyPI wheel, k8s/fetch_tools.py) and checked against the chart and the project: same Ray
version as the chart's ``rayVersion`` and the Ray the app is tested with, the image name and
tag the chart defaults to, and a build context that contains what the COPY lines need.
"""

from __future__ import annotations

import fnmatch
import re
import subprocess
import tomllib

import pytest
import yaml

from tests.k8s.chart import CHART, REPO, _fetch_tools

DOCKERFILE = REPO / "Dockerfile"


@pytest.fixture(scope="module")
def hadolint() -> str:
    return str(_fetch_tools().hadolint_path())


def _args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE.read_text(), flags=re.M))


def test_hadolint_clean(hadolint, tmp_path):
    r = subprocess.run([hadolint, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    # and the linter does reject a broken recipe
    bad = tmp_path / "Dockerfile"
    bad.write_text(DOCKERFILE.read_text().replace("WORKDIR", "WORKDIRR", 1))
    r = subprocess.run([hadolint, "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0


def test_base_image_is_the_rays_the_chart_and_tests_use():
    import ray

    args = _args()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert re.search(r"^FROM rayproject/ray:\$\{RAY_VERSION\}-\$\{RAY_VARIANT\}$", DOCKERFILE.read_text(), re.M)
    assert args["RAY_VERSION"] == values["rayVersion"] == ray.__version__
    py = re.match(r"py(\d)(\d+)-(gpu|cpu|cu\d+)", args["RAY_VARIANT"])
    assert py, args["RAY_VARIANT"]
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    lo = tuple(int(x) for x in requires.removeprefix(">=").split("."))
    assert (int(py.group(1)), int(py.group(2))) >= lo


def test_chart_default_image_is_this_recipe():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert values["image"]["repository"] == "specedge-serve" and not values["image"]["tag"]
    assert chart["appVersion"] == project["version"]  # the default tag is appVersion
    assert f"specedge-serve:{project['version']}" in DOCKERFILE.read_text()
    assert _args()["TORCH_SPEC"].startswith("torch==")  # pinned, like the Makefile's CPU install


def test_build_context_holds_what_copy_needs():
    rules = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]

    def included(path: str) -> bool:  # .dockerignore semantics: the last matching rule wins
        keep = True
        for rule in rules:
            neg = rule.startswith("!")
            pat = rule.lstrip("!").rstrip("/")
            if fnmatch.fnmatch(path, pat) or path.startswith(pat + "/"):
                keep = neg
        return keep

    sources = []
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY "):
            parts = [p for p in line.split()[1:] if not p.startswith("--")]
            sources += parts[:-1]
    assert sources
    for src in sources:
        assert (REPO / src).exists(), src
        assert included(src), f"{src} is excluded by .dockerignore"
    assert not included(".venv") and not included(".cache/models") and not included(".git")
    assert (REPO / "specdec" / "model" / "loading.py").exists()  # `python -m specdec.model.loading`
